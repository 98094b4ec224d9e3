"""Base model for every config section, and the one place validation errors are turned into text.

Sections are pydantic models that forbid unknown keys and are immutable once loaded. A failed validation becomes one
line per problem: ``<field path>: <what was expected>, got <value>``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, validate_default=True)

    enabled: bool = True


def absolute_path(v: str) -> str:
    """A path a section names for the agent (root) to write or serve: absolute, without '..' or NUL."""
    if not v.startswith("/"):
        raise ValueError("expected an absolute path")
    if "\x00" in v or any(part == ".." for part in v.split("/")):
        raise ValueError("expected a path without '..' or NUL")
    return v


AbsPath = Annotated[str, AfterValidator(absolute_path)]


def field_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per problem, naming the field path, what was expected and the value found."""
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            lines.append(f"{field_path(loc, prefix)}: unknown key (check its spelling and nesting)")
        elif e["type"] == "missing":
            lines.append(f"{field_path(loc, prefix)}: required field is missing")
        else:
            msg = msg.removeprefix("Value error, ")
            lines.append(f"{field_path(loc, prefix)}: {msg[0].lower() + msg[1:]}, got {_show(e.get('input'))}")
    return lines
