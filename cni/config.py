"""The ``cni`` section of the agent config: the thick-mode server in the agent.

The network itself (datapath, bridge, ranges, IPAM data directory, socket path the entry point uses) is described by
the CNI network config the runtime passes on every call, not here: the entry point and the agent must agree without
the agent config. This section says where the agent listens and how much work it takes on at once, and which
datapath the conflist ``nodeplug install-cni`` writes names (and the doctor's throw-away network uses). (How this
node joins the cluster pod network is the ``cluster_network`` section, :mod:`cni.cluster.config`.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from nodeplug.configbase import AbsPath, Section
from nodeplug.paths import CNI_SOCKET


class Config(Section):
    # How pods are attached, in the conflist install-cni writes: routed (a veth per pod with a host route, no bridge)
    # or bridge. Pods keep the datapath they were made with until they are recreated.
    datapath: Literal["routed", "bridge"] = "routed"
    # Where the agent serves thick mode (placed under the agent's --root); network configs name it in "socket".
    socket: AbsPath = CNI_SOCKET
    # CNI commands run at once (each in a worker thread); more requests queue. Same-container requests are serialised.
    workers: int = Field(default=8, ge=1, le=128)
    # Largest request (environment + network config with prevResult) accepted, in bytes.
    max_request_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    # Seconds the agent waits for the entry point's go-ahead after acknowledging a request before dropping it.
    handshake_timeout: float = Field(default=5.0, gt=0, le=60)
    # The doctor's end-to-end check: a throw-away network on this bridge and subnet (must not clash with real ones).
    doctor_bridge: str = Field(default="npdoctor0", min_length=1, max_length=15)
    doctor_subnet: str = "10.255.254.0/29"

    @field_validator("doctor_subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        import ipaddress

        try:
            net = ipaddress.ip_network(v)
        except ValueError:
            raise ValueError("expected an IPv4 network in CIDR notation like 10.255.254.0/29") from None
        if net.version != 4 or net.prefixlen > 30:
            raise ValueError("expected an IPv4 network of at least 4 addresses (/30 or larger)")
        return v
