"""The CSI driver as the agent shell knows it: its config section, how it is built and its doctor checks. Imports
only its config; the driver's code loads when it starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from csi.config import Config
from nodeplug.plugin import AgentContext, Plugin, PluginSpec

if TYPE_CHECKING:
    from nodeplug.checks import Check
    from nodeplug.config import AgentConfig


def _of(cfg: AgentConfig) -> Config:
    return cfg.csi


def _create(section: Config, ctx: AgentContext) -> Plugin[Config]:
    from csi.plugin import CsiPlugin

    return CsiPlugin(section, ctx)


def _checks(section: Config, ctx: AgentContext) -> list[Check]:
    from csi.doctor import checks

    return checks(section, ctx)


SPEC = PluginSpec(name="csi", section=Config, of=_of, create=_create, checks=_checks)
