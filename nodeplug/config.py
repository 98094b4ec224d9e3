"""The agent config: one YAML document, validated whole before the agent creates anything.

::

    root: /                      # every host path is placed under this directory
    log_level: info              # debug | info | warning | error
    http:
      address: 127.0.0.1:9450    # /healthz, /readyz, /metrics
    shutdown_grace_seconds: 5
    deviceplugin: {enabled: true, ...}     # deviceplugin.config.Config
    csi: {enabled: true, ...}              # csi.config.Config
    cni: {enabled: true, ...}              # cni.config.Config
    cluster_network: {enabled: true, ...}  # cni.cluster.config.ClusterConfig
    network_policy: {enabled: true, ...}   # cni.policy.config.PolicyConfig

One section per plugin of :mod:`nodeplug.plugins`. Unknown keys are errors. :func:`load` raises
:class:`ConfigError` carrying one line per problem.

Moved keys: the cluster network's section was ``cni.cluster`` before it became a plugin of its own; a config that
still has it there is read as ``cluster_network`` (with a note in :attr:`AgentConfig.notes`, which the agent logs),
and one that has both is refused.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from nodeplug.configbase import format_errors
from nodeplug.plugins import (
    ClusterNetworkSection,
    CniSection,
    CsiSection,
    DevicePluginSection,
    NetworkPolicySection,
)


class ConfigError(Exception):
    """The config is invalid; ``problems`` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid config:\n" + "\n".join(f"  {p}" for p in problems))


class HttpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = "127.0.0.1:9450"

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("expected HOST:PORT with a port from 0 to 65535")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if host != "localhost":
                raise ValueError("expected an IP address or localhost before the port") from None
        return v

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path = Path("/")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    http: HttpConfig = Field(default_factory=HttpConfig)
    shutdown_grace_seconds: float = Field(default=5.0, ge=0, le=300)
    deviceplugin: DevicePluginSection = Field(default_factory=DevicePluginSection)
    csi: CsiSection = Field(default_factory=CsiSection)
    cni: CniSection = Field(default_factory=CniSection)
    cluster_network: ClusterNetworkSection = Field(default_factory=ClusterNetworkSection)
    network_policy: NetworkPolicySection = Field(default_factory=NetworkPolicySection)
    # what loading had to say about the file (a moved key read at its new place); logged by the agent
    _notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def notes(self) -> tuple[str, ...]:
        return self._notes

    @field_validator("root")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError("expected an absolute path")
        return v


def _moved(data: dict[str, Any], source: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``cni.cluster`` read as ``cluster_network`` (see the module docstring), and the note saying so."""
    cni = data.get("cni")
    if not isinstance(cni, dict) or "cluster" not in cni:
        return data, ()
    if "cluster_network" in data:
        problem = "cni.cluster: moved to cluster_network, which is also given: keep only cluster_network"
        raise ConfigError(source, [problem])
    rest = {k: v for k, v in cni.items() if k != "cluster"}
    note = "cni.cluster is read as cluster_network (its place since the cluster network is a plugin of its own)"
    return {**data, "cni": rest, "cluster_network": cni["cluster"]}, (note,)


def parse(data: Any, source: str = "config") -> AgentConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"(top level): expected a mapping of sections, got {type(data).__name__}"])
    data, notes = _moved(data, source)
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, format_errors(e)) from None
    cfg._notes = notes
    return cfg


def load(path: Path | None, root: Path | None = None) -> AgentConfig:
    """Read and validate ``path`` (built-in defaults when None); ``root`` overrides the file's ``root``."""
    data: Any = {}
    source = str(path) if path else "built-in defaults"
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(source, [f"cannot read the config file: {e.strerror}"]) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            raise ConfigError(source, [f"{where}not valid YAML ({getattr(e, 'problem', e)})"]) from None
    cfg = parse(data, source)
    if root is not None:
        if not root.is_absolute():
            root = root.resolve()
        cfg = cfg.model_copy(update={"root": root})
    return cfg
