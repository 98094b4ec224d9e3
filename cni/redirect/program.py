"""The redirect program: established, untranslated pod flows skip the node's forwarding path.

Attached to the ingress (tcx) of every routed pod's host-side veth and of the devices traffic from other nodes comes
in by (the underlay, the VXLAN device), it looks at each IPv4 and IPv6 TCP or UDP packet and hands it straight to
the device it would be forwarded to when, and only when, all of these hold:

- the kernel's connection tracking has the flow, confirmed, seen both ways and assured (``bpf_skb_ct_lookup`` in the
  device's netns): whatever the node's filters (network policy, kube-proxy, the node's firewall) decide about a
  flow they decided on its first packets, which took the ordinary path;
- no address translation, sequence adjustment, helper or expectation is attached to it (a Service's DNAT, a hostPort,
  the masquerade to outside the cluster: the kernel must rewrite every packet of those);
- a TCP packet carries no SYN, FIN or RST: opening and closing take the ordinary path, so connection tracking sees
  every flow end and frees its entry when it should;
- the IPv4 header has no options and is not a fragment; the IPv6 header is followed directly by TCP or UDP; the TTL
  or hop limit is above 1; the destination is not link-local or multicast;
- the routing table (``bpf_fib_lookup``, which also checks the MTU and needs a resolved neighbour) forwards it, and
  the map of devices agrees: from a ready pod's veth or a way in (:data:`READY`, :data:`UPLINK`) either into a
  ready pod of this node (the packet goes into the pod's namespace at once, ``bpf_redirect_peer``) or, from a pod,
  out of a way in (``bpf_redirect`` to that device's transmit). A pod's veth marked :data:`HELD` (the quarantine,
  :mod:`cni.policy.quarantine`, holds its addresses: its drop rules on the forward hook must see every packet to and
  from them, since a conntrack entry of the address's previous pod may still be established) and any device not in
  the map (a pod's veth made since the map was last written) get nothing shortcut.

The packet is forwarded as the kernel would forward it: TTL or hop limit one less (the IPv4 header checksum updated),
source and destination MAC from the route's device and neighbour. Anything else returns ``TCX_NEXT``: the next
program, then the kernel's ordinary path, which is exactly what it was without the redirect.

Connection tracking no longer sees the redirected packets of a flow, so it no longer follows their TCP sequence
numbers: the agent sets ``nf_conntrack_tcp_be_liberal`` so that the flow's closing packets, which take the ordinary
path again, are not judged out of window (:mod:`cni.redirect.manager`). Nor do they give the flow's entry its time
again, as every packet on the ordinary path does: the program does (``bpf_ct_change_timeout``, at a packet that
takes the lookups, below), for an established TCP or assured UDP flow whose entry has less than half of its time
left (:mod:`cni.redirect.timeouts`), so an active flow's entry never expires under it (its next packet would start
a new entry, judged by the policies as a new connection, perhaps from the other end). An entry with a fixed
timeout is left alone, as the ordinary path leaves it; one with its own timeouts (a ``ct timeout`` policy) is given
the netns's established or stream timeout instead.

The headers are read and rewritten in place (the verifier makes a cloned packet's head the program's own first). The
IPv4 TTL and header checksum change together, leaving the header's sum as it was; the IPv6 hop limit goes through
``bpf_skb_store_bytes``, which also mends a checksum the receiving device gave for the whole packet.

The lookups (the route with its neighbour, two devices, conntrack's entry taken and let go) are most of the
program's cost (700-800 ns a run during a pod's TCP stream, measured with ``kernel.bpf_stats_enabled``; 240-260 ns
without them), so a flow's decision is kept: in this CPU's slot for the flow (the per-CPU map of flows,
:data:`SLOTS` slots indexed by a hash of the flow's key) the program writes the flow's whole key (the device it came
in by, protocol and family, addresses and ports), where it sent it (device, way, MACs), when, and the generation of
the map of devices it read (:class:`Maps`). A packet whose slot holds its own key, the current generation and a
decision less than :data:`FRESH_NS` old goes where that one went with none of the lookups but the device's MTU (the
packet may be longer than the one the route was looked up for); any other packet takes them all, and its decision
(only a redirect's) replaces the slot's. So a flow is looked at again at least every 50 ms while it runs: its
conntrack entry gone or no longer established both ways, its route or neighbour changed, and its packets are back on
the ordinary path within that time; a change to the map of devices (a pod held, gone or come) moves the generation
on, and takes effect at the next packet. The checks on the packet itself (its header, TCP flags, TTL) are made on
every packet. A slot is only ever read and written on its own CPU, in the receive path, whose bottom halves are off:
no other program run can write it halfway through a read.

A per-CPU counter map counts the packets handed over each way (:data:`PEER`, :data:`OUT`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cni.redirect import btf
from cni.redirect.asm import R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10, Asm
from cni.redirect.timeouts import Timeouts

NAME = "nodeplug_redir"
PEER, OUT = 0, 1  # the counters: into a pod of this node, out of another device
# the map of devices: a pod's veth, one whose addresses the quarantine holds, a way in from other nodes
READY, HELD, UPLINK = 1, 2, 3

# helpers by number (include/uapi/linux/bpf.h)
MAP_LOOKUP_ELEM, SKB_STORE_BYTES, REDIRECT, SKB_PULL_DATA, FIB_LOOKUP, JIFFIES64, REDIRECT_PEER = (
    1, 9, 23, 39, 69, 118, 155,
)  # fmt: skip
COARSE_NS, CHECK_MTU = 160, 163
MTU_CHK_SEGS = 1  # BPF_MTU_CHK_SEGS: a segmented packet's segments each against the MTU
RECOMPUTE_CSUM = 1  # BPF_F_RECOMPUTE_CSUM
TCX_NEXT, TC_ACT_SHOT = -1, 2
ETH_HLEN = 14
SKB_PKT_TYPE, SKB_PROTOCOL, SKB_INGRESS_IFINDEX, SKB_DATA, SKB_DATA_END = 4, 16, 36, 76, 80  # struct __sk_buff
V4_CHECK = 10  # the IPv4 header checksum's offset
CURRENT_NETNS = -1  # BPF_F_CURRENT_NETNS
CT_OPTS_SIZE = 12  # NF_BPF_CT_OPTS_SZ
TCP_CONNTRACK_ESTABLISHED = 3

# enum ip_conntrack_status
IPS_EXPECTED, IPS_SEEN_REPLY, IPS_ASSURED, IPS_CONFIRMED = 1 << 0, 1 << 1, 1 << 2, 1 << 3
IPS_SRC_NAT, IPS_DST_NAT, IPS_SEQ_ADJUST, IPS_DYING, IPS_FIXED_TIMEOUT = 1 << 4, 1 << 5, 1 << 6, 1 << 9, 1 << 10
IPS_UNTRACKED, IPS_HELPER, IPS_OFFLOAD = 1 << 12, 1 << 13, 1 << 14
NEED = IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED
FORBID = IPS_EXPECTED | IPS_SRC_NAT | IPS_DST_NAT | IPS_SEQ_ADJUST | IPS_DYING | IPS_UNTRACKED
FORBID |= IPS_HELPER | IPS_OFFLOAD

# the stack (offsets from r10)
FIB, FIB_SIZE = -64, 64  # struct bpf_fib_lookup
FIB_IFINDEX, FIB_TOS, FIB_SRC, FIB_DST, FIB_SMAC, FIB_DMAC = 8, 12, 16, 32, 52, 58
TUPLE = -104  # struct bpf_sock_tuple (36 bytes for IPv6)
OPTS = -120  # struct bpf_ct_opts (16 bytes kept zero beyond the 12 passed)
HDR = -184  # the IP header and the first 14 bytes after it
KEY = -192  # a map key or a byte or two to store
OUTIF = -200  # the device the route leaves by
FLOW = -248  # the flow's key (44 bytes, 8-aligned: :func:`_klen`)
GEN = -256  # the generation read at the start
SLOT = -264  # the flow's slot (a pointer into the per-CPU map of flows)

# the per-CPU map of flows: a slot per hash of a flow's key, holding the key and what was decided for it
SLOTS = 1024  # per CPU; a power of two
SLOT_BITS = SLOTS.bit_length() - 1
S_OUTIF, S_WAY, S_MACS, S_CHECKED, S_GEN, SLOT_SIZE = 44, 48, 52, 64, 72, 80  # S_MACS: FIB's order, smac then dmac
FRESH_NS = 50_000_000  # a decision is taken again from the kernel's tables after this long
GOLDEN = 0x9E3779B1

KFUNCS = ("bpf_skb_ct_lookup", "bpf_ct_release", "bpf_ct_change_timeout")


@dataclass(frozen=True)
class Maps:
    """The descriptors of the program's maps: the devices (u32 ifindex -> :data:`READY`, :data:`HELD` or
    :data:`UPLINK`), the per-CPU counters (u32 index -> u64), the per-CPU flows (u32 slot -> :data:`SLOT_SIZE`
    bytes) and the generation (one u64, which the agent moves on whenever the map of devices may have changed)."""

    pods: int
    stats: int
    flows: int
    gen: int


@dataclass(frozen=True)
class Kernel:
    """What the program needs from this kernel's BTF."""

    ct_lookup: int
    ct_release: int
    ct_change_timeout: int
    ct_status: int  # byte offsets in struct nf_conn: status, timeout (jiffies), the TCP tracker's state
    ct_timeout: int
    ct_tcp_state: int

    @classmethod
    def read(cls) -> Kernel:
        info = btf.vmlinux(set(KFUNCS), {"nf_conn", "ip_ct_tcp"})
        lookup, release, change = (info.func(name) for name in KFUNCS)
        tcp_state = info.offset("nf_conn", "proto") + info.offset("ip_ct_tcp", "state")  # proto: a union
        return cls(lookup, release, change, info.offset("nf_conn", "status"), info.offset("nf_conn", "timeout"),
                   tcp_state)  # fmt: skip


@dataclass(frozen=True)
class _Family:
    v: int
    af: int
    hdr_len: int
    tuple_size: int
    l4: int  # offset of the L4 protocol byte in the header
    ttl: int  # offset of the TTL / hop limit
    src: int
    addr_len: int


_V4 = _Family(4, 2, 20, 12, 9, 8, 12, 4)
_V6 = _Family(6, 10, 40, 36, 6, 7, 8, 16)


def _pass(a: Asm) -> None:
    a.mov(R0, imm=TCX_NEXT)
    a.exit()


def _chunks(x_off: int, y_off: int, size: int) -> Iterator[tuple[int, int]]:
    """``(offset, width)`` of the loads that cover ``size`` bytes (even) at ``x_off`` and at ``y_off``: 8 bytes at a
    time where both are 8-aligned, else 4, the last 2 alone."""
    wide = x_off % 8 == 0 and y_off % 8 == 0
    i = 0
    while i < size:
        n = 8 if wide and size - i >= 8 else 4 if size - i >= 4 else 2
        yield i, n
        i += n


def _move(a: Asm, dst: int, dst_off: int, src: int, src_off: int, size: int) -> None:
    """Copy ``size`` bytes (even) from ``src + src_off`` (the stack, the packet, a map value) to ``dst + dst_off``."""
    for i, n in _chunks(dst_off, src_off, size):
        a.ldx(n, R4, src, src_off + i)
        a.stx(n, dst, dst_off + i, R4)


def _same(a: Asm, x: int, x_off: int, y: int, y_off: int, size: int, differ: str) -> None:
    """To ``differ`` unless the ``size`` bytes (even) at ``x + x_off`` and ``y + y_off`` are equal."""
    for i, n in _chunks(x_off, y_off, size):
        a.ldx(n, R2, x, x_off + i)
        a.ldx(n, R3, y, y_off + i)
        a.jmp("jne", differ, R2, src=R3)


def _packet(a: Asm, size: int, fail: str = "pass") -> None:
    """``r2`` = the packet's first byte, its first ``size`` bytes readable and writable in place (the verifier
    makes a cloned packet's head the program's own before the program runs); else to ``fail``."""
    a.ldx(4, R2, R6, SKB_DATA)
    a.ldx(4, R3, R6, SKB_DATA_END)
    a.mov(R4, R2)
    a.alu("add", R4, imm=size)
    a.jmp("jgt", fail, R4, src=R3)


def _lookup(a: Asm, map_fd: int, base: int, off: int) -> None:
    """``r0 = map[*(u32 *)(base + off)]`` (NULL when absent)."""
    a.ldx(4, R2, base, off)
    a.stx(4, R10, KEY, R2)
    a.load_map(R1, map_fd)
    a.mov(R2, R10)
    a.alu("add", R2, imm=KEY)
    a.call(MAP_LOOKUP_ELEM)


def _cached(a: Asm, f: _Family, p: str, maps: Maps) -> None:
    """The flow's slot in this CPU's map of flows (kept at :data:`SLOT`, the flow's key at :data:`FLOW`, the
    generation at :data:`GEN`, for the decision to be written there); where the slot holds this flow's key and a
    decision of this generation taken less than :data:`FRESH_NS` ago, and the packet fits the device's MTU, on to
    ``{p}rewrite`` with that decision (:data:`OUTIF`, the MACs, the way in ``r8``); else on to ``{p}fib``."""
    klen = _klen(f)
    a.st(4, R10, KEY, 0)
    _lookup(a, maps.gen, R10, KEY)
    a.jmp("jeq", "pass", R0, imm=0)
    a.ldx(8, R2, R0, 0)
    a.stx(8, R10, GEN, R2)
    a.ldx(4, R2, R6, SKB_INGRESS_IFINDEX)
    a.stx(4, R10, FLOW, R2)
    a.mov(R2, R7)
    a.alu("or", R2, imm=f.af << 8)
    a.stx(4, R10, FLOW + 4, R2)
    _move(a, R10, FLOW + 8, R10, HDR + f.src, klen - 8)
    a.ldx(4, R1, R10, FLOW)
    for off in range(8, klen, 4):
        a.ldx(4, R2, R10, FLOW + off)
        a.alu("xor", R1, src=R2)
    a.alu("mul", R1, imm=GOLDEN)
    a.alu("lsh", R1, imm=32)
    a.alu("rsh", R1, imm=64 - SLOT_BITS)  # the top bits of the product's low 32
    a.stx(4, R10, KEY, R1)
    _lookup(a, maps.flows, R10, KEY)
    a.jmp("jeq", "pass", R0, imm=0)  # not for an index below SLOTS
    a.stx(8, R10, SLOT, R0)
    _same(a, R0, 0, R10, FLOW, klen, f"{p}fib")
    _same(a, R0, S_GEN, R10, GEN, 8, f"{p}fib")
    a.call(COARSE_NS)
    a.ldx(8, R1, R10, SLOT)
    a.ldx(8, R2, R1, S_CHECKED)
    a.alu("sub", R0, src=R2)
    a.jmp("jgt", f"{p}fib", R0, imm=FRESH_NS)
    a.ldx(4, R9, R1, S_OUTIF)
    a.stx(4, R10, OUTIF, R9)
    a.ldx(4, R8, R1, S_WAY)
    _move(a, R10, FIB + FIB_SMAC, R1, S_MACS, 12)
    # the device's MTU, as the route's lookup checks it (this packet may be longer than the one that took it)
    a.st(4, R10, KEY, 0)
    a.mov(R1, R6)
    a.mov(R2, R9)
    a.mov(R3, R10)
    a.alu("add", R3, imm=KEY)
    a.mov(R4, imm=0)
    a.mov(R5, imm=MTU_CHK_SEGS)
    a.call(CHECK_MTU)
    a.jmp("jeq", f"{p}rewrite", R0, imm=0)


def _remember(a: Asm, f: _Family) -> None:
    """The decision (:data:`OUTIF`, the way in ``r8``, the route's MACs) into the flow's slot, with the key, the
    generation and the time."""
    a.call(COARSE_NS)
    a.ldx(8, R1, R10, SLOT)
    a.stx(8, R1, S_CHECKED, R0)
    _move(a, R1, 0, R10, FLOW, _klen(f))
    _move(a, R1, S_GEN, R10, GEN, 8)
    a.ldx(4, R2, R10, OUTIF)
    a.stx(4, R1, S_OUTIF, R2)
    a.stx(4, R1, S_WAY, R8)
    _move(a, R1, S_MACS, R10, FIB + FIB_SMAC, 12)


def _klen(f: _Family) -> int:
    """The length of a flow's key: ingress ifindex, L4 protocol | family << 8, saddr, daddr, sport, dport (20 bytes
    for IPv4, 44 for IPv6)."""
    return 8 + 2 * f.addr_len + 4


def _family(a: Asm, f: _Family, k: Kernel, t: Timeouts, maps: Maps) -> None:
    p = f"v{f.v}_"
    a.label(f"{p}start")
    # the IP header and the 14 bytes after it, read in place to the stack; where the packet's linear part does not
    # hold them all (a device that leaves headers in fragments), pulled into it first
    size = ETH_HLEN + f.hdr_len + 14
    _packet(a, size, fail=f"{p}pull")
    a.jmp("ja", f"{p}read")
    a.label(f"{p}pull")
    a.mov(R1, R6)
    a.mov(R2, imm=size)
    a.call(SKB_PULL_DATA)
    a.jmp("jne", "pass", R0, imm=0)  # shorter than that: not TCP or UDP with its header whole
    _packet(a, size)
    a.label(f"{p}read")
    _move(a, R10, HDR, R2, ETH_HLEN, f.hdr_len + 14)
    a.ldx(1, R2, R10, HDR)
    if f.v == 4:
        a.jmp("jne", "pass", R2, imm=0x45)  # version 4, no options
        a.ldx(2, R2, R10, HDR + 6)
        a.alu("and", R2, imm=0xFF3F)  # more-fragments and the fragment offset (network order, read little-endian)
        a.jmp("jne", "pass", R2, imm=0)
        a.ldx(2, R2, R10, HDR + f.src + 4)
        a.jmp("jeq", "pass", R2, imm=0xFEA9)  # 169.254.0.0/16
        a.ldx(1, R2, R10, HDR + f.src + 4)
        a.alu("and", R2, imm=0xF0)
        a.jmp("jeq", "pass", R2, imm=0xE0)  # multicast
    else:
        a.alu("and", R2, imm=0xF0)
        a.jmp("jne", "pass", R2, imm=0x60)
        a.ldx(1, R2, R10, HDR + f.src + 16)
        a.jmp("jeq", "pass", R2, imm=0xFF)  # multicast
        a.ldx(2, R2, R10, HDR + f.src + 16)
        a.alu("and", R2, imm=0xC0FF)
        a.jmp("jeq", "pass", R2, imm=0x80FE)  # fe80::/10
    a.ldx(1, R2, R10, HDR + f.ttl)
    a.jmp("jle", "pass", R2, imm=1)
    a.ldx(1, R7, R10, HDR + f.l4)
    a.jmp("jeq", f"{p}route", R7, imm=17)
    a.jmp("jne", "pass", R7, imm=6)
    a.ldx(1, R2, R10, HDR + f.hdr_len + 13)  # TCP flags
    a.jmp("jset", "pass", R2, imm=0x07)  # FIN, SYN, RST
    a.label(f"{p}route")
    _cached(a, f, p, maps)
    a.label(f"{p}fib")
    # the route (also turns away, cheaply, the node's own traffic on a way in)
    for off in range(0, FIB_SIZE, 8):
        a.st(8, R10, FIB + off, 0)
    a.st(1, R10, FIB, f.af)
    a.stx(1, R10, FIB + 1, R7)
    a.ldx(4, R2, R6, SKB_INGRESS_IFINDEX)
    a.stx(4, R10, FIB + FIB_IFINDEX, R2)
    if f.v == 4:
        a.ldx(1, R2, R10, HDR + 1)
        a.stx(1, R10, FIB + FIB_TOS, R2)
    _move(a, R10, FIB + FIB_SRC, R10, HDR + f.src, f.addr_len)
    _move(a, R10, FIB + FIB_DST, R10, HDR + f.src + f.addr_len, f.addr_len)
    a.mov(R1, R6)
    a.mov(R2, R10)
    a.alu("add", R2, imm=FIB)
    a.mov(R3, imm=FIB_SIZE)
    a.mov(R4, imm=0)
    a.call(FIB_LOOKUP)
    a.jmp("jne", "pass", R0, imm=0)  # BPF_FIB_LKUP_RET_SUCCESS
    a.ldx(4, R9, R10, FIB + FIB_IFINDEX)
    a.stx(4, R10, OUTIF, R9)
    a.ldx(4, R2, R6, SKB_INGRESS_IFINDEX)
    a.jmp("jeq", "pass", R2, src=R9)  # back where it came from: not ours to shortcut
    # where it came from: a ready pod or a way in (the program is on nothing else; a held pod's packets are not ours)
    _lookup(a, maps.pods, R6, SKB_INGRESS_IFINDEX)
    a.jmp("jeq", "pass", R0, imm=0)
    a.ldx(4, R7, R0, 0)  # the way in's kind, kept across the next call
    a.jmp("jeq", f"{p}where", R7, imm=READY)
    a.jmp("jne", "pass", R7, imm=UPLINK)
    a.label(f"{p}where")
    # where it goes: into a ready pod of this node, or from a pod out of a way in
    _lookup(a, maps.pods, R10, OUTIF)
    a.jmp("jeq", "pass", R0, imm=0)
    a.ldx(4, R2, R0, 0)
    a.mov(R8, imm=PEER)
    a.jmp("jeq", f"{p}ct", R2, imm=READY)
    a.jmp("jne", "pass", R2, imm=UPLINK)
    a.jmp("jne", "pass", R7, imm=READY)
    a.mov(R8, imm=OUT)
    # the flow: established both ways, untranslated
    a.label(f"{p}ct")
    _move(a, R10, TUPLE, R10, HDR + f.src, 2 * f.addr_len + 4)  # saddr, daddr, sport, dport
    a.st(8, R10, OPTS, 0)
    a.st(8, R10, OPTS + 8, 0)
    a.st(4, R10, OPTS, CURRENT_NETNS)
    a.ldx(1, R2, R10, HDR + f.l4)
    a.stx(1, R10, OPTS + 8, R2)
    a.mov(R1, R6)
    a.mov(R2, R10)
    a.alu("add", R2, imm=TUPLE)
    a.mov(R3, imm=f.tuple_size)
    a.mov(R4, R10)
    a.alu("add", R4, imm=OPTS)
    a.mov(R5, imm=CT_OPTS_SIZE)
    a.kfunc(k.ct_lookup)
    a.jmp("jeq", "pass", R0, imm=0)
    a.mov(R7, R0)  # the entry, held until released below
    a.ldx(8, R9, R7, k.ct_status)
    a.mov(R2, R9)
    a.alu("and", R2, imm=NEED)
    a.jmp("jne", f"{p}refused", R2, imm=NEED)
    a.mov(R2, R9)
    a.alu("and", R2, imm=FORBID)
    a.jmp("jne", f"{p}refused", R2, imm=0)
    # the entry's time: its full time again once half has run out (an established TCP or assured UDP flow), unless
    # it has a fixed timeout, which the ordinary path leaves alone too
    a.jmp("jset", f"{p}taken", R9, imm=IPS_FIXED_TIMEOUT)
    a.call(JIFFIES64)
    a.ldx(4, R1, R7, k.ct_timeout)  # when it expires, in 32-bit ticks
    a.alu("sub", R1, src=R0)
    a.alu("lsh", R1, imm=32)
    a.alu("rsh", R1, imm=32)  # ticks left
    a.ldx(1, R2, R10, HDR + f.l4)
    a.jmp("jeq", f"{p}udp", R2, imm=17)
    a.ldx(1, R2, R7, k.ct_tcp_state)
    a.jmp("jne", f"{p}taken", R2, imm=TCP_CONNTRACK_ESTABLISHED)
    a.jmp("jge", f"{p}taken", R1, imm=t.half_ticks(t.tcp_seconds))
    a.mov(R2, imm=t.ms(t.tcp_seconds))
    a.jmp("ja", f"{p}refresh")
    a.label(f"{p}udp")
    a.jmp("jge", f"{p}taken", R1, imm=t.half_ticks(t.udp_seconds))
    a.mov(R2, imm=t.ms(t.udp_seconds))
    a.label(f"{p}refresh")
    a.mov(R1, R7)
    a.kfunc(k.ct_change_timeout)  # fails only for an entry already dying, which the next lookup will not find
    a.label(f"{p}taken")
    a.mov(R9, imm=0)
    a.jmp("ja", f"{p}release")
    a.label(f"{p}refused")
    a.mov(R9, imm=1)
    a.label(f"{p}release")
    a.mov(R1, R7)
    a.kfunc(k.ct_release)
    a.jmp("jne", "pass", R9, imm=0)
    _remember(a, f)
    a.label(f"{p}rewrite")
    # as the kernel forwards it: TTL or hop limit one less, the route's MACs
    if f.v == 4:  # the header checksum follows the TTL (ip_decrease_ttl), so the header's sum stays the same
        _packet(a, ETH_HLEN + f.hdr_len)
        a.ldx(1, R4, R2, ETH_HLEN + f.ttl)
        a.alu("sub", R4, imm=1)  # it is above 1
        a.stx(1, R2, ETH_HLEN + f.ttl, R4)
        a.ldx(2, R4, R2, ETH_HLEN + V4_CHECK)
        a.alu("add", R4, imm=1)  # htons(0x0100), as this little-endian machine reads it
        a.jmp("jlt", f"{p}carried", R4, imm=0xFFFF)
        a.alu("add", R4, imm=1)
        a.label(f"{p}carried")
        a.stx(2, R2, ETH_HLEN + V4_CHECK, R4)
    else:  # through the helper, which also mends a checksum the device gave for the whole packet (the hop limit
        # is under it; the MACs are not)
        a.ldx(1, R9, R10, HDR + f.ttl)
        a.alu("sub", R9, imm=1)
        a.stx(1, R10, KEY, R9)
        a.mov(R1, R6)
        a.mov(R2, imm=ETH_HLEN + f.ttl)
        a.mov(R3, R10)
        a.alu("add", R3, imm=KEY)
        a.mov(R4, imm=1)
        a.mov(R5, imm=RECOMPUTE_CSUM)
        a.call(SKB_STORE_BYTES)
        a.jmp("jne", "pass", R0, imm=0)  # nothing written
        _packet(a, ETH_HLEN + f.hdr_len, fail="drop")  # the helper may have moved the data
    for at, mac in ((0, FIB_DMAC), (6, FIB_SMAC)):
        for i in range(0, 6, 2):  # the stack's MACs are 2-aligned only
            a.ldx(2, R4, R10, FIB + mac + i)
            a.stx(2, R2, at + i, R4)
    a.jmp("ja", "count")


def build(k: Kernel, t: Timeouts, maps: Maps) -> bytes:
    """The program's instructions for this kernel and these conntrack timeouts, using ``maps``."""
    a = Asm()
    a.mov(R6, R1)
    a.ldx(4, R2, R6, SKB_PKT_TYPE)
    a.jmp("jne", "pass", R2, imm=0)  # PACKET_HOST: addressed to this host's MAC
    a.ldx(4, R2, R6, SKB_PROTOCOL)
    a.jmp("jeq", "v4_start", R2, imm=0x0008)  # ETH_P_IP, network order read little-endian
    a.jmp("jeq", "v6_start", R2, imm=0xDD86)  # ETH_P_IPV6
    a.label("pass")
    _pass(a)
    a.label("drop")  # a header half rewritten
    a.mov(R0, imm=TC_ACT_SHOT)
    a.exit()
    _family(a, _V4, k, t, maps)
    _family(a, _V6, k, t, maps)
    # R8: which way; the counter, then the hand-over
    a.label("count")
    a.stx(4, R10, KEY, R8)
    a.load_map(R1, maps.stats)
    a.mov(R2, R10)
    a.alu("add", R2, imm=KEY)
    a.call(MAP_LOOKUP_ELEM)
    a.jmp("jeq", "send", R0, imm=0)
    a.ldx(8, R1, R0, 0)
    a.alu("add", R1, imm=1)
    a.stx(8, R0, 0, R1)
    a.label("send")
    a.ldx(4, R1, R10, OUTIF)
    a.mov(R2, imm=0)
    a.jmp("jne", "out", R8, imm=PEER)
    a.call(REDIRECT_PEER)
    a.exit()
    a.label("out")
    a.call(REDIRECT)
    a.exit()
    return a.assemble()
