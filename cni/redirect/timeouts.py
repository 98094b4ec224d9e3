"""How long connection tracking keeps a flow, for the redirect program to keep an active flow's entry alive (its
packets no longer pass the ordinary path, which gives the entry its time again at every packet)."""

from __future__ import annotations

import functools
import gzip
import os
import re
from dataclasses import dataclass

from cni.dataplane import sysctl

_S32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Timeouts:
    """How long connection tracking keeps an established TCP and an assured UDP flow (this netns's
    ``nf_conntrack_tcp_timeout_established`` and ``nf_conntrack_udp_timeout_stream``, read at every sync of the
    redirect: the program is loaded again when they change), and this kernel's tick rate: the program gives a
    flow's entry its full time again once half of it has run out, as the ordinary path does at every packet (its
    packets no longer go there)."""

    tcp_seconds: int = 432000
    udp_seconds: int = 120
    hz: int = 1000

    def ms(self, seconds: int) -> int:
        return min(seconds * 1000, _S32_MAX)

    def half_ticks(self, seconds: int) -> int:
        return min(seconds * self.hz // 2, _S32_MAX)

    @classmethod
    def read(cls) -> Timeouts:
        def seconds(key: str, default: int) -> int:
            value = sysctl.read(key)  # absent until conntrack is loaded: its defaults
            return int(value) if value and value.isdigit() else default

        return cls(seconds("net.netfilter.nf_conntrack_tcp_timeout_established", cls.tcp_seconds),
                   seconds("net.netfilter.nf_conntrack_udp_timeout_stream", cls.udp_seconds), kernel_hz())  # fmt: skip


@functools.cache  # the running kernel's: read once
def kernel_hz() -> int:
    """The kernel's tick rate (CONFIG_HZ) from its config (``/proc/config.gz`` or ``/boot/config-<release>``);
    1000, the highest, when neither says: a rate guessed too high refreshes entries early, never late."""
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{os.uname().release}", open)):
        try:
            with opener(path, "rt") as f:
                m = re.search(r"^CONFIG_HZ=(\d+)$", f.read(), re.M)
        except (OSError, EOFError):
            continue
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return 1000
