"""The device plugin (and the DRA driver under it) as the agent shell knows it: its config section, how it is
built and its doctor checks. Imports only its config; the plugin's code loads when it starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deviceplugin.config import Config
from nodeplug.plugin import AgentContext, Plugin, PluginSpec

if TYPE_CHECKING:
    from nodeplug.checks import Check
    from nodeplug.config import AgentConfig


def _of(cfg: AgentConfig) -> Config:
    return cfg.deviceplugin


def _create(section: Config, ctx: AgentContext) -> Plugin[Config]:
    from deviceplugin.plugin import DevicePlugin

    return DevicePlugin(section, ctx)


def _checks(section: Config, ctx: AgentContext) -> list[Check]:
    from deviceplugin.doctor import checks

    return checks(section, ctx)


SPEC = PluginSpec(name="deviceplugin", section=Config, of=_of, create=_create, checks=_checks)
