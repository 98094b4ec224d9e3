"""The plugins the agent can run: the one place the shell names them, in start order.

Each entry is the plugin package's :class:`~nodeplug.plugin.PluginSpec` (its ``spec`` module imports only its
config section, so loading this module loads no plugin's code). The agent config has one section per entry, under
the spec's name; the agent starts them in this order and stops them in reverse; ``nodeplug doctor`` runs their
checks in this order; their commands join ``nodeplug``'s.
"""

from __future__ import annotations

from cni.cluster.config import ClusterConfig as ClusterNetworkSection
from cni.cluster.spec import SPEC as CLUSTER_NETWORK
from cni.config import Config as CniSection
from cni.policy.config import PolicyConfig as NetworkPolicySection
from cni.policy.spec import SPEC as NETWORK_POLICY
from cni.spec import SPEC as CNI
from csi.config import Config as CsiSection
from csi.spec import SPEC as CSI
from deviceplugin.config import Config as DevicePluginSection
from deviceplugin.spec import SPEC as DEVICEPLUGIN
from nodeplug.plugin import Spec

PLUGINS: tuple[Spec, ...] = (DEVICEPLUGIN, CSI, CNI, CLUSTER_NETWORK, NETWORK_POLICY)

__all__ = [
    "PLUGINS",
    "ClusterNetworkSection",
    "CniSection",
    "CsiSection",
    "DevicePluginSection",
    "NetworkPolicySection",
]
