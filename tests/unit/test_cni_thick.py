"""Thick mode without kernel objects: the agent plugin in-process (its command table replaced by recorders), the
entry point as its client, and fake agents that never ACK or die after GO."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from cni import entry, skel, thick
from cni.config import Config
from cni.plugin import CniPlugin, create
from cni.types import Result
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/run/netns/p",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/x",
}


def conf(sock: Path, **kw: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "n", "type": "nodeplug", "socket": str(sock), **kw}


class Slow:
    """A handler that records when it ran."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.spans: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()

    def __call__(self, req: skel.Request) -> Result | None:
        t0 = time.monotonic()
        time.sleep(self.seconds)
        with self.lock:
            self.spans.append((req.container_id, t0, time.monotonic()))
        return Result(cni_version=req.conf.cni_version) if req.command == "ADD" else None


@pytest.fixture
async def agent(tmp_root: Path) -> AsyncIterator[tuple[CniPlugin, Slow, Path]]:
    plugin = create(Config(workers=4), AgentContext(root=Root(tmp_root)))
    await plugin.start()
    handler = Slow(0.2)
    plugin._table = {c: handler for c in ("ADD", "DEL", "CHECK", "GC", "STATUS")}
    try:
        yield plugin, handler, tmp_root / "run/nodeplug/cni.sock"
    finally:
        await plugin.stop(1.0)


def run_entry(env: dict[str, str], stdin: dict[str, Any] | bytes) -> tuple[int, Any]:
    data = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    out = io.StringIO()
    code = entry.run(env, io.BytesIO(data), out)
    return code, json.loads(out.getvalue()) if out.getvalue() else None


async def test_agent_serves_the_entry_point(agent: tuple[CniPlugin, Slow, Path]) -> None:
    plugin, handler, sock = agent
    assert sock.is_socket() and sock.stat().st_mode & 0o777 == 0o600
    assert plugin.readiness().ready
    code, out = await asyncio.to_thread(run_entry, ENV, conf(sock))
    assert (code, out) == (0, {"cniVersion": "1.0.0", "dns": {}})
    assert [s[0] for s in handler.spans] == ["c1"]
    # validation errors come back from the agent as the spec's JSON, exit 1
    code, out = await asyncio.to_thread(run_entry, {**ENV, "CNI_IFNAME": "bad/name"}, conf(sock))
    assert code == 1 and out["code"] == 4
    metrics = plugin.ctx.metrics.render().decode()
    assert 'nodeplug_cni_requests_total{code="0",command="ADD"} 1.0' in metrics
    assert 'nodeplug_cni_requests_total{code="4",command="ADD"} 1.0' in metrics


async def test_same_container_serialised_different_containers_concurrent(agent: tuple[CniPlugin, Slow, Path]) -> None:
    _, handler, sock = agent
    envs = [{**ENV, "CNI_CONTAINERID": cid} for cid in ("a", "a", "b", "c")]
    t0 = time.monotonic()
    results = await asyncio.gather(*(asyncio.to_thread(run_entry, e, conf(sock)) for e in envs))
    assert all(code == 0 for code, _ in results)
    spans = {cid: sorted((s, e) for c, s, e in handler.spans if c == cid) for cid in "abc"}
    (_, a1e), (a2s, _) = spans["a"]
    assert a2s >= a1e  # the two requests for "a" did not overlap
    assert time.monotonic() - t0 < 0.2 * 4  # b and c ran alongside a


async def test_stop_removes_the_socket_and_readiness_drops(tmp_root: Path) -> None:
    plugin = create(Config(), AgentContext(root=Root(tmp_root)))
    assert not plugin.readiness().ready
    await plugin.start()
    sock = tmp_root / "run/nodeplug/cni.sock"
    assert sock.is_socket()
    await plugin.stop(1.0)
    assert not sock.exists() and not plugin.readiness().ready


def ipam_only(tmp_path: Path, sock: Path) -> dict[str, Any]:
    """A config the entry point can serve standalone without netlink: nodeplug as the reference bridge's IPAM."""
    return {
        "cniVersion": "1.0.0",
        "name": "n",
        "type": "bridge",
        "socket": str(sock),
        "agentTimeout": 0.3,
        "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.60.0.0/24"}]], "dataDir": str(tmp_path)},
    }


def test_no_socket_means_standalone(tmp_path: Path) -> None:
    code, out = run_entry(ENV, ipam_only(tmp_path, tmp_path / "absent.sock"))
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24"


@pytest.fixture
def mute_agent(tmp_path: Path) -> Iterator[Path]:
    """Accepts connections and never answers."""
    path = tmp_path / "mute.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(8)
    conns: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            conns.append(c)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield path
    srv.close()
    for c in conns:
        c.close()


def test_agent_that_does_not_ack_in_time_means_standalone(tmp_path: Path, mute_agent: Path) -> None:
    t0 = time.monotonic()
    code, out = run_entry(ENV, ipam_only(tmp_path, mute_agent))
    assert code == 0 and out["ips"][0]["address"] == "10.60.0.2/24"
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_agent_dying_after_go_is_try_again_later(tmp_path: Path) -> None:
    path = tmp_path / "dies.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        thick.read_frame(c)
        c.sendall(thick.ACK)
        assert c.recv(1) == thick.GO
        c.close()  # dies before answering

    t = threading.Thread(target=serve)
    t.start()
    try:
        code, out = run_entry(ENV, ipam_only(tmp_path, path))
    finally:
        t.join(5)
        srv.close()
    assert code == 1 and out["code"] == 11 and str(path) in out["details"]
    assert not list(tmp_path.glob("*.db"))  # the entry point did not redo the work


def test_agent_drops_a_request_whose_client_never_sends_go(tmp_root: Path) -> None:
    async def scenario() -> list[tuple[str, float, float]]:
        plugin = create(Config(handshake_timeout=0.2), AgentContext(root=Root(tmp_root)))
        await plugin.start()
        handler = Slow()
        plugin._table = {"ADD": handler}
        reader, writer = await asyncio.open_unix_connection(str(tmp_root / "run/nodeplug/cni.sock"))
        writer.write(thick.encode_frame({"env": ENV, "stdin": json.dumps(conf(Path("/x")))}))
        assert await reader.readexactly(1) == thick.ACK
        await asyncio.sleep(0.4)  # no GO: the client went standalone
        writer.close()
        await plugin.stop(1.0)
        return handler.spans

    assert asyncio.run(scenario()) == []


def test_oversized_and_garbage_requests_are_dropped(tmp_root: Path) -> None:
    async def scenario() -> bytes:
        plugin = create(Config(max_request_bytes=4096), AgentContext(root=Root(tmp_root)))
        await plugin.start()
        path = str(tmp_root / "run/nodeplug/cni.sock")
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write((10**6).to_bytes(4, "big"))
        got = await reader.read()
        writer.close()
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(thick.encode_frame(["not", "a", "request"]))
        got += await reader.read()
        writer.close()
        await plugin.stop(1.0)
        return got

    assert asyncio.run(scenario()) == b""


_PROBE = """
import io, sys
from cni import entry
env = dict(arg.split("=", 1) for arg in sys.argv[2:])
out = io.StringIO()
code = entry.run(env, io.BytesIO(sys.argv[1].encode()), out)
heavy = [m for m in ("pyroute2", "grpc", "pydantic", "prometheus_client", "cni.dataplane", "cni.commands", "asyncio",
                     "json", "socket", "typing") if m in sys.modules]
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


async def test_thick_mode_add_imports_nothing_heavy(agent: tuple[CniPlugin, Slow, Path]) -> None:
    _, handler, sock = agent
    got = await asyncio.to_thread(probe, ENV, conf(sock))
    assert got["code"] == 0 and handler.spans
    assert got["heavy"] == []


@pytest.mark.parametrize(
    "value",
    [
        {"cniVersion": "1.0.0", "name": "n", "ipam": {"ranges": [[{"subnet": "10.0.0.0/24"}]]}, "mtu": 1400},
        {"s": 'quote " backslash \\ newline \n tab \t nul \x00 unicode é 中 \U0001f600', "f": 1.5, "neg": -3},
        {"t": True, "f": False, "n": None, "e": [], "o": {}},
        [1, "two", [3.25, {"four": None}]],
        "plain",
    ],
)
def test_lean_json_matches_the_json_module(value: Any) -> None:
    text = thick.dumps(value)
    assert json.loads(text) == value
    assert thick.loads(text) == value
    assert thick.loads(json.dumps(value, indent=2)) == value


@pytest.mark.parametrize("text", ["", "   ", "{", '{"a": 1} x', "[1,]", "NaN", '{"a": Infinity}', "{'a': 1}", '"\\x"'])
def test_lean_json_rejects_what_json_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        thick.loads(text)


async def test_reload_moves_the_socket(tmp_root: Path) -> None:
    plugin = create(Config(), AgentContext(root=Root(tmp_root)))
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
