"""Kubernetes label selectors (``metav1.LabelSelector``), as NetworkPolicy uses them: parsed once, matched often.

A selector is ``matchLabels`` and ``matchExpressions`` ANDed together; the empty selector matches every set of
labels. Operators: ``In`` and ``NotIn`` (``values`` non-empty; ``NotIn`` also matches when the key is absent),
``Exists`` and ``DoesNotExist`` (``values`` empty). The API server validates selectors, but what arrives is still
hostile: a selector that does not parse becomes :data:`NOTHING`, which matches no labels at all, and the reason is
kept for the log and the doctor (the caller decides what "matches nothing" means for safety: see
:mod:`cni.policy.model`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
OPERATORS: tuple[Operator, ...] = ("In", "NotIn", "Exists", "DoesNotExist")
MAX_KEY, MAX_VALUE = 317, 63  # prefix (253) + "/" + name (63); a label value


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels

    def __str__(self) -> str:
        if self.operator == "Exists":
            return self.key
        if self.operator == "DoesNotExist":
            return f"!{self.key}"
        op = "in" if self.operator == "In" else "notin"
        return f"{self.key} {op} ({','.join(sorted(self.values))})"


@dataclass(frozen=True)
class Selector:
    """``labels`` must all be equal, and every requirement hold; ``valid`` False: matches nothing (``error`` says
    why)."""

    labels: tuple[tuple[str, str], ...] = ()
    requirements: tuple[Requirement, ...] = ()
    valid: bool = True
    error: str = ""

    @property
    def everything(self) -> bool:
        return self.valid and not self.labels and not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        if not self.valid:
            return False
        for k, v in self.labels:
            if labels.get(k) != v:
                return False
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        if not self.valid:
            return f"<invalid: {self.error}>"
        if self.everything:
            return "<all>"
        return ",".join([*(f"{k}={v}" for k, v in self.labels), *(str(r) for r in self.requirements)])


EVERYTHING = Selector()
NOTHING = Selector(valid=False, error="matches nothing")


def _bad(why: str) -> Selector:
    return Selector(valid=False, error=why)


def _text(v: Any, limit: int) -> str | None:
    return v if isinstance(v, str) and len(v) <= limit else None


def parse(raw: Any) -> Selector:
    """A selector from lightkube's ``LabelSelector`` (or anything with ``matchLabels``/``matchExpressions``);
    :data:`EVERYTHING` for None is the caller's choice, not made here: None parses as the empty selector."""
    if raw is None:
        return EVERYTHING
    match_labels = getattr(raw, "matchLabels", None)
    exprs = getattr(raw, "matchExpressions", None)
    labels: list[tuple[str, str]] = []
    if match_labels is not None:
        if not isinstance(match_labels, dict):
            return _bad("matchLabels: expected a map of strings")
        for k, v in match_labels.items():
            key, value = _text(k, MAX_KEY), _text(v, MAX_VALUE)
            if not key or value is None:
                return _bad(f"matchLabels: expected label keys and values, got {str(k)[:40]!r}: {str(v)[:40]!r}")
            labels.append((key, value))
    reqs: list[Requirement] = []
    for i, e in enumerate(exprs or ()):
        key, op, values = _text(getattr(e, "key", None), MAX_KEY), getattr(e, "operator", None), getattr(
            e, "values", None)  # fmt: skip
        if not key:
            return _bad(f"matchExpressions[{i}].key: expected a label key")
        if op not in OPERATORS:
            return _bad(f"matchExpressions[{i}].operator: expected one of {', '.join(OPERATORS)}, got {str(op)[:40]!r}")
        vals = list(values or ())
        if any(_text(v, MAX_VALUE) is None for v in vals):
            return _bad(f"matchExpressions[{i}].values: expected label values")
        if op in ("In", "NotIn") and not vals:
            return _bad(f"matchExpressions[{i}].values: {op} needs at least one value")
        if op in ("Exists", "DoesNotExist") and vals:
            return _bad(f"matchExpressions[{i}].values: {op} takes no values")
        reqs.append(Requirement(key, op, frozenset(vals)))
    return Selector(tuple(sorted(set(labels))), tuple(sorted(set(reqs), key=str)))
