"""JSON from an untrusted peer (stdin, a delegated plugin's stdout, a thick-mode request): strict, and failing only
with ValueError.

``json.loads`` accepts the non-standard literals ``NaN``, ``Infinity`` and ``-Infinity`` and raises RecursionError
(not a ValueError) for a document nested deeper than the interpreter's recursion limit (about 1,000 levels). Here
both are ValueErrors, so one ``except ValueError`` (UnicodeDecodeError is one too) turns any bad input into the spec's
decode error. Standard library only: this is on the entry point's start-up path.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


_json: Any = None
_decoder: Any = None


def loads(data: bytes | str) -> Any:
    """The one JSON value in ``data``; ValueError for anything else (including NaN, Infinity and deep nesting)."""
    global _json, _decoder
    if _decoder is None:
        import json  # here, not at the top: VERSION and the launcher's notes need no JSON at all

        _json, _decoder = json, json.JSONDecoder(parse_constant=_no_constant)  # made once: json.loads makes one a call
    if isinstance(data, (bytes, bytearray)):
        data = data.decode(_json.detect_encoding(data), "surrogatepass")  # as json.loads decodes bytes
    try:
        return _decoder.decode(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None
