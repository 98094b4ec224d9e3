"""The redirect (``cluster_network.redirect: true``) on namespace nodes with real agents: established pod flows
across nodes (direct and VXLAN, both families) and between pods of one node go past the forwarding path and arrive
intact; their closing still reaches connection tracking; translated flows, bridged pods and new connections keep
the ordinary path; the program follows pods, agent restarts (kill -9) and the config.

Judged as users see it: bytes through sockets in the pods, the agent's ``/metrics``, the kernel's connection
tracking table (``conntrack``) and the programs the kernel has on each device.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cni.redirect import bpf, program

from lab.clusterlab import OUTSIDE, Lab, Netns, Node, Pod, missing_assets, wait_for
from support.serving import Serving, echo_datagrams

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok"),
    pytest.mark.skipif(not shutil.which("conntrack"), reason="conntrack (Debian package conntrack) not installed"),
]

HANG = 60
SIZE = 16 << 20
REDIRECT = "  redirect: true\n"


class Sink:
    """A TCP server in a netns that reads each connection to its end and answers the SHA-256 of what came."""

    def __init__(self, ns: Netns, family: int, port: int) -> None:
        self.serving = Serving()
        self.serving.connections(ns.call(self._listen, family, port), self._hash)

    @staticmethod
    def _listen(family: int, port: int) -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        s.listen(8)
        return s

    @staticmethod
    def _hash(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # closed here: the client reads the answer to its end
            h = hashlib.sha256()
            while chunk := conn.recv(1 << 16):
                h.update(chunk)
            conn.sendall(h.hexdigest().encode())

    def close(self) -> None:
        self.serving.close()


class Capture:
    """What reaches a pod's eth0 of the TCP segments carrying data to ``port``: each one's TTL (hop limit) and, for
    IPv4, whether its header checksum holds (a raw packet socket sees them before the pod's IP stack does)."""

    def __init__(self, ns: Netns, family: int, port: int) -> None:
        self.family, self.port = family, port
        self.ttls: set[int] = set()
        self.bad_checksums = 0
        self.sock: socket.socket = ns.call(self._open, family)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    @staticmethod
    def _open(family: int) -> socket.socket:
        proto = 0x0800 if family == 4 else 0x86DD
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(proto))
        s.bind(("eth0", proto))
        s.settimeout(0.2)
        return s

    def _read(self) -> None:
        while not self.stopped.is_set():  # a packet socket's shutdown does not wake its reader; the timeout does
            try:
                frame = self.sock.recv(256)
            except TimeoutError:
                continue
            except OSError:
                return
            ip = frame[14:]
            if self.family == 4:
                hlen, ttl, proto, length = (ip[0] & 0xF) * 4, ip[8], ip[9], int.from_bytes(ip[2:4], "big")
            else:
                hlen, ttl, proto, length = 40, ip[7], ip[6], 40 + int.from_bytes(ip[4:6], "big")
            tcp = ip[hlen:]
            if proto != 6 or len(tcp) < 20 or int.from_bytes(tcp[2:4], "big") != self.port:
                continue
            if length - hlen - (tcp[12] >> 4) * 4 <= 0:
                continue  # no data
            self.ttls.add(ttl)
            if self.family == 4:
                total = sum(int.from_bytes(ip[i : i + 2], "big") for i in range(0, hlen, 2))
                self.bad_checksums += (total & 0xFFFF) + (total >> 16) != 0xFFFF

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=HANG)
        self.sock.close()


def send(src: Netns, dst: str, port: int, size: int = SIZE) -> tuple[str, str, int]:
    """Send ``size`` random bytes from ``src``: (their SHA-256, the one the sink answers, the client's port)."""
    data = os.urandom(size)

    def go() -> tuple[str, str, int]:
        with socket.create_connection((dst, port), timeout=HANG) as c:
            sport = c.getsockname()[1]
            c.sendall(data)
            c.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := c.recv(100):
                got += chunk
        return hashlib.sha256(data).hexdigest(), got.decode(), sport

    result: tuple[str, str, int] = src.call(go)
    return result


def redirected(node: Node) -> dict[str, int]:
    _, body = node.http("/metrics")
    found = re.findall(r'nodeplug_cluster_redirected_packets_total\{way="(\w+)"\} (\S+)', body)
    return {way: int(float(n)) for way, n in found}


def ours_on(node: Node) -> dict[str, list[int]]:
    """Each device of the node with the nodeplug redirect programs the kernel has on its ingress (their ids)."""

    def look() -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for index, name in socket.if_nameindex():  # the thread's netns (sysfs would show the mount's)
            for pid in bpf.attached(index):
                with bpf.prog_by_id(pid) as p:
                    if bpf.prog_info(p).name == program.NAME:
                        out.setdefault(name, []).append(pid)
        return out

    found: dict[str, list[int]] = node.ns.call(look)
    return found


# TCP states conntrack reaches once it has seen both FINs ("": the entry already gone). The last ACK after them
# carries no flag the program leaves to the ordinary path, so LAST_ACK is where a redirected flow's entry ends.
CLOSED = ("LAST_ACK", "TIME_WAIT", "CLOSE", "")


def tracked(node: Node, port: int, sport: int) -> str:
    """The connection tracking state of the TCP connection from ``sport`` to ``port`` on ``node``, or ""."""
    out = node.ns.exec("conntrack", "-L", "-p", "tcp", "--sport", str(sport), "--dport", str(port), check=False)
    m = re.search(r"tcp\s+\d+\s+\d+\s+(\w+)", out)
    return m.group(1) if m else ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = Path(tmp_path_factory.mktemp("redirect"))
    with Lab(work, l2_nodes=2, routed=True) as lab:
        for node in lab.nodes:
            lab.register(node)
            node.write_config(extra=REDIRECT)
            node.start()
        for node in lab.nodes:
            node.wait_ready()
        for node in lab.nodes:
            lab.add_pod(node, "routed")
        lab.add_pod(lab.nodes[0], "routed")  # a second pod on node-1
        lab.add_pod(lab.nodes[0], "bridge")
        try:
            yield lab
        finally:
            for node in lab.nodes:
                print(f"----- {node.name} agent log (tail)\n{node.log_tail(3000)}")


GONE: set[str] = set()  # pods deleted by a test (they stay in lab.pods: the lab names new pods by their count)


def routed(lab: Lab) -> list[Pod]:
    return [p for p in lab.pods if p.datapath == "routed" and p.cid not in GONE]


def delete(pod: Pod) -> None:
    code, out = pod.node.cni("DEL", pod.ns.name, pod.cid, datapath=pod.datapath)
    assert code == 0, out
    GONE.add(pod.cid)


def attached_everywhere(lab: Lab) -> bool:
    """Every node has the program on each of its routed pods' veths, its underlay and (auto mode) its VXLAN
    device, and on nothing else."""
    for node in lab.nodes:
        veths = {p.host_veth for p in routed(lab) if p.node is node}
        if set(ours_on(node)) != veths | {"eth0", "nodeplug.vx"}:
            return False
    return True


@pytest.mark.parametrize("way", ["direct", "vxlan", "same node"])
@pytest.mark.parametrize("family", [4, 6])
def test_established_pod_flows_go_past_the_forwarding_path_and_arrive_intact(lab: Lab, way: str, family: int) -> None:
    n1, n2, n3 = lab.nodes
    a, a2 = [p for p in routed(lab) if p.node is n1]
    b = {"direct": next(p for p in routed(lab) if p.node is n2), "vxlan": next(p for p in routed(lab) if p.node is n3),
         "same node": a2}[way]  # fmt: skip
    wait_for("the program on every routed veth and way in", lambda: attached_everywhere(lab), timeout=HANG)
    port = 7100 + family
    sink = Sink(b.ns, socket.AF_INET if family == 4 else socket.AF_INET6, port)
    dst = b.ip4 if family == 4 else b.ip6
    before = {n.name: redirected(n) for n in (n1, b.node)}
    capture = Capture(b.ns, family, port)
    try:
        sent, got, sport = send(a.ns, dst, port)
    finally:
        sink.close()
        capture.close()
    assert got == sent
    # forwarded as the kernel forwards: one less per node on the way (64 where the pod sent it), a sound header
    assert capture.ttls == {63 if way == "same node" else 62}
    assert capture.bad_checksums == 0
    after = {n.name: redirected(n) for n in (n1, b.node)}
    if way == "same node":  # the data and the acknowledgements each go straight into the other pod
        assert after[n1.name]["peer"] - before[n1.name]["peer"] > 100
    else:  # the data leaves node-1 from the pod straight out, and enters the other node straight into the pod
        assert after[n1.name]["out"] - before[n1.name]["out"] > 100
        assert after[b.node.name]["peer"] - before[b.node.name]["peer"] > 100
        assert after[n1.name]["peer"] - before[n1.name]["peer"] > 10  # the acknowledgements, back into the pod
    # the closing took the ordinary path: connection tracking saw both FINs (not left ESTABLISHED for five days)
    for node in {n1, b.node}:
        wait_for(f"{node.name} tracks the closed connection as closed",
                 lambda node=node: tracked(node, port, sport) in CLOSED, timeout=HANG)  # fmt: skip


def test_translated_flows_and_bridged_pods_keep_the_ordinary_path(lab: Lab) -> None:
    n1 = lab.nodes[0]
    a = next(p for p in routed(lab) if p.node is n1)
    bridged = next(p for p in lab.pods if p.datapath == "bridge")
    out_ns = next(n for n in lab.netns if n.name.endswith("-out"))
    sink = Sink(out_ns, socket.AF_INET, 7200)
    try:
        before = redirected(n1)
        sent, got, _ = send(a.ns, OUTSIDE, 7200)  # masqueraded: the kernel rewrites every packet
        assert got == sent
        assert redirected(n1) == before
        b = next(p for p in routed(lab) if p.node is lab.nodes[1])
        sink_b = Sink(b.ns, socket.AF_INET, 7201)
        try:
            before_b = redirected(lab.nodes[1])
            sent, got, _ = send(bridged.ns, b.ip4, 7201)  # from a bridged pod: node-1 forwards as ever
            assert got == sent
            assert redirected(n1)["out"] == before["out"]
            assert redirected(lab.nodes[1])["peer"] > before_b["peer"]  # the routed pod's node still shortcuts it
        finally:
            sink_b.close()
    finally:
        sink.close()


def test_a_pod_that_comes_and_goes_gets_the_program_and_leaves_nothing(lab: Lab) -> None:
    n2 = lab.nodes[1]
    pod = lab.add_pod(n2, "routed")
    try:
        wait_for("the new pod's veth has the program", lambda: pod.host_veth in ours_on(n2), timeout=HANG)
    finally:
        delete(pod)
    wait_for("no device of node-2 but its own pods' and its way in has it", lambda: attached_everywhere(lab),
             timeout=HANG)  # fmt: skip


def test_an_agent_killed_and_restarted_replaces_its_program_without_cutting_a_flow(lab: Lab) -> None:
    n1, n2 = lab.nodes[:2]
    a = next(p for p in routed(lab) if p.node is n1)
    b = next(p for p in routed(lab) if p.node is n2)
    old = ours_on(n1)
    sink = Sink(b.ns, socket.AF_INET, 7300)
    try:
        n1.kill()  # kill -9: the program stays on the devices and keeps shortcutting
        assert ours_on(n1) == old
        sent, got, _ = send(a.ns, b.ip4, 7300)
        assert got == sent
        n1.start()
        n1.wait_ready()
        wait_for("one program per device, the new agent's", lambda: attached_everywhere(lab) and all(
            len(ids) == 1 and ids[0] not in old.get(dev, []) for dev, ids in ours_on(n1).items()),
            timeout=HANG)  # fmt: skip
        sent, got, _ = send(a.ns, b.ip4, 7300)
        assert got == sent
        assert redirected(n1)["out"] > 100  # the new agent's counters: the flow took its program
    finally:
        sink.close()


def test_turning_it_off_takes_the_program_off_every_device_and_pods_still_talk(lab: Lab) -> None:
    n1, n2 = lab.nodes[:2]
    a = next(p for p in routed(lab) if p.node is n1)
    b = next(p for p in routed(lab) if p.node is n2)
    sink = Sink(b.ns, socket.AF_INET, 7400)
    try:
        n1.write_config()  # picked up within a second: the cluster network restarts without the redirect
        wait_for("no program on node-1", lambda: ours_on(n1) == {}, timeout=HANG)
        n1.wait_ready()
        sent, got, _ = send(a.ns, b.ip4, 7400)
        assert got == sent
    finally:
        n1.write_config(extra=REDIRECT)
        sink.close()
    wait_for("back on every device", lambda: attached_everywhere(lab), timeout=HANG)


class Echo:
    """A TCP server in a netns echoing whatever each connection sends."""

    def __init__(self, ns: Netns, port: int) -> None:
        self.serving = Serving()
        self.serving.connections(ns.call(Sink._listen, socket.AF_INET, port), self._echo)

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while chunk := conn.recv(1 << 16):
                conn.sendall(chunk)

    def close(self) -> None:
        self.serving.close()


def echoed(c: socket.socket, timeout: float = 2.0) -> bool:
    """Whether a message on the open connection ``c`` comes back within ``timeout`` (it may come later)."""
    c.settimeout(timeout)
    c.sendall(b"x" * 1000)
    got = b""
    try:
        while len(got) < 1000:
            chunk = c.recv(1000 - len(got))
            if not chunk:
                return False
            got += chunk
    except TimeoutError:
        return False
    return True


@contextlib.contextmanager
def shortcut(lab: Lab, port: int) -> Iterator[tuple[Node, Pod, socket.socket]]:
    """An open TCP connection from a routed pod of node-2 to an echo server on ``port`` in one of node-1's, once its
    packets go past node-1's forwarding path: (node-1, its pod, the client's socket); closed at the end."""
    n1, n2 = lab.nodes[:2]
    a = next(p for p in routed(lab) if p.node is n1)
    b = next(p for p in routed(lab) if p.node is n2)
    echo = Echo(a.ns, port)
    try:
        with b.ns.call(lambda: socket.create_connection((a.ip4, port), timeout=HANG)) as c:
            before = redirected(n1)["peer"]
            assert all(echoed(c) for _ in range(50))
            # (a pod the quarantine held is let go at the agent's next look, 1 s or more after its address)
            wait_for("the open connection is shortcut into the pod",
                     lambda: echoed(c) and redirected(n1)["peer"] > before, timeout=HANG)  # fmt: skip
            yield n1, a, c
    finally:
        echo.close()


def test_a_pod_address_the_quarantine_holds_gets_nothing_past_it(lab: Lab) -> None:
    """The quarantine drops every packet to and from a held address on the forward hook, an established flow's too
    (the address's previous pod may have left one): the redirect must not carry them past it."""
    with shortcut(lab, 7500) as (n1, a, c):
        n1.ns.exec("nft", "add", "element", "inet", "nodeplug-quarantine", "q4", f"{{ {a.ip4} }}")
        try:
            # a pod's veth coming and going makes the agent look at its pods (as an ADD or DEL of a reused address
            # does)
            delete(lab.add_pod(n1, "routed"))
            wait_for("the held pod's open connection is cut", lambda: not echoed(c, 0.5), timeout=HANG)
            assert not echoed(c)
        finally:
            n1.ns.exec("nft", "delete", "element", "inet", "nodeplug-quarantine", "q4", f"{{ {a.ip4} }}")
        wait_for("the connection goes on once let go", lambda: echoed(c, 2.0), timeout=HANG)


def test_a_flow_whose_tracking_entry_goes_meets_the_nodes_filters_again(lab: Lab) -> None:
    """The program keeps a flow's decision for a moment only: once the flow's connection tracking entry is gone
    (``conntrack -D``), its packets meet the node's filters again as a new connection's, and a filter that drops new
    connections on the port (both ways, so that no packet of either end starts an entry that lets the other's
    through) stops it; let through again, it is picked up, tracked and shortcut as before."""
    with shortcut(lab, 7600) as (n1, _, c):
        n1.ns.exec("nft", "add", "table", "inet", "t7600")
        try:
            n1.ns.exec("nft", "add", "chain", "inet", "t7600", "gate", "{ type filter hook forward priority 0; }")
            for port in ("dport", "sport"):
                n1.ns.exec("nft", "add", "rule", "inet", "t7600", "gate", "tcp", port, "7600", "ct", "state", "new",
                           "drop")  # fmt: skip
            out = n1.ns.exec("conntrack", "-D", "-p", "tcp", "--dport", "7600")  # fails where it deleted nothing
            assert "ESTABLISHED" in out and "dport=7600" in out, out
            wait_for("the flow stops at the node's filter", lambda: not echoed(c, 0.5), timeout=HANG)
            assert not echoed(c)
        finally:
            n1.ns.exec("nft", "delete", "table", "inet", "t7600")
        wait_for("the connection goes on once let through", lambda: echoed(c, 2.0), timeout=HANG)
        mark = redirected(n1)["peer"]
        wait_for("its packets are shortcut again", lambda: echoed(c) and redirected(n1)["peer"] > mark, timeout=HANG)


def doctor_line(node: Node) -> str:
    return node.doctor("redirect on every")


def test_the_doctor_says_where_the_program_is_missing(lab: Lab) -> None:
    n2 = lab.nodes[1]
    wait_for("the program on every routed veth and way in", lambda: attached_everywhere(lab), timeout=HANG)
    line = doctor_line(n2)
    assert " OK " in line and "1 routed pod veth(s), 2 way(s) in" in line, line
    veth = next(p.host_veth for p in routed(lab) if p.node is n2)

    def take_off() -> None:  # behind the agent's back, as another tool on the node might
        index = socket.if_nametoindex(veth)
        for pid in bpf.attached(index):
            with bpf.prog_by_id(pid) as p:
                bpf.detach(index, p)

    n2.ns.call(take_off)
    try:
        line = doctor_line(n2)
        assert " FAIL " in line and f"{veth}: no redirect program" in line, line
    finally:
        # the agent puts it back at its next look at the pods (a pod's veth coming and going makes it look)
        delete(lab.add_pod(n2, "routed"))
        wait_for("back on every device", lambda: attached_everywhere(lab), timeout=HANG)


class Trickle:
    """A flow that lasts: ``proto`` ("tcp" or "udp") from ``src`` to ``dst``:``port``, a small write every tenth
    of a second until :meth:`stop`; UDP datagrams are echoed by the server this starts in ``server``."""

    def __init__(self, src: Netns, server: Netns, dst: str, port: int, proto: str) -> None:
        self.proto, self.sent, self.echoed = proto, hashlib.sha256(), 0
        self.done = threading.Event()
        kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        if proto == "tcp":
            self.sink = Sink(server, socket.AF_INET, port)
        else:
            self.echo = Serving()
            self.echo.serve(server.call(self._bound, port), echo_datagrams)
        self.sock: socket.socket = src.call(self._connected, kind, dst, port)
        self.sport = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _bound(port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", port))
        return s

    @staticmethod
    def _connected(kind: int, dst: str, port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, kind)
        s.settimeout(HANG)
        s.connect((dst, port))
        return s

    def _run(self) -> None:
        while not self.done.wait(0.1):
            data = os.urandom(512)
            self.sent.update(data)
            self.sock.sendall(data)  # TCP: all of it, or the hash the server answers would not be ours
            if self.proto == "udp":
                self.sock.settimeout(1)
                with contextlib.suppress(TimeoutError):
                    self.echoed += self.sock.recv(2048) == data

    def stop(self) -> str:
        """Stop; for TCP, the SHA-256 the server answers for all it read (for UDP: "")."""
        self.done.set()
        self.thread.join(HANG)
        got = ""
        if self.proto == "tcp":
            self.sock.shutdown(socket.SHUT_WR)
            got = self.sock.recv(100).decode()
            self.sink.close()
        else:
            self.echo.close()
        self.sock.close()
        return got


def entry(node: Node, proto: str, port: int, sport: int) -> tuple[str, str]:
    """(id, the line) of the connection tracking entry on ``node`` of the flow from ``sport`` to ``port``, or
    ("", "")."""
    out = node.ns.exec("conntrack", "-L", "-p", proto, "--sport", str(sport), "--dport", str(port), "-o", "id",
                       check=False)  # fmt: skip
    m = re.search(r"^.*\bid=(\d+).*$", out, re.M)
    return (m.group(1), m.group(0)) if m else ("", "")


def assured(node: Node, proto: str, port: int, sport: int) -> tuple[str, str] | None:
    found = entry(node, proto, port, sport)
    return found if "[ASSURED]" in found[1] else None


def reloaded(lab: Lab, nodes: list[Node]) -> None:
    """Wait until the agents of ``nodes`` have put a program of another load on every device, having looked at the
    node again: a pod's veth coming and going makes them look, as each full pass of the cluster network does."""
    before = {n.name: {pid for ids in ours_on(n).values() for pid in ids} for n in nodes}
    for node in nodes:
        delete(lab.add_pod(node, "routed"))

    def anew() -> bool:
        return attached_everywhere(lab) and all(
            not {pid for ids in ours_on(n).values() for pid in ids} & before[n.name] for n in nodes
        )

    wait_for("a program of another load on every device", anew, timeout=HANG)


def left(line: str) -> int:
    """The seconds a conntrack entry (a line of ``conntrack -L``) has left."""
    return int(line.split()[2])


TIMEOUT_KEYS = {"tcp": "nf_conntrack_tcp_timeout_established", "udp": "nf_conntrack_udp_timeout_stream"}


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_a_long_flow_keeps_its_connection_tracking_entry_while_it_goes_past(lab: Lab, proto: str) -> None:
    """The ordinary path gives an entry its full time again at every packet; the redirected packets do not pass
    there, so without the program's refresh an active flow's entry would expire (after 5 days for TCP, 2 minutes
    for UDP) and its next packet start a new one, judged by the policies as a new connection, possibly from the
    other end. Here with a 6-second timeout, over four of them, set while the agents run (kube-proxy sets the
    timeouts when it starts, perhaps after the agent): the agents load the program again for them, and the entry
    never has more time left than they say (a program still built for the 5 days or 2 minutes it read at first
    would give it that)."""
    n1, n2 = lab.nodes[:2]
    a = next(p for p in routed(lab) if p.node is n1)
    b = next(p for p in routed(lab) if p.node is n2)
    key = f"/proc/sys/net/netfilter/{TIMEOUT_KEYS[proto]}"
    short = 6
    before = {n.name: n.ns.exec("cat", key).strip() for n in (n1, n2)}
    for n in (n1, n2):
        n.ns.exec("sh", "-c", f"echo {short} > {key}")
    reloaded(lab, [n1, n2])
    port = 7500 if proto == "tcp" else 7501
    flow = Trickle(a.ns, b.ns, b.ip4, port, proto)
    try:
        first = {n.name: wait_for(f"{n.name} has the flow assured", lambda n=n: assured(n, proto, port, flow.sport),
                                  timeout=HANG) for n in (n1, n2)}  # fmt: skip
        counted = {n.name: redirected(n) for n in (n1, n2)}
        for _ in range(8 * short):  # four timeouts' worth of looks, half a second apart
            time.sleep(0.5)
            for n in (n1, n2):
                got = entry(n, proto, port, flow.sport)
                assert got[0] == first[n.name][0], f"{n.name}: the entry {first[n.name][1]} became {got[1]}"
                assert left(got[1]) <= short, f"{n.name}: {got[1]}"
        assert redirected(n1)["out"] - counted[n1.name]["out"] > 8 * short  # it went past all the while
        assert redirected(n2)["peer"] - counted[n2.name]["peer"] > 8 * short
    finally:
        got = flow.stop()
        for n in (n1, n2):
            n.ns.exec("sh", "-c", f"echo {before[n.name]} > {key}")
        reloaded(lab, [n1, n2])
    if proto == "tcp":
        assert got == flow.sent.hexdigest()
    else:
        assert flow.echoed > 8 * short
