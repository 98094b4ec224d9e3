"""Structured logging: one ``key=value`` line per event (logfmt).

Every line carries ``ts``, ``level``, ``plugin`` and ``msg``; callers add the ids that matter
(``rpc``, ``volume_id``, ``device_id``, ``container_id``, ...) as keyword fields::

    log = get_logger("csi")
    log.info("volume staged", volume_id=vid, staging_path=str(path))

Values are quoted when they contain spaces, quotes, ``=`` or anything not printable; inside quotes a backslash, a
quote and every unprintable character (CR, LF, ESC, NUL, other control and format characters, line separators) are
escaped (``\\n``, ``\\x1b``, ``\\u2028``), so a value taken from a request can never start a line of its own or
drive a terminal. Secrets are never passed as fields: servicers log ids, not requests.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


_SHORT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[c]
    if c.isprintable():
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _quote(value: object) -> str:
    s = str(value)
    if s and s.isprintable() and not any(c in s for c in ' "='):
        return s
    return '"' + "".join(map(_escape, s)) + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"ts={ts}", f"level={record.levelname.lower()}"]
        fields: dict[str, Any] = getattr(record, "fields", {})
        plugin = fields.get("plugin", record.name.removeprefix("nodeplug.") or "agent")
        parts.append(f"plugin={_quote(plugin)}")
        parts.append(f"msg={_quote(record.getMessage())}")
        parts.extend(f"{k}={_quote(v)}" for k, v in fields.items() if k != "plugin" and v is not None)
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class Logger:
    """A thin wrapper over :class:`logging.Logger` taking structured fields as keywords."""

    def __init__(self, name: str, **bound: Any) -> None:
        self._log = logging.getLogger(f"nodeplug.{name}")
        self._bound = {"plugin": name, **bound}

    def bind(self, **fields: Any) -> Logger:
        child = Logger.__new__(Logger)
        child._log = self._log
        child._bound = {**self._bound, **fields}
        return child

    def _emit(self, level: int, msg: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, msg, exc_info=exc_info, extra={"fields": {**self._bound, **fields}})

    def debug(self, msg: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._emit(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._emit(logging.WARNING, msg, False, fields)

    def error(self, msg: str, exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, exc_info, fields)


def get_logger(plugin: str, **bound: Any) -> Logger:
    return Logger(plugin, **bound)


def setup(level: str = "info", stream: Any = None) -> None:
    """Configure the ``nodeplug`` logger tree once for the process."""
    root = logging.getLogger("nodeplug")
    root.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root.addHandler(handler)
    root.setLevel(_LEVELS.get(level, logging.INFO))
    root.propagate = False
