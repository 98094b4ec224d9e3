"""Thick mode without kernel objects: the agent plugin in-process (its command table replaced by recorders, or the real
commands over an in-memory lease store), the entry point as its client, and fake agents that never ACK or die after
GO. Waits are on events (a handler started, a connection closed), never on the clock."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cni.dataplane
from cni import commands, entry, skel, thick
from cni.config import Config
from cni.ipam.store import MemoryStore
from cni.plugin import CniPlugin
from cni.types import Result
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

from support.unixlistener import UnixListener
from support.wait import wait_for

ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/run/netns/p",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/x",
}


def conf(sock: Path, **kw: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "n", "type": "nodeplug", "socket": str(sock), **kw}


class Gate:
    """A handler that notes when each call starts and waits for the test to let it finish."""

    def __init__(self, hold: Callable[[skel.Request], bool] = lambda req: False) -> None:
        self.hold = hold
        self.started: dict[str, threading.Event] = {}
        self.release = threading.Event()
        self.order: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def started_event(self, cid: str) -> threading.Event:
        with self.lock:
            return self.started.setdefault(cid, threading.Event())

    def __call__(self, req: skel.Request) -> Result | None:
        with self.lock:
            self.order.append(("start", req.container_id))
        self.started_event(req.container_id).set()
        if self.hold(req):
            assert self.release.wait(30)
        with self.lock:
            self.order.append(("end", req.container_id))
        return Result(cni_version=req.conf.cni_version) if req.command == "ADD" else None


@pytest.fixture
async def agent(tmp_root: Path) -> AsyncIterator[tuple[CniPlugin, Gate, Path]]:
    handler = Gate()
    table = {c: handler for c in ("ADD", "DEL", "CHECK", "GC", "STATUS")}
    plugin = CniPlugin(Config(workers=4), AgentContext(root=Root(tmp_root)), handlers=table)
    await plugin.start()
    try:
        yield plugin, handler, tmp_root / "run/nodeplug/cni.sock"
    finally:
        handler.release.set()
        await plugin.stop(1.0)


def run_entry(env: dict[str, str], stdin: dict[str, Any] | bytes) -> tuple[int, Any]:
    data = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    out = io.StringIO()
    code = entry.run(env, io.BytesIO(data), out)
    return code, json.loads(out.getvalue()) if out.getvalue() else None


async def test_agent_serves_the_entry_point(agent: tuple[CniPlugin, Gate, Path]) -> None:
    plugin, handler, sock = agent
    assert sock.is_socket() and sock.stat().st_mode & 0o777 == 0o600
    assert plugin.readiness().ready
    code, out = await asyncio.to_thread(run_entry, ENV, conf(sock))
    assert (code, out) == (0, {"cniVersion": "1.0.0", "dns": {}})
    assert handler.order == [("start", "c1"), ("end", "c1")]
    # validation errors come back from the agent as the spec's JSON, exit 1
    code, out = await asyncio.to_thread(run_entry, {**ENV, "CNI_IFNAME": "bad/name"}, conf(sock))
    assert code == 1 and out["code"] == 4
    metrics = plugin.ctx.metrics.render().decode()
    assert 'nodeplug_cni_requests_total{code="0",command="ADD"} 1.0' in metrics
    assert 'nodeplug_cni_requests_total{code="4",command="ADD"} 1.0' in metrics


async def test_same_container_serialised_different_containers_concurrent(
    agent: tuple[CniPlugin, Gate, Path],
) -> None:
    _, handler, sock = agent
    handler.hold = lambda req: req.container_id == "a"  # the first request for "a" holds its lock until released
    first = asyncio.create_task(asyncio.to_thread(run_entry, {**ENV, "CNI_CONTAINERID": "a"}, conf(sock)))
    assert await asyncio.to_thread(handler.started_event("a").wait, 30)
    second = asyncio.create_task(asyncio.to_thread(run_entry, {**ENV, "CNI_CONTAINERID": "a"}, conf(sock)))
    others = [asyncio.to_thread(run_entry, {**ENV, "CNI_CONTAINERID": c}, conf(sock)) for c in ("b", "c")]
    assert [code for code, _ in await asyncio.gather(*others)] == [0, 0]  # b and c ran while "a" was held
    assert handler.order.count(("start", "a")) == 1  # the second "a" waits for the first
    handler.release.set()
    assert [code for code, _ in await asyncio.gather(first, second)] == [0, 0]
    a = [step for step in handler.order if step[1] == "a"]
    assert a == [("start", "a"), ("end", "a"), ("start", "a"), ("end", "a")]


async def test_stop_removes_the_socket_and_readiness_drops(tmp_root: Path) -> None:
    plugin = CniPlugin(Config(), AgentContext(root=Root(tmp_root)))
    assert not plugin.readiness().ready
    await plugin.start()
    sock = tmp_root / "run/nodeplug/cni.sock"
    assert sock.is_socket()
    await plugin.stop(1.0)
    assert not sock.exists() and not plugin.readiness().ready


async def test_the_socket_is_never_open_to_others_whatever_the_umask(
    tmp_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mode is seen the moment the socket listens (the first moment anyone could connect), before anything else
    the agent does."""
    seen: list[int] = []
    path = tmp_root / "run/nodeplug/cni.sock"
    real = socket.socket.listen

    def watched(self: socket.socket, *args: Any) -> None:
        if self.family == socket.AF_UNIX and self.getsockname() == str(path):
            seen.append(path.stat().st_mode & 0o777)
        real(self, *args)

    monkeypatch.setattr(socket.socket, "listen", watched)
    old = os.umask(0)
    try:
        plugin = CniPlugin(Config(), AgentContext(root=Root(tmp_root)))
        await plugin.start()
    finally:
        os.umask(old)
    await plugin.stop(1.0)
    assert seen == [0o600]


def ipam_only(tmp_path: Path, sock: Path, **kw: Any) -> dict[str, Any]:
    """A config the entry point can serve standalone without netlink: nodeplug as the reference bridge's IPAM."""
    return {
        "cniVersion": "1.0.0",
        "name": "n",
        "type": "bridge",
        "socket": str(sock),
        "agentTimeout": 0.3,
        "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.60.0.0/24"}]], "dataDir": str(tmp_path)},
        **kw,
    }


def test_no_socket_means_standalone(tmp_path: Path) -> None:
    code, out = run_entry(ENV, ipam_only(tmp_path, tmp_path / "absent.sock"))
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24"


class FakeAgent:
    """Accepts connections on a unix socket and hands each to ``serve`` on its own thread; counts them."""

    def __init__(self, path: Path, serve: Callable[[socket.socket], None]) -> None:
        self.path, self.serve = path, serve
        self.conns: list[socket.socket] = []
        self.listener = UnixListener(path, self._accepted)

    @property
    def connections(self) -> int:
        return self.listener.connections

    def _accepted(self, c: socket.socket) -> None:
        self.conns.append(c)
        threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def fake_agent(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], FakeAgent]]:
    made: list[FakeAgent] = []

    def make(serve: Callable[[socket.socket], None]) -> FakeAgent:
        made.append(FakeAgent(tmp_path / f"fake{len(made)}.sock", serve))
        return made[-1]

    yield make
    for a in made:
        a.close()


def read_request(c: socket.socket) -> tuple[dict[str, str], bytes]:
    env_size, stdin_size = thick.parse_header(thick.recv_exact(c, thick.HEADER_SIZE))
    return thick.parse_body(thick.recv_exact(c, env_size + stdin_size), env_size)


def take_on(c: socket.socket) -> None:
    """The agent's side of the handshake up to running: read the request, ACK it, and get the client's GO."""
    read_request(c)
    c.sendall(thick.ACK)
    assert c.recv(1) == thick.GO


def test_an_agent_that_does_not_ack_in_time_means_standalone_after_one_try(
    tmp_path: Path, fake_agent: Callable[[Callable[[socket.socket], None]], FakeAgent]
) -> None:
    mute = fake_agent(lambda c: None)  # reads nothing, answers nothing
    code, out = run_entry(ENV, ipam_only(tmp_path, mute.path))
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24"
    assert mute.connections == 1


def test_an_agent_dying_after_go_is_try_again_later(
    tmp_path: Path, fake_agent: Callable[[Callable[[socket.socket], None]], FakeAgent]
) -> None:
    def die(c: socket.socket) -> None:
        take_on(c)
        c.close()  # dies before answering

    a = fake_agent(die)
    code, out = run_entry(ENV, ipam_only(tmp_path, a.path))
    assert code == 1 and out["code"] == 11 and str(a.path) in out["details"]
    assert not list(tmp_path.glob("*.db"))  # the entry point did not redo the work


def handed_on(path: Path, stdin: bytes, waited: float | str) -> dict[str, str]:
    """The entry point's environment after the launcher sent the request to ``path`` and waited ``waited`` seconds
    for its ACK in vain: the open connection is handed on, as the launcher hands it."""
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(path))
    sock.sendall(thick.encode_request(ENV, stdin))
    return {
        **ENV,
        thick.ENV_AGENT_FD: str(sock.detach()),
        thick.ENV_AGENT_WAITED: str(waited),
        thick.ENV_AGENT_TRIED: str(path),
    }


def test_the_entry_point_finishes_on_a_connection_the_launcher_handed_on(
    tmp_path: Path, fake_agent: Callable[[Callable[[socket.socket], None]], FakeAgent]
) -> None:
    """The launcher sent the request and waited; the entry point waits on the same connection, never a new one."""

    def slow(c: socket.socket) -> None:
        take_on(c)
        c.sendall(thick.encode_reply(0, b'{"cniVersion": "1.0.0"}'))

    a = fake_agent(slow)
    stdin = json.dumps(ipam_only(tmp_path, a.path, agentTimeout=5)).encode()
    code, out = run_entry(handed_on(a.path, stdin, waited=0.5), stdin)
    assert (code, out) == (0, {"cniVersion": "1.0.0"}) and a.connections == 1


def test_remaining_wait_is_what_agent_timeout_leaves(
    tmp_path: Path, fake_agent: Callable[[Callable[[socket.socket], None]], FakeAgent]
) -> None:
    """The launcher already waited as long as agentTimeout allows: the entry point does not wait again."""
    a = fake_agent(lambda c: None)
    stdin = json.dumps(ipam_only(tmp_path, a.path, agentTimeout=0.5)).encode()
    code, out = run_entry(handed_on(a.path, stdin, waited=0.5), stdin)
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24" and a.connections == 1


@pytest.mark.parametrize("waited", ["-inf", "-1e400", "nan", "-3"])
def test_a_nonsense_wait_from_the_environment_neither_crashes_nor_waits_longer(
    tmp_path: Path, fake_agent: Callable[[Callable[[socket.socket], None]], FakeAgent], waited: str
) -> None:
    """Regression: NODEPLUG_CNI_AGENT_WAITED=-inf raised OverflowError (no answer on stdout at all), and a negative
    wait made the entry point wait longer than agentTimeout (how long it waits is :func:`thick.waited`'s, whose
    property is in test_cni_entry_properties.py)."""
    a = fake_agent(lambda c: None)
    stdin = json.dumps(ipam_only(tmp_path, a.path, agentTimeout=0.3)).encode()
    code, out = run_entry(handed_on(a.path, stdin, waited), stdin)
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24"
    # the entry point did not wait at all: the stand-in's accept thread may count the one connection only now
    wait_for("the handed-on connection counted", lambda: a.connections >= 1, 30)
    assert a.connections == 1  # and no second one


@pytest.mark.parametrize("fd", ["\u00b2", "99999999999999999999", "\u0663", "-1", "1"])
def test_a_nonsense_handed_fd_from_the_environment_is_ignored(tmp_path: Path, fd: str) -> None:
    """Regression: NODEPLUG_CNI_AGENT_FD=² (str.isdigit accepts it, int() does not) and an fd beyond a C int raised
    ValueError and OverflowError, so the entry point printed nothing; ٣ (another script's 3) was taken as fd 3."""
    sock = tmp_path / "absent.sock"
    env = {**ENV, thick.ENV_AGENT_FD: fd, thick.ENV_AGENT_WAITED: "0.5", thick.ENV_AGENT_TRIED: str(sock)}
    code, out = run_entry(env, ipam_only(tmp_path, sock))
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24"


def test_agent_drops_a_request_whose_client_never_sends_go(tmp_root: Path) -> None:
    async def scenario() -> list[tuple[str, str]]:
        handler = Gate()
        plugin = CniPlugin(Config(handshake_timeout=0.2), AgentContext(root=Root(tmp_root)), handlers={"ADD": handler})
        await plugin.start()
        reader, writer = await asyncio.open_unix_connection(str(tmp_root / "run/nodeplug/cni.sock"))
        writer.write(thick.encode_request(ENV, json.dumps(conf(tmp_root / "run/nodeplug/cni.sock")).encode()))
        assert await reader.readexactly(1) == thick.ACK
        assert await asyncio.wait_for(reader.read(), 30) == b""  # no GO: the agent gives up and closes
        writer.close()
        await plugin.stop(1.0)
        return handler.order

    assert asyncio.run(scenario()) == []


def test_a_request_larger_than_the_agent_takes_is_a_clear_error_not_a_fallback(tmp_root: Path, tmp_path: Path) -> None:
    """Regression (issue 11, CNI 10): it used to be dropped silently and done standalone instead."""

    async def scenario() -> tuple[int, Any]:
        handler = Gate()
        plugin = CniPlugin(Config(max_request_bytes=4096), AgentContext(root=Root(tmp_root)), handlers={"ADD": handler})
        await plugin.start()
        try:
            big = ipam_only(tmp_path, tmp_root / "run/nodeplug/cni.sock", agentTimeout=5, pad="x" * 100_000)
            return await asyncio.to_thread(run_entry, ENV, big)
        finally:
            await plugin.stop(1.0)

    code, out = asyncio.run(scenario())
    assert code == 1 and out["code"] == 7 and "max_request_bytes" in out["details"] and "4096" in out["details"]
    assert not list(tmp_path.glob("*.db"))  # not done standalone either


def test_garbage_and_configs_for_another_agent_are_not_run(tmp_root: Path) -> None:
    async def scenario() -> tuple[bytes, bytes, list[tuple[str, str]]]:
        handler = Gate()
        plugin = CniPlugin(Config(), AgentContext(root=Root(tmp_root)), handlers={"ADD": handler})
        await plugin.start()
        path = str(tmp_root / "run/nodeplug/cni.sock")
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"\0\0\0\x10" + json.dumps({"env": {}}).encode())  # the old JSON framing: no magic
        garbage = await reader.read()
        writer.close()
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(thick.encode_request(ENV, json.dumps(conf(tmp_root / "elsewhere.sock")).encode()))
        elsewhere = await reader.read()
        writer.close()
        await plugin.stop(1.0)
        return garbage, elsewhere, handler.order

    assert asyncio.run(scenario()) == (b"", thick.NOT_HERE, [])


def test_a_fifo_as_netns_is_refused_at_once_and_wedges_nothing(tmp_root: Path, tmp_path: Path) -> None:
    """Regression (issue 11, CNI 5): opening a FIFO as CNI_NETNS blocked the worker forever with the lease committed;
    the next request for that container waited behind it and the agent could not stop."""
    fifo = tmp_path / "netns-fifo"
    os.mkfifo(fifo)
    store = MemoryStore()
    ipam = {"type": "nodeplug", "ranges": [[{"subnet": "10.62.0.0/24"}]], "dataDir": str(tmp_path)}

    async def scenario() -> tuple[tuple[int, Any], tuple[int, Any]]:
        table = commands.table(cni.dataplane, lambda data_dir, network: store)
        plugin = CniPlugin(Config(workers=1), AgentContext(root=Root(tmp_root)), handlers=table)
        await plugin.start()
        sock = tmp_root / "run/nodeplug/cni.sock"
        try:
            add = asyncio.to_thread(run_entry, {**ENV, "CNI_NETNS": str(fifo)}, conf(sock, ipam=ipam))
            first = await asyncio.wait_for(add, 20)
            delete = {k: v for k, v in ENV.items() if k != "CNI_NETNS"} | {"CNI_COMMAND": "DEL"}
            second = await asyncio.wait_for(asyncio.to_thread(run_entry, delete, conf(sock, ipam=ipam)), 20)
        finally:
            with contextlib.suppress(OSError):  # ENXIO: nobody is stuck reading it
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # frees a reader stuck on the FIFO
            await asyncio.wait_for(plugin.stop(1.0), 20)
        return first, second

    (code, out), second = asyncio.run(scenario())
    assert code == 1 and out["code"] == 4 and str(fifo) in out["details"], out
    assert store.leases == {}
    assert second == (0, None)  # the next request for the container is served


_PROBE = """
import io, sys
from cni import entry
env = dict(arg.split("=", 1) for arg in sys.argv[2:])
out = io.StringIO()
code = entry.run(env, io.BytesIO(sys.argv[1].encode()), out)
heavy = [m for m in ("pyroute2", "grpc", "pydantic", "prometheus_client", "cni.dataplane", "cni.commands", "asyncio",
                     "json", "socket", "typing", "subprocess", "nodeplug.commands") if m in sys.modules]
import json  # only now: the probe's own output
print(json.dumps({"code": code, "out": out.getvalue(), "heavy": heavy}))
"""


def probe(env: dict[str, str], stdin: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, "-c", _PROBE, json.dumps(stdin), *(f"{k}={v}" for k, v in env.items())]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout))


def test_version_imports_nothing_heavy() -> None:
    got = probe({"CNI_COMMAND": "VERSION"}, {"cniVersion": "1.1.0"})
    assert got["code"] == 0 and json.loads(got["out"])["cniVersion"] == "1.1.0"
    assert got["heavy"] == []


async def test_thick_mode_add_imports_no_netlink_and_no_private_modules(agent: tuple[CniPlugin, Gate, Path]) -> None:
    _, handler, sock = agent
    got = await asyncio.to_thread(probe, ENV, conf(sock))
    assert got["code"] == 0 and handler.order
    assert set(got["heavy"]) <= {"json", "socket"}  # the standard library's, not _json and _socket


async def test_reload_moves_the_socket(tmp_root: Path) -> None:
    plugin = CniPlugin(Config(), AgentContext(root=Root(tmp_root)))
    await plugin.start()
    try:
        await plugin.reload(Config(workers=2))  # same socket, new pool: restarted in place
        assert (tmp_root / "run/nodeplug/cni.sock").is_socket() and plugin.readiness().ready
        await plugin.reload(Config(socket="/run/nodeplug/other.sock"))
        assert not (tmp_root / "run/nodeplug/cni.sock").exists()
        assert (tmp_root / "run/nodeplug/other.sock").is_socket() and plugin.readiness().ready
        await plugin.reload(Config(socket="/run/nodeplug/other.sock", handshake_timeout=1.0))  # applied live
        assert plugin.section.handshake_timeout == 1.0
    finally:
        await plugin.stop(1.0)
    assert not (tmp_root / "run/nodeplug/other.sock").exists()


def test_a_standalone_del_without_ipmasq_imports_nothing_to_run_nft(tmp_path: Path) -> None:
    """Regression (issue 11, CNI 8): DEL ran nft (through nodeplug.commands, subprocess and asyncio) for every pod."""
    env = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "gone", "CNI_IFNAME": "eth0", "CNI_PATH": "/x",
           "NODEPLUG_CNI_STANDALONE": "1"}  # fmt: skip
    ipam = {"type": "nodeplug", "ranges": [[{"subnet": "10.63.0.0/24"}]], "dataDir": str(tmp_path)}
    got = probe(env, conf(tmp_path / "absent.sock", ipam=ipam, bridge="npnone0"))
    assert (got["code"], got["out"]) == (0, "")
    assert not {"subprocess", "asyncio", "nodeplug.commands"} & set(got["heavy"]), got["heavy"]
