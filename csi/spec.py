"""The CSI driver as the agent shell knows it: its config section, how it is built and its doctor checks. Imports
only its config; the driver's code loads when it starts or ``nodeplug doctor`` checks it."""

from __future__ import annotations

from csi.config import Config
from nodeplug.plugin import Implementation, PluginSpec


def _load() -> Implementation[Config]:
    from csi import doctor, plugin

    return Implementation(plugin.CsiPlugin, doctor.checks)


SPEC = PluginSpec(name="csi", section=Config, of=lambda cfg: cfg.csi, load=_load)
