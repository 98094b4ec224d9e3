"""NetworkPolicy (``networking.k8s.io/v1``) enforced in the kernel for the pod network: a plugin of the agent that
follows NetworkPolicies, Namespaces and Pods cluster-wide and keeps an nftables table of its own on this node.

Pure core:

- :mod:`cni.policy.selector`: label selectors;
- :mod:`cni.policy.model`: NetworkPolicies, Pods and Namespaces (hostile input) parsed into what enforcement needs;
- :mod:`cni.policy.compile`: the ruleset this node needs (the table's design is in its docstring), kept up to date
  event by event;
- :mod:`cni.policy.ruleset`: the ruleset as data, and the ``nft -f`` scripts that make it (whole, or the
  difference).
"""
