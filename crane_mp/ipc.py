"""ZMQ socket addresses in the launcher's private run directory, and typed msgspec encode/decode.

Every frame is msgpack decoded against the receiver's union of message types: a malformed or foreign
frame raises instead of being executed (nothing is ever pickled).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from crane_mp.protocol import FrontendInbox, SchedulerInbox, WorkerInbox


@dataclass(frozen=True, slots=True)
class Addresses:
    run_dir: str

    def _ipc(self, name: str) -> str:
        return f"ipc://{Path(self.run_dir) / name}"

    @property
    def scheduler_inbox(self) -> str:
        """PULL bound by the scheduler; frontends and the worker PUSH to it."""
        return self._ipc("scheduler.sock")

    @property
    def worker_inbox(self) -> str:
        """PUSH bound by the scheduler, PULL connected by the worker."""
        return self._ipc("worker.sock")

    def frontend_inbox(self, frontend_id: int) -> str:
        """PUSH bound by the scheduler, PULL connected by frontend `frontend_id`."""
        return self._ipc(f"frontend-{frontend_id}.sock")


_encoder = msgspec.msgpack.Encoder()
scheduler_decoder = msgspec.msgpack.Decoder(SchedulerInbox)
worker_decoder = msgspec.msgpack.Decoder(WorkerInbox)
frontend_decoder = msgspec.msgpack.Decoder(FrontendInbox)


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: back-pressure is the scheduler's job (admission, KV budget), never a dropped frame.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock
