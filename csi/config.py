"""The ``csi`` section of the agent config."""

from __future__ import annotations

from nodeplug.configbase import Section


class Config(Section):
    """Placeholder: the csi owner fills in the real fields."""
