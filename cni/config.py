"""The ``cni`` section of the agent config."""

from __future__ import annotations

from nodeplug.configbase import Section


class Config(Section):
    """Placeholder: the cni owner fills in the real fields."""
