"""The CNI plugin as the agent shell knows it: the ``cni`` section (the thick-mode server), how it is built, its
doctor checks and the ``install-cni`` command. Imports only its config; the server's code loads when it starts."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cni.config import Config
from nodeplug.plugin import AgentContext, Command, Plugin, PluginSpec

if TYPE_CHECKING:
    from nodeplug.checks import Check
    from nodeplug.config import AgentConfig


def _of(cfg: AgentConfig) -> Config:
    return cfg.cni


def _create(section: Config, ctx: AgentContext) -> Plugin[Config]:
    from cni.plugin import CniPlugin

    return CniPlugin(section, ctx)


def _checks(section: Config, ctx: AgentContext) -> list[Check]:
    from cni.doctor import checks

    return checks(section, ctx)


def _install_arguments(parser: argparse.ArgumentParser) -> None:
    from cni.install.cli import add_arguments

    add_arguments(parser)


def _install(args: argparse.Namespace) -> int:
    from cni.install.cli import run

    return run(args)


INSTALL_CNI = Command(
    "install-cni", "install the CNI entry point and conflist on the host", _install_arguments, _install
)

SPEC = PluginSpec(name="cni", section=Config, of=_of, create=_create, checks=_checks, commands=(INSTALL_CNI,))
