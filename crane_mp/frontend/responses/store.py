"""Responses kept for `previous_response_id` and GET /v1/responses/{id} (the Responses API's `store`).

Every frontend of a server must find what another stored (the kernel spreads connections over them),
so each response is one JSON file in the server's private run directory (mode 0700, removed when the
server stops), written whole and renamed into place. Kept until the server stops, or until the newest
MAX_RESPONSES responses or MAX_BYTES of them push it out (oldest first); one larger than MAX_RECORD
bytes is not kept at all.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20
MAX_RECORD = 8 << 20
_ID = re.compile(r"^resp_[0-9a-f]{32}$")


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Keep `record` under `response_id`; False when it is too large to keep."""
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD or not _ID.match(response_id):
            return False
        partial = self.directory / f".{response_id}.{os.getpid()}"
        partial.write_bytes(data)
        os.replace(partial, self.directory / f"{response_id}.json")
        self._evict()
        return True

    def get(self, response_id: str) -> dict[str, Any] | None:
        if not _ID.match(response_id):
            return None
        try:
            return json.loads((self.directory / f"{response_id}.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def delete(self, response_id: str) -> bool:
        if not _ID.match(response_id):
            return False
        try:
            (self.directory / f"{response_id}.json").unlink()
        except FileNotFoundError:
            return False
        return True

    def _evict(self) -> None:
        entries = []
        for path in self.directory.glob("resp_*.json"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another frontend evicted it meanwhile
                continue
            entries.append((stat.st_mtime_ns, stat.st_size, path))
        entries.sort(reverse=True)  # newest first
        kept_bytes = 0
        for count, (_, size, path) in enumerate(entries):
            kept_bytes += size
            if count >= MAX_RESPONSES or kept_bytes > MAX_BYTES:
                path.unlink(missing_ok=True)
