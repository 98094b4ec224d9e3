"""The CNI protocol: environment and stdin in, result or error JSON on stdout, exit status out.

:func:`run` is the one place the protocol lives. Everything it reads or writes is injected (an env mapping, stdin
bytes, a text stream), so it is tested with dicts and buffers and shared verbatim by the standalone entry point and
the agent's thick-mode server. The steps, each failing with its spec code:

1. ``CNI_COMMAND`` known (4); VERSION is answered right here (:func:`cni.versions.version_answer`);
2. the variables the command needs (``CNI_CONTAINERID``, ``CNI_NETNS``, ``CNI_IFNAME``, ``CNI_PATH``) present and
   well formed (4, naming the variable); ``CNI_ARGS`` parsed (4 for an unknown key unless ``IgnoreUnknown``);
3. stdin decoded as a JSON object (6); ``cniVersion`` supported and allowing the command (1);
   the config validated (7, naming the field);
4. the command's handler from the table runs and returns a :class:`cni.types.Result` (ADD) or None; the result is
   written in the config's ``cniVersion`` (:mod:`cni.versions`).

Any :class:`cni.errors.CniError` becomes ``{"cniVersion", "code", "msg", "details"}`` on stdout with exit status 1;
any other exception becomes code 999 (internal). Nothing is printed on a successful DEL, CHECK, GC or STATUS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, TextIO

from cni import netconf, versions
from cni.errors import INTERNAL, INVALID_ENVIRONMENT, INVALID_NETWORK_CONFIG, CniError
from cni.netconf import NetConf
from cni.types import EMPTY, Result, repr_without

COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "GC", "STATUS")

# Variables each command requires (as the Go skel: CNI_NETNS is optional for DEL).
_REQUIRED = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"),
    "GC": (),
    "STATUS": (),
    "VERSION": (),
}

_CONTAINER_ID = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$")
KNOWN_ARGS = ("IgnoreUnknown", "K8S_POD_NAMESPACE", "K8S_POD_NAME", "K8S_POD_INFRA_CONTAINER_ID", "K8S_POD_UID", "IP")


class CniArgs(NamedTuple):
    """``CNI_ARGS`` (``"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;..."``), the keys nodeplug knows."""

    ignore_unknown: bool = False
    k8s_pod_namespace: str = ""
    k8s_pod_name: str = ""
    k8s_pod_infra_container_id: str = ""
    k8s_pod_uid: str = ""
    ips: tuple[str, ...] = ()  # IP=10.22.0.9[,fd00::9]: requested addresses (as host-local's CNI_ARGS IP)
    pairs: tuple[tuple[str, str], ...] = ()


def parse_cni_args(text: str) -> CniArgs:
    if not text:
        return CniArgs()
    pairs: list[tuple[str, str]] = []
    for item in text.split(";"):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CniError(
                INVALID_ENVIRONMENT, details=f"CNI_ARGS: expected KEY=VALUE pairs separated by ';', got {item!r}"
            )
        pairs.append((key, value))
    d = dict(pairs)
    ignore = d.get("IgnoreUnknown", "").lower() in ("1", "true")
    if "IgnoreUnknown" in d and d["IgnoreUnknown"].lower() not in ("1", "true", "0", "false"):
        raise CniError(
            INVALID_ENVIRONMENT, details=f"CNI_ARGS: IgnoreUnknown: expected 1/0/true/false, got {d['IgnoreUnknown']!r}"
        )
    if not ignore:
        unknown = [k for k, _ in pairs if k not in KNOWN_ARGS]
        if unknown:
            raise CniError(
                INVALID_ENVIRONMENT,
                details=f"CNI_ARGS: unknown key {unknown[0]!r} (known: {', '.join(KNOWN_ARGS)}; "
                "pass IgnoreUnknown=1 to ignore others)",
            )
    ips = tuple(s.strip() for s in d.get("IP", "").split(",") if s.strip())
    return CniArgs(
        ignore_unknown=ignore,
        k8s_pod_namespace=d.get("K8S_POD_NAMESPACE", ""),
        k8s_pod_name=d.get("K8S_POD_NAME", ""),
        k8s_pod_infra_container_id=d.get("K8S_POD_INFRA_CONTAINER_ID", ""),
        k8s_pod_uid=d.get("K8S_POD_UID", ""),
        ips=ips,
        pairs=tuple(pairs),
    )


class Request(NamedTuple):
    """One invocation, validated: what a command handler gets."""

    command: str
    container_id: str
    netns: str  # "" when absent (DEL, GC, STATUS)
    ifname: str
    args: CniArgs
    path: tuple[str, ...]
    conf: NetConf
    env: Mapping[str, str] = EMPTY  # CNI_* vars, for delegation
    stdin: bytes = b""  # the config as received, for delegation

    def __repr__(self) -> str:
        return repr_without(self, ("env", "stdin"))


Handler = Callable[[Request], Result | None]  # a Result for ADD, None otherwise


# What a CNI_* variable must look like when set (whether it must be set depends on the command: _REQUIRED).
_ENV_RULES: tuple[tuple[str, Callable[[str], object], str], ...] = (
    (
        "CNI_CONTAINERID",
        lambda v: _CONTAINER_ID.match(v),
        "letters, digits, '_', '.' and '-' starting with a letter or digit",
    ),
    ("CNI_IFNAME", netconf.ifname_ok, netconf.IFNAME_RULE),
    ("CNI_NETNS", lambda v: v.startswith("/"), "an absolute path"),
)


def parse_env(env: Mapping[str, str]) -> tuple[str, str, str, str, CniArgs, tuple[str, ...]]:
    """Validate the CNI_* variables; (command, container id, netns, ifname, args, path) or code 4."""
    command = env.get("CNI_COMMAND", "")
    if not command:
        raise CniError(INVALID_ENVIRONMENT, details="CNI_COMMAND: required environment variable is missing")
    if command not in COMMANDS:
        raise CniError(
            INVALID_ENVIRONMENT, details=f"CNI_COMMAND: expected one of {', '.join(COMMANDS)}, got {command!r}"
        )
    missing = [v for v in _REQUIRED[command] if not env.get(v)]
    if missing:
        raise CniError(
            INVALID_ENVIRONMENT,
            details=f"{', '.join(missing)}: required environment variable{'s are' if len(missing) > 1 else ' is'} "
            f"missing for {command}",
        )
    for var, ok, expected in _ENV_RULES:
        value = env.get(var, "")
        if value and not ok(value):
            raise CniError(INVALID_ENVIRONMENT, details=f"{var}: expected {expected}, got {value!r}")
    cid, netns, ifname = env.get("CNI_CONTAINERID", ""), env.get("CNI_NETNS", ""), env.get("CNI_IFNAME", "")
    path = tuple(p for p in env.get("CNI_PATH", "").split(":") if p)
    return command, cid, netns, ifname, parse_cni_args(env.get("CNI_ARGS", "")), path


def parse_conf(command: str, stdin: bytes) -> NetConf:
    """Decode (6), check the version (1), validate (7) -> BridgeConf | IpamPluginConf."""
    raw = netconf.decode(stdin)
    version = raw.get("cniVersion")
    if not isinstance(version, str):
        raise CniError(
            INVALID_NETWORK_CONFIG,
            details="cniVersion: required field is missing"
            if version is None
            else f"cniVersion: expected a string, got {json.dumps(version)}",
        )
    versions.check_supported(version, command)
    return netconf.parse(raw)


def run(handlers: Mapping[str, Handler], env: Mapping[str, str], stdin: bytes, stdout: TextIO) -> int:
    """Run one CNI invocation; write the answer to ``stdout``; return the exit status (0 or 1)."""
    try:
        command = env.get("CNI_COMMAND", "")
        if command == "VERSION":
            stdout.write(versions.version_answer())
            return 0
        command, cid, netns, ifname, args, path = parse_env(env)
        conf = parse_conf(command, stdin)
        handler = handlers.get(command)
        if handler is None:
            raise CniError(INVALID_ENVIRONMENT, details=f"CNI_COMMAND: {command} is not implemented by this plugin")
        cni_env = {k: v for k, v in env.items() if k.startswith("CNI_")}
        req = Request(command, cid, netns, ifname, args, path, conf, cni_env, stdin)
        result = handler(req)
        if result is not None:
            stdout.write(json.dumps(versions.convert_result(result.to_dict(), conf.cni_version)))
        return 0
    except CniError as e:
        stdout.write(e.to_json(versions.stdin_version(stdin)))
        return 1
    except Exception as e:  # a bug or an unexpected kernel failure: still spec-shaped
        err = CniError(INTERNAL, details=f"{type(e).__name__}: {e}")
        stdout.write(err.to_json(versions.stdin_version(stdin)))
        return 1
