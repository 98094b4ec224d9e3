"""The cluster pod network, a plugin of the agent: this node's pod subnets and routes to every other node's,
followed from Node objects. It runs only when the agent follows a Kubernetes API, beside the CNI server, and hands
the CNI side one file, this node's pod subnets (:mod:`cni.nodesubnets`).

Pure core:

- :mod:`cni.cluster.config`: the ``cluster_network`` section of the agent config;
- :mod:`cni.cluster.model`: Node objects (hostile input) parsed into :class:`~cni.cluster.model.NodeInfo`;
- :mod:`cni.cluster.plan`: the routes, FDB and neighbour entries this node should have, and the difference from
  what the kernel has.

Thin edges:

- :mod:`cni.cluster.kernel`: the VXLAN device and netlink reads and writes (through :mod:`cni.dataplane.rtnl`);
- :mod:`cni.cluster.masq`: masquerading to outside the cluster CIDRs (one nftables table of its own);
- :mod:`cni.cluster.network`: the service tying them to a watch on Nodes (:mod:`nodeplug.kube`);
- :mod:`cni.cluster.uninstall`, :mod:`cni.cluster.teardown`: standing down and removing everything it made when
  ``nodeplug install-cni --uninstall`` asks;
- :mod:`cni.cluster.plugin` (the agent's view: lifecycle, readiness, metrics), :mod:`cni.cluster.doctor` (is every
  peer routed as the mode says) and :mod:`cni.cluster.spec` (what the shell knows of it).
"""
