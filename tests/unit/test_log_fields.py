"""Log lines carry request fields (container ids, interface names, volume ids) that a caller chose: whatever they hold,
one event stays one line, nothing unprintable reaches the log, and the value can be read back exactly."""

from __future__ import annotations

import io
import logging

from hypothesis import given
from hypothesis import strategies as st

from nodeplug.log import LogfmtFormatter, get_logger, setup


def line(**fields: object) -> str:
    record = logging.LogRecord("nodeplug.cni", logging.INFO, __file__, 1, "CNI request done", None, None)
    record.fields = {"plugin": "cni", **fields}
    return LogfmtFormatter().format(record)


def unquote(value: str) -> str:
    if not value.startswith('"'):
        return value
    return value[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")


def field_of(text: str, key: str) -> str:
    start = text.index(f" {key}=") + len(key) + 2
    if text[start] != '"':
        return text[start:].split(" ", 1)[0]
    end = start + 1
    while text[end] != '"':
        end += 2 if text[end] == "\\" else 1
    return text[start : end + 1]


def test_control_characters_cannot_forge_a_line() -> None:
    forged = 'c1\rts=2030-01-01T00:00:00.000Z level=info msg="all good"\n\x1b[2J\x00'
    text = line(container_id=forged, ifname="eth0\u2028x")
    assert text.splitlines() == [text]
    assert text.isprintable()
    assert "\\r" in text and "\\n" in text and "\\x1b" in text and "\\x00" in text and "\\u2028" in text
    assert unquote(field_of(text, "container_id")) == forged


def test_plain_values_stay_bare() -> None:
    assert " container_id=abc-123 " in line(container_id="abc-123", ifname="eth0") + " "


@given(st.text())
def test_any_value_is_one_printable_line_and_reads_back(value: str) -> None:
    text = line(container_id=value, msg_extra=value)
    assert len(text.splitlines()) == 1 and text.isprintable()
    assert unquote(field_of(text, "container_id")) == value


def test_the_message_and_the_logger_path_are_escaped_too() -> None:
    stream = io.StringIO()
    setup("info", stream)
    get_logger("cni").info("got\nthis", container_id="a\rb")
    out = stream.getvalue()
    assert out.count("\n") == 1 and 'msg="got\\nthis"' in out and 'container_id="a\\rb"' in out
    logging.getLogger("nodeplug").handlers.clear()
