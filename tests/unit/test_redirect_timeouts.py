"""The conntrack timeouts the redirect program refreshes entries with: in the units the kernel takes (milliseconds
for ``bpf_ct_change_timeout``, ticks for ``nf_conn.timeout``), within the 32-bit signed immediates of eBPF."""

from __future__ import annotations

from pathlib import Path

from cni.redirect.timeouts import Timeouts, kernel_hz

S32_MAX = (1 << 31) - 1


def test_the_kernels_defaults_in_its_units() -> None:
    t = Timeouts()  # established TCP 5 days, assured UDP 2 minutes
    assert t.ms(t.tcp_seconds) == 432_000_000
    assert t.ms(t.udp_seconds) == 120_000
    assert Timeouts(hz=250).half_ticks(120) == 15_000  # refreshed once less than a minute is left
    assert Timeouts(hz=1000).half_ticks(432_000) == 216_000_000


def test_values_past_a_signed_immediate_are_held_at_its_largest() -> None:
    t = Timeouts(tcp_seconds=10**7, hz=1000)
    assert t.ms(t.tcp_seconds) == S32_MAX
    assert t.half_ticks(t.tcp_seconds) == S32_MAX


def test_read_takes_this_netns_sysctls_and_the_kernels_tick_rate() -> None:
    t, default = Timeouts.read(), Timeouts()
    for key, got, otherwise in (("nf_conntrack_tcp_timeout_established", t.tcp_seconds, default.tcp_seconds),
                                ("nf_conntrack_udp_timeout_stream", t.udp_seconds, default.udp_seconds)):  # fmt: skip
        path = Path("/proc/sys/net/netfilter") / key  # absent until conntrack is loaded: the kernel's defaults
        assert got == (int(path.read_text()) if path.exists() else otherwise)
    assert t.hz == kernel_hz() in (100, 250, 300, 1000)
