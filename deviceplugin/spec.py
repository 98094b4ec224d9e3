"""The device plugin (and the DRA driver under it) as the agent shell knows it: its config section, how it is
built and its doctor checks. Imports only its config; the plugin's code loads when it starts or ``nodeplug doctor``
checks it."""

from __future__ import annotations

from deviceplugin.config import Config
from nodeplug.plugin import Implementation, PluginSpec


def _load() -> Implementation[Config]:
    from deviceplugin import doctor, plugin

    return Implementation(plugin.DevicePlugin, doctor.checks)


SPEC = PluginSpec(name="deviceplugin", section=Config, of=lambda cfg: cfg.deviceplugin, load=_load)
