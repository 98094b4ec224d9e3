"""The uninstall protocol of the cluster network (cni/cluster/uninstall.py) without touching the kernel: the lock
(exclusive, dropped by the kernel when its holder dies, safe against its file being removed), the record in it
(hostile bytes parsed safely), the marker, and ``install-cni --uninstall``'s side of it on a temporary root, where no
agent ran or where the agent is in another network namespace (so nothing of this machine's network is touched)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cni.cluster import uninstall
from cni.cluster.config import ClusterConfig
from cni.install import network
from nodeplug import cli
from nodeplug.paths import Root

from support.scriptedkube import scripted_client
from support.wait import eventually

RECORD = uninstall.Record("node-a", "4:4026531840", 110, "/var/lib/nodeplug/cluster/subnets.json", 42)


def test_the_lock_is_exclusive_and_passes_on_when_released(tmp_path: Path) -> None:
    path = tmp_path / "run/nodeplug/cluster-network.lock"
    a, b = uninstall.Lock(path), uninstall.Lock(path)
    assert a.try_acquire() and a.try_acquire()  # taking it again while holding it is a no-op
    assert not b.try_acquire()
    assert not b.acquire(0.2)  # a bounded wait for a held lock gives up
    a.write(RECORD)
    assert uninstall.read_record(path) == RECORD
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire(60)))
    waiter.start()
    a.release()  # the waiter gets it
    waiter.join(60)
    assert got == [True] and b.read() == RECORD
    b.release()


def test_a_holder_killed_with_sigkill_leaves_no_stuck_lock(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    with subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from cni.cluster.uninstall import Lock\n"
         f"assert Lock(Path({str(path)!r})).try_acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert not uninstall.Lock(path).try_acquire()
        finally:
            holder.kill()
            holder.wait(10)
    lock = uninstall.Lock(path)
    assert lock.acquire(2.0)
    lock.release()


def test_a_lock_file_removed_by_its_holder_is_not_taken_by_a_waiter_that_opened_it_before(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    holder, waiter, third = uninstall.Lock(path), uninstall.Lock(path), uninstall.Lock(path)
    assert holder.try_acquire()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire(2.0)))
    t.start()
    time.sleep(0.1)  # the waiter has the old file open and is retrying
    holder.remove()
    holder.release()
    t.join()
    assert got == [True] and waiter.fd is not None
    assert os.path.samestat(os.fstat(waiter.fd), path.stat())  # the file at the path, not the removed one
    assert not third.try_acquire()  # so the lock still excludes
    waiter.release()


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", b'{"format": 2}', b"\xff" * 10, b"x" * 5000,
     json.dumps({**json.loads(RECORD.dumps()), "routeProtocol": 300}).encode(),
     json.dumps({**json.loads(RECORD.dumps()), "routeProtocol": True}).encode(),
     json.dumps({**json.loads(RECORD.dumps()), "subnetsFile": "relative/path"}).encode(),
     json.dumps({**json.loads(RECORD.dumps()), "subnetsFile": "/srv/root/../../etc/x.json"}).encode(),
     json.dumps({**json.loads(RECORD.dumps()), "pid": -1}).encode()],
)  # fmt: skip
def test_a_record_that_is_not_one_reads_as_none(data: bytes) -> None:
    assert uninstall.parse_record(data) is None


def test_a_record_round_trips() -> None:
    assert uninstall.parse_record(RECORD.dumps()) == RECORD


scalars = st.none() | st.booleans() | st.integers(-5, 400) | st.text(max_size=12) | st.lists(st.integers(), max_size=2)
fields = {
    "format": st.sampled_from([1, 2, "1", None]),
    "node": scalars | st.just("node-a"),
    "netns": scalars | st.just("4:4026531840"),
    "routeProtocol": scalars | st.integers(0, 300),
    "subnetsFile": scalars | st.sampled_from(["/var/lib/x.json", "x.json", "/a\x00b", "/r/../../etc/x.json"]),
    "pid": scalars | st.integers(-2, 1 << 40),
}


def assert_checked(got: uninstall.Record) -> None:
    """What every record the parser accepts must satisfy: the uninstall acts on it (deletes the subnets file it
    names, removes routes of its protocol)."""
    assert isinstance(got, uninstall.Record)
    assert 5 <= got.route_protocol <= 254 and got.subnets_file.startswith("/") and got.pid >= 0
    assert isinstance(got.node, str) and isinstance(got.netns, str) and "\x00" not in got.subnets_file
    assert ".." not in got.subnets_file.split("/")  # the uninstall deletes it: never outside the root it names


@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_checked_record_or_none(data: bytes) -> None:
    got = uninstall.parse_record(data)
    if got is not None:
        assert_checked(got)


@given(st.fixed_dictionaries({}, optional=fields))
@example(
    {"format": 1, "node": "node-a", "netns": "4:1", "routeProtocol": 110, "subnetsFile": "/var/lib/x.json", "pid": 7}
)
def test_a_record_from_hostile_json_has_checked_fields(doc: dict[str, object]) -> None:
    got = uninstall.parse_record(json.dumps(doc).encode())
    if got is not None:
        assert_checked(got)
        assert (got.node, got.route_protocol, got.subnets_file) == (
            doc["node"],
            doc["routeProtocol"],
            doc["subnetsFile"],
        )


def test_the_marker_is_requested_once_and_cleared(tmp_path: Path) -> None:
    marker = tmp_path / "run/nodeplug" / "cluster-network.uninstall"
    assert not uninstall.requested(marker) and not uninstall.clear(marker)
    assert uninstall.request(marker) and not uninstall.request(marker)
    assert uninstall.requested(marker) and json.loads(marker.read_text())["format"] == 1
    assert uninstall.clear(marker) and not uninstall.requested(marker)
    assert [p.name for p in marker.parent.iterdir()] == []  # no temp file left


# ---------------------------------------------------------------- install-cni's side on a temporary root


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_without_an_agent_record_a_temporary_root_is_left_as_it_is(tmp_path: Path) -> None:
    root = tmp_path / "host"
    root.mkdir()
    said: list[str] = []
    network.remove_cluster_network(Root(root), said.append)
    assert files(root) == set() and said == []
    assert network.on_this_node(Root(root)) is False


def test_uninstall_asks_the_running_agent_and_waits_for_it(tmp_path: Path) -> None:
    """The "agent" here is a thread holding the lock that stands down when the marker appears. Its record names
    another network namespace, so install-cni then leaves the kernel alone and says so."""
    root = Root(tmp_path)
    agent = uninstall.Lock(root(uninstall.LOCK))
    assert agent.try_acquire()
    agent.write(uninstall.Record("node-a", "0:1", 110, str(root(network.DEFAULT_SUBNETS))))
    assert network.on_this_node(root) is False

    released = threading.Event()

    def stand_down() -> None:
        while not uninstall.requested(root(uninstall.MARKER)):
            time.sleep(0.01)
        time.sleep(0.2)  # a while, during which install-cni must keep waiting
        agent.release()
        released.set()

    t = threading.Thread(target=stand_down)
    t.start()
    said: list[str] = []
    network.remove_cluster_network(root, said.append, timeout=60)
    assert released.is_set()  # it returned only once the agent had stood down
    t.join()
    assert "asked the running agent" in said[0] and "another network namespace" in said[1], said
    assert uninstall.requested(root(uninstall.MARKER))  # until the next install
    network.withdraw_uninstall(root, said.append)
    assert not uninstall.requested(root(uninstall.MARKER)) and "withdrew" in said[-1]


def test_an_agent_that_does_not_stand_down_fails_the_uninstall_naming_the_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Root(tmp_path)
    agent = uninstall.Lock(root(uninstall.LOCK))
    assert agent.try_acquire()
    agent.write(uninstall.Record("node-a", "0:1", 110, str(root(network.DEFAULT_SUBNETS))))
    try:
        with pytest.raises(network.NetworkError, match="did not remove the cluster network within 1 s"):
            network.remove_cluster_network(root, print, timeout=1)
        monkeypatch.setattr(network, "AGENT_TIMEOUT", 0.5)
        assert cli.main(["install-cni", "--root", str(tmp_path), "--uninstall"]) == 1
    finally:
        agent.release()
    assert str(root(uninstall.MARKER)) in capsys.readouterr().err


# ---------------------------------------------------------------- the agent's side, before any kernel work


def _api_away(tmp_path: Path) -> Any:
    """A client of an API server that answers every request with 503 (the agent then never touches the kernel)."""
    return scripted_client(lambda request: httpx2.Response(503, json={"kind": "Status", "code": 503}), tmp_path)


def _network(tmp_path: Path, kube: Any) -> Any:
    """node-a's cluster network service with its lock, marker and subnets file under ``tmp_path``."""
    from cni.cluster.network import ClusterNetwork
    from nodeplug.log import get_logger

    return ClusterNetwork(ClusterConfig(), kube, "node-a", tmp_path / "subnets.json", get_logger("cni"),
                          lock_path=tmp_path / "lock", marker_path=tmp_path / "marker")  # fmt: skip


def test_the_agent_takes_the_lock_records_what_it_manages_and_waits_while_the_api_is_away(tmp_path: Path) -> None:
    """Until the first complete list of Nodes the agent changes nothing: it holds the lock (with its record) and
    waits (that it waits without spinning, with the API server away, is scripts/bench-cluster-network's figure:
    the reconcile loop once polled with a zero timeout until the API server answered)."""

    async def run() -> tuple[uninstall.Record | None, tuple[bool, str]]:
        kube = _api_away(tmp_path)
        net = _network(tmp_path, kube)
        await net.start()
        try:
            # the lock taken and the record written (role "managing"), the API server seen refusing
            await eventually(lambda: net.role == "managing" and net.watch.status.last_error != "", 60, "both")
            return uninstall.read_record(tmp_path / "lock"), net.readiness()
        finally:
            await net.stop()
            assert not net.lock.held
            await kube.close()

    record, (ready, detail) = asyncio.run(run())
    assert record is not None and (record.node, record.route_protocol) == ("node-a", 110)
    assert record.netns == uninstall.this_netns() and record.subnets_file == str(tmp_path / "subnets.json")
    assert not ready and "waiting for node node-a's podCIDRs" in detail
    assert uninstall.Lock(tmp_path / "lock").try_acquire()  # released on stop


def test_the_agent_looks_at_the_marker_and_takes_the_lock_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's file I/O (the marker every 0.2 s, the lock, the record written into it) runs on the netlink
    thread: on the event loop it would stall the agent's gRPC servers whenever the runtime directory is slow."""

    seen: dict[str, set[int]] = {"requested": set(), "try_acquire": set(), "write": set()}
    real = (uninstall.requested, uninstall.Lock.try_acquire, uninstall.Lock.write)

    def requested(marker: Path) -> bool:
        seen["requested"].add(threading.get_ident())
        return real[0](marker)

    def try_acquire(self: uninstall.Lock) -> bool:
        seen["try_acquire"].add(threading.get_ident())
        return real[1](self)

    def write(self: uninstall.Lock, record: uninstall.Record) -> None:
        seen["write"].add(threading.get_ident())
        real[2](self, record)

    monkeypatch.setattr(uninstall, "requested", requested)
    monkeypatch.setattr(uninstall.Lock, "try_acquire", try_acquire)
    monkeypatch.setattr(uninstall.Lock, "write", write)

    async def run() -> int:
        kube = _api_away(tmp_path)
        net = _network(tmp_path, kube)
        await net.start()
        try:
            await asyncio.sleep(0.5)
            assert net.role == "managing"
        finally:
            await net.stop()
            await kube.close()
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    for what, threads in seen.items():
        assert threads, f"{what} was never called"
        assert loop_thread not in threads, f"{what} ran on the event loop"
