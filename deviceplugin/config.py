"""The ``deviceplugin`` section of the agent config."""

from __future__ import annotations

from nodeplug.configbase import Section


class Config(Section):
    """Placeholder: the deviceplugin owner fills in the real fields."""
