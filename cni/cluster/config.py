"""The ``cluster_network`` section: how this node joins the cluster pod network.

::

    cluster_network:
      enabled: true            # active when the agent follows a Kubernetes API (--kubeconfig or in-cluster)
      mode: auto               # direct | vxlan | auto: direct to peers on a connected subnet, VXLAN to the rest
      vxlan:
        vni: 4096
        port: 4789
        underlay: ""           # interface of the node's InternalIP when empty
        tx_checksum_offload: auto    # auto (off on kernels before 5.7) | true | false (cni.cluster.offload)
      cluster_cidrs: []        # traffic to these keeps its source, and only podCIDRs inside them are used;
                               # empty: every Node's podCIDRs no broader than broadest_pod_cidr
      broadest_pod_cidr: {ipv4: 16, ipv6: 48}   # without cluster_cidrs: the shortest podCIDR prefix accepted
      masquerade: true         # masquerade pod traffic leaving the cluster CIDRs
      redirect: false          # established, untranslated pod flows skip the node's forwarding path (eBPF, Linux
                               # 6.6+ with BTF; sets nf_conntrack_tcp_be_liberal: cni.redirect.program)
      route_protocol: 110      # routes the agent owns carry this protocol number (never one the kernel or a
                               # routing daemon uses: cni.cluster.uninstall.RESERVED_PROTOCOLS)
      resync_seconds: 60       # full comparison with the kernel (repairs changes made by others)
      subnets_file: /var/lib/nodeplug/cluster/subnets.json   # where the CNI entry point reads this node's podCIDRs

Without a Kubernetes API the section is ignored and the agent runs single-node as before.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cni.cluster import uninstall
from cni.nodesubnets import DEFAULT_PATH
from nodeplug.configbase import AbsPath, Section


class VxlanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    vni: int = Field(default=4096, ge=1, le=16777215)
    port: int = Field(default=4789, ge=1, le=65535)
    underlay: str = Field(default="", max_length=15)
    # Transmit checksum offload on the VXLAN device: auto (off on kernels before 5.7, whose offloaded VXLAN checksums
    # go wrong behind NAT), true, or false (off everywhere; cni.cluster.offload says why and what it costs)
    tx_checksum_offload: Literal["auto"] | bool = "auto"


def route_protocol(v: int) -> int:
    """A route protocol number nodeplug may own (the check the config and the uninstall share)."""
    if not uninstall.ours(v):
        name = uninstall.RESERVED_PROTOCOLS.get(v)
        raise ValueError(
            "expected a route protocol from 1 to 254 that the kernel and routing daemons do not use"
            + (f" ({v} is {name!r})" if name else "")
        )
    return v


class BroadestPodCidr(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ipv4: int = Field(default=16, ge=1, le=30)
    ipv6: int = Field(default=48, ge=1, le=126)


class ClusterConfig(Section):
    mode: Literal["direct", "vxlan", "auto"] = "auto"
    vxlan: VxlanConfig = Field(default_factory=VxlanConfig)
    cluster_cidrs: tuple[str, ...] = ()
    broadest_pod_cidr: BroadestPodCidr = Field(default_factory=BroadestPodCidr)
    masquerade: bool = True
    redirect: bool = False
    route_protocol: int = 110
    resync_seconds: float = Field(default=60.0, ge=1, le=3600)
    subnets_file: AbsPath = DEFAULT_PATH

    @field_validator("route_protocol")
    @classmethod
    def _protocol(cls, v: int) -> int:
        return route_protocol(v)

    @field_validator("cluster_cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for text in v:
            try:
                out.append(str(ipaddress.ip_network(text, strict=True)))
            except ValueError:
                raise ValueError(f"expected networks like 10.244.0.0/16 or fd44::/48, got {text!r}") from None
        return tuple(out)
