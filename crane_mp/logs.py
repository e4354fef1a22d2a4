"""Log set-up shared by every process: text lines, or one JSON object per line (--log-format json).

A record may carry `fields` (a dict, e.g. the access log's): text lines append them as key=value,
JSON lines as keys of their own.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "info"
    format: str = "text"  # or "json"
    model: str = ""  # one model of several: every line names it


class TextFormatter(logging.Formatter):
    def __init__(self, model: str = "") -> None:
        super().__init__(_TEXT_FORMAT.replace("%(name)s", f"%(name)s[{model}]") if model else _TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, model: str = "") -> None:
        super().__init__()
        self.model = model

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if self.model:
            entry["model"] = self.model
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def _text_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, str) and (not value or not value.isprintable() or any(c in value for c in ' "=')):
        return json.dumps(value, ensure_ascii=False)
    return "-" if value is None else str(value)


def configure_logging(settings: LogSettings) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(settings.model) if settings.format == "json" else TextFormatter(settings.model))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
    logging.captureWarnings(True)  # Python warnings as log lines too (one JSON object each)
