"""The CNI dataplane: bridge or routed veth pair, addresses, routes and masquerading through netlink and nftables.

The functions of the contract in :mod:`cni.commands` (called by the orchestration from worker threads; the host
side is the calling thread's network namespace):

- :func:`check_netns` — :mod:`cni.dataplane.netns` (before anything is leased);
- :func:`add` / :func:`delete` — :mod:`cni.dataplane.attach` (over :mod:`bridge`, :mod:`veth`, :mod:`addrs`,
  :mod:`masq`, :mod:`sysctl`; the routed datapath's own steps in :mod:`routed`; DEL's early answer in :mod:`unlink`);
- :func:`check` — :mod:`cni.dataplane.check`;
- :func:`gc` — :mod:`cni.dataplane.gc`;
- :func:`status` — :mod:`cni.dataplane.status`.

Every failure is a :class:`cni.errors.CniError` (code 101 for kernel or nft failures, 11 when the kernel or nft did not
answer in time, 4 for a bad netns, 3 from CHECK for an attachment that is not there, 50 from STATUS) whose details name
the object and the step. Every step has a deadline (netlink requests, external commands). How the pod netns is entered
without a helper process: :mod:`cni.dataplane.netns`. How DEL and GC find what ADD made: :mod:`cni.dataplane.names`.
"""

from __future__ import annotations

from cni.dataplane.attach import add, delete
from cni.dataplane.check import check
from cni.dataplane.gc import gc
from cni.dataplane.netns import check_netns
from cni.dataplane.status import status

__all__ = ["add", "check", "check_netns", "delete", "gc", "status"]
