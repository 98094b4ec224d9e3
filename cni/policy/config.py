"""The ``network_policy`` section: NetworkPolicy enforced on this node.

::

    network_policy:
      enabled: true            # active when the agent follows a Kubernetes API (--kubeconfig or in-cluster)
      bridge_netfilter: true   # set net.bridge.bridge-nf-call-iptables/ip6tables=1 (bridged pod traffic filtered)
      resync_seconds: 300      # the whole table made anew from the agent's view (repairs changes made by others)
      attach_timeout_seconds: 5   # how long a CNI ADD or DEL waits for the pod's rules; then its addresses are
                                  # quarantined (no traffic) until they are in place
      log_drops: false         # log dropped packets to the kernel log (prefix "nodeplug-policy"), rate-limited
      log_rate: 5              # at most this many log lines per second and namespace (burst 10)

Without a Kubernetes API, or with the agent's CNI off (``cni.enabled: false``), the section is ignored.
"""

from __future__ import annotations

from pydantic import Field

from nodeplug.configbase import Section


class PolicyConfig(Section):
    bridge_netfilter: bool = True
    resync_seconds: float = Field(default=300.0, ge=5, le=86400)
    attach_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    log_drops: bool = False
    log_rate: int = Field(default=5, ge=1, le=10000)
