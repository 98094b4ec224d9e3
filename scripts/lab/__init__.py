"""Test benches the tests and the benchmarks share: what the plugins' callers and hosts are made of.

- :mod:`lab.clusterlab`: nodes as network namespaces (segments, a router) with an agent each, against
  :mod:`lab.controlplane` (a real etcd + kube-apiserver in a namespace of their own);
- :mod:`lab.dralab`: one namespace node with the DRA driver on, against that control plane;
- :mod:`lab.devicehost`: a fake host root (device nodes, a sysfs tree) for device discovery;
- :mod:`lab.kubelet`: a stand-in for kubelet's device manager (the Registration service, ListAndWatch streams);
- :mod:`lab.netns`, :mod:`lab.cniexec`, :mod:`lab.host`, :mod:`lab.wait`, :mod:`lab.kubeassets`: the small helpers
  under them.

Not test modules and no pytest: ``scripts/bench-*`` put ``scripts/`` on ``sys.path`` and import ``lab``; the tests
have it on theirs through pytest's ``pythonpath`` (tests/support adds the fixtures and skips).
"""
