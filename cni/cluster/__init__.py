"""The cluster pod network: this node's pod subnets and routes to every other node's, followed from Node objects.

Pure core:

- :mod:`cni.cluster.subnets`: the file the agent writes and the CNI entry point reads (this node's podCIDRs and the
  pod MTU); standard library only, it is on the entry point's start-up path;
- :mod:`cni.cluster.model`: Node objects (hostile input) parsed into :class:`~cni.cluster.model.NodeInfo`;
- :mod:`cni.cluster.plan`: the routes, FDB and neighbour entries this node should have, and the difference from
  what the kernel has.

Thin edges:

- :mod:`cni.cluster.kernel`: the VXLAN device and netlink reads and writes (through :mod:`cni.dataplane.rtnl`);
- :mod:`cni.cluster.masq`: masquerading to outside the cluster CIDRs (one nftables table of its own);
- :mod:`cni.cluster.network`: the agent's service tying them to a watch on Nodes (:mod:`nodeplug.kube`).

This package's ``__init__`` imports nothing: :mod:`cni.cluster.subnets` is imported on the entry point's start-up
path.
"""
