"""IP address management: the built-in allocator over a lease store, and delegation to other IPAM plugins.

- :mod:`cni.ipam.store`: the store protocol (a transaction with a handful of methods) and an in-memory store;
- :mod:`cni.ipam.sqlite`: the SQLite store shared by the agent and every entry-point process;
- :mod:`cni.ipam.allocator`: pure allocation/release/GC logic over a store transaction;
- :mod:`cni.ipam.delegate`: exec'ing another IPAM plugin from ``CNI_PATH`` as the spec says;
- :mod:`cni.ipam.service`: IPAM operations as the orchestration and the IPAM-plugin mode use them.
"""
