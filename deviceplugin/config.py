"""The ``deviceplugin`` section of the agent config.

::

    deviceplugin:
      host_root: /                    # where the node's /dev and /sys are seen (a DaemonSet mounts the host at /host)
      rescan_seconds: 30              # safety re-scan; changes are seen at once through inotify and uevents
      register_timeout_seconds: 5     # one Register call to kubelet; retried with backoff
      resources:
        - name: fuse                  # advertised to kubelet as nodeplug.io/fuse
          devices: [/dev/fuse]        # device-node globs; one device per matching node
        - name: vfio-nic
          pci:
            - {vendor: "8086", device: "1572", class_prefix: "0200", nodes: ["/dev/vfio/{iommu_group}"]}
          nodes: [/dev/vfio/vfio]     # extra nodes given with every device of this resource
        - name: serial
          usb: [{vendor: "0403", product: "6001", serial: "A10K3XYZ"}]    # serial is optional
          replicas: 1                 # N pods share one device when > 1 (IDs "<id>::<k>"; N devices to DRA)
          allocation: spread          # replicas on distinct devices first (spread) or fill one device first (pack)
          forget_after_seconds: 300   # a vanished device is listed unhealthy this long, then dropped
          permissions: rw             # rw | rwm
          cdi: false                  # true: write a CDI spec and answer with CDI device names
          mounts: [{host_path: /etc/x, container_path: /etc/x, read_only: true}]
          env: {FOO: bar}
          health: {command: [/usr/local/bin/check, "{path}"], timeout_seconds: 5, interval_seconds: 10}
          reset: {command: [/usr/local/bin/reset, "{id}"], timeout_seconds: 30}
          offer: deviceplugin         # deviceplugin | dra | both (DRA: see deviceplugin.dra.config)
      dra: {enabled: auto, ...}       # deviceplugin.dra.config.DraConfig

Placeholders in ``health``/``reset`` commands: ``{id}`` (device ID without the replica suffix), ``{path}`` (first
device node as the agent sees it, under ``host_root``), ``{address}`` (PCI address or USB sysfs name, empty for
globs). PCI ``nodes`` templates take ``{address}`` and ``{iommu_group}``. Every validation error names its field
path.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from deviceplugin.dra.config import DraConfig
from nodeplug.configbase import AbsPath, Section, absolute_path

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEX4 = re.compile(r"^[0-9a-fA-F]{4}$")
_HEXPREFIX = re.compile(r"^[0-9a-fA-F]{2,6}$")
_PLACEHOLDERS = {"id", "path", "address"}
_PCI_PLACEHOLDERS = {"address", "iommu_group"}
_FIELD = re.compile(r"{([^{}]*)}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _dev_path(v: str) -> str:
    absolute_path(v)
    if not v.startswith("/dev/"):
        raise ValueError("expected a path under /dev/")
    return v


DevPath = Annotated[str, AfterValidator(_dev_path)]


def _placeholders(argv: list[str], allowed: set[str]) -> list[str]:
    for arg in argv:
        for name in _FIELD.findall(arg):
            if name not in allowed:
                raise ValueError(f"unknown placeholder {{{name}}} (known: {', '.join(sorted(allowed))})")
    return argv


def _hex4(v: str) -> str:
    if not _HEX4.match(v):
        raise ValueError("expected 4 hex digits")
    return v.lower()


class PciMatch(_Model):
    """PCI functions from ``/sys/bus/pci/devices``; every given field must match."""

    vendor: str | None = None
    device: str | None = None
    class_prefix: str | None = None
    nodes: list[DevPath] = Field(default_factory=lambda: ["/dev/vfio/{iommu_group}"])

    @field_validator("vendor", "device")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        return None if v is None else _hex4(v)

    @field_validator("class_prefix")
    @classmethod
    def _class(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not _HEXPREFIX.match(v):
            raise ValueError("expected 2 to 6 hex digits (class, subclass, prog-if)")
        return v.lower()

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        return _placeholders(v, _PCI_PLACEHOLDERS)

    @model_validator(mode="after")
    def _something(self) -> PciMatch:
        if self.vendor is None and self.device is None and self.class_prefix is None:
            raise ValueError("expected at least one of vendor, device, class_prefix")
        return self


class UsbMatch(_Model):
    """USB devices from ``/sys/bus/usb/devices`` by vendor:product (and serial); their /dev nodes come from sysfs."""

    vendor: str
    product: str
    serial: str | None = None

    @field_validator("vendor", "product")
    @classmethod
    def _hex(cls, v: str) -> str:
        return _hex4(v)


class MountSpec(_Model):
    host_path: AbsPath
    container_path: AbsPath
    read_only: bool = True


class _CommandSpec(_Model):
    """A per-device command: argv with ``{id}``, ``{path}``, ``{address}`` placeholders."""

    command: Annotated[list[str], Field(min_length=1)]

    @field_validator("command")
    @classmethod
    def _cmd(cls, v: list[str]) -> list[str]:
        return _placeholders(v, _PLACEHOLDERS)


class HealthSpec(_CommandSpec):
    timeout_seconds: float = Field(default=5.0, gt=0, le=300)
    interval_seconds: float = Field(default=10.0, ge=0.05, le=3600)


class ResetSpec(_CommandSpec):
    timeout_seconds: float = Field(default=30.0, gt=0, le=600)


class Resource(_Model):
    name: str
    devices: list[DevPath] = Field(default_factory=list)
    pci: list[PciMatch] = Field(default_factory=list)
    usb: list[UsbMatch] = Field(default_factory=list)
    nodes: list[DevPath] = Field(default_factory=list)
    replicas: int = Field(default=1, ge=1, le=1024)
    allocation: Literal["spread", "pack"] = "spread"
    permissions: Literal["rw", "rwm"] = "rw"
    cdi: bool = False
    mounts: list[MountSpec] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    health: HealthSpec | None = None
    reset: ResetSpec | None = None
    forget_after_seconds: float = Field(default=300.0, ge=0, le=86400)
    offer: Literal["deviceplugin", "dra", "both"] = "deviceplugin"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("expected a DNS label: lower-case letters, digits and '-', at most 63 characters")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENV.match(k):
                raise ValueError(f"expected environment variable names like FOO_BAR, not {k!r}")
        return v

    @model_validator(mode="after")
    def _matchers(self) -> Resource:
        if not (self.devices or self.pci or self.usb):
            raise ValueError("expected at least one matcher: devices (globs), pci or usb")
        return self

    @property
    def via_deviceplugin(self) -> bool:
        return self.offer != "dra"

    @property
    def via_dra(self) -> bool:
        return self.offer != "deviceplugin"

    @property
    def resource_name(self) -> str:
        return f"nodeplug.io/{self.name}"

    @property
    def socket_name(self) -> str:
        return f"nodeplug-{self.name}.sock"

    @property
    def env_name(self) -> str:
        return "NODEPLUG_" + re.sub(r"[^A-Z0-9]", "_", self.name.upper()) + "_DEVICES"


def _default_resources() -> list[Resource]:
    return [Resource(name="fuse", devices=["/dev/fuse"]), Resource(name="tun", devices=["/dev/net/tun"])]


class Config(Section):
    host_root: AbsPath = "/"
    rescan_seconds: float = Field(default=30.0, ge=1, le=3600)
    register_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    resources: list[Resource] = Field(default_factory=_default_resources)
    dra: DraConfig = Field(default_factory=DraConfig)

    @field_validator("resources")
    @classmethod
    def _unique(cls, v: list[Resource]) -> list[Resource]:
        seen: set[str] = set()
        for r in v:
            if r.name in seen:
                raise ValueError(f"expected unique resource names, {r.name!r} appears twice")
            seen.add(r.name)
        return v

    @model_validator(mode="after")
    def _dra_enabled(self) -> Config:
        wanting = [r.name for r in self.resources if r.via_dra]
        if wanting and self.dra.enabled is False:
            raise ValueError(
                f"resources {', '.join(wanting)} are offered through DRA (offer: dra or both): "
                "set dra.enabled: auto or true"
            )
        return self
