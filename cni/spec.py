"""The CNI plugin as the agent shell knows it: the ``cni`` section (the thick-mode server), how it is built, its
doctor checks and the ``install-cni`` command. Imports only its config; the server's code loads when it starts or
``nodeplug doctor`` checks it."""

from __future__ import annotations

import argparse

from cni.config import Config
from nodeplug.plugin import Command, Implementation, PluginSpec


def _load() -> Implementation[Config]:
    from cni import doctor, plugin

    return Implementation(plugin.CniPlugin, doctor.checks)


def _install_arguments(parser: argparse.ArgumentParser) -> None:
    from cni.install.cli import add_arguments

    add_arguments(parser)


def _install(args: argparse.Namespace) -> int:
    from cni.install.cli import run

    return run(args)


INSTALL_CNI = Command(
    "install-cni", "install the CNI entry point and conflist on the host", _install_arguments, _install
)

SPEC = PluginSpec(name="cni", section=Config, of=lambda cfg: cfg.cni, load=_load, commands=(INSTALL_CNI,))
