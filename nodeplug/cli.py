"""The ``nodeplug`` command: ``agent``, ``doctor``, ``version``, and the plugins' commands (``install-cni``).

Exit status: 0 success; 1 runtime failure (a plugin failed to start, a doctor check failed); 2 usage or config
errors (one line per problem on stderr, nothing created).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nodeplug import __version__
from nodeplug import log as logging_setup
from nodeplug.config import ConfigError, load
from nodeplug.plugins import PLUGINS

if TYPE_CHECKING:
    from nodeplug.kube import KubeSource


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeplug", description="Kubernetes node agent: devices, volumes, networks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    agent = sub.add_parser("agent", help="run the agent (device plugin, CSI driver, CNI server)")
    agent.add_argument("--config", type=Path, help="agent config file (YAML); built-in defaults when omitted")
    agent.add_argument("--root", type=Path, help="place every host path under this directory (overrides root:)")
    agent.add_argument("--check-config", type=Path, metavar="FILE", help="only validate FILE and exit")
    _kube_arguments(agent)

    doctor = sub.add_parser("doctor", help="check this node and the running agent end to end")
    doctor.add_argument("--config", type=Path, help="the agent's config file; built-in defaults when omitted")
    doctor.add_argument("--root", type=Path, help="the agent's --root")
    _kube_arguments(doctor)

    for spec in PLUGINS:
        for command in spec.commands:
            command.add_arguments(sub.add_parser(command.name, help=command.help))

    sub.add_parser("version", help="print the version")
    return parser


def _kube_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", type=Path, metavar="FILE",
        help="follow the Kubernetes API this kubeconfig names (default: $KUBECONFIG, else the in-cluster service "
        "account, else none: single-node)",
    )  # fmt: skip
    parser.add_argument(
        "--node-name", metavar="NAME", help="this node's name in the API (default: $NODE_NAME, else the host name)"
    )


def _kube_or_exit(args: argparse.Namespace) -> tuple[KubeSource | None, str]:
    """The Kubernetes API source (None: single-node) and this node's name; exit 2 when the named source is bad."""
    from nodeplug.kube.config import KubeConfigError, node_name, resolve

    try:
        source = resolve(args.kubeconfig)
    except KubeConfigError as e:
        print(f"nodeplug: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return source, node_name(args.node_name)


def _load_or_exit(config: Path | None, root: Path | None) -> object:
    try:
        return load(config, root)
    except ConfigError as e:
        print(f"nodeplug: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"nodeplug {__version__}")
        return 0
    if args.command == "agent":
        if args.check_config is not None:
            cfg = _load_or_exit(args.check_config, args.root)
            print(f"{args.check_config}: ok")
            return 0
        from nodeplug.agent import Agent
        from nodeplug.config import AgentConfig

        cfg = _load_or_exit(args.config, args.root)
        assert isinstance(cfg, AgentConfig)
        source, node = _kube_or_exit(args)
        logging_setup.setup(cfg.log_level)
        return asyncio.run(Agent(cfg, args.config, args.root, source, node).run())
    if args.command == "doctor":
        from nodeplug.config import AgentConfig
        from nodeplug.doctor import doctor

        cfg = _load_or_exit(args.config, args.root)
        assert isinstance(cfg, AgentConfig)
        source, node = _kube_or_exit(args)
        logging_setup.setup("warning")
        return asyncio.run(doctor(cfg, sys.stdout, source, node))
    for spec in PLUGINS:
        for command in spec.commands:
            if args.command == command.name:
                return command.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
