"""The SQLite lease store under real concurrency: separate processes, kill -9, restart; and the entry point as an
IPAM plugin from many processes at once. No root needed: no kernel objects are made."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cni.ipam import allocator, service
from cni.ipam.sqlite import SqliteStore
from cni.ipam.store import Lease
from cni.netconf import parse_ipam
from cni.types import IPConfig

from support.processes import kill_9_when

ENTRY = [sys.executable, "-m", "cni.entry"]


def _allocate_one(data_dir: str, cid: str, start_at: float, out: Any) -> None:
    ipam = parse_ipam({"type": "nodeplug", "ranges": [[{"subnet": "10.40.0.0/24"}]], "dataDir": data_dir})
    time.sleep(max(0.0, start_at - time.time()))  # all children hit the store at the same moment
    try:
        store = SqliteStore(data_dir, "busy")  # a fresh connection: nothing inherited from the parent
        with store.transaction() as txn:
            ips = allocator.allocate(txn, ipam, cid, "eth0")
        out.put((cid, str(ips[0].address)))
    except Exception as e:
        out.put((cid, f"error: {e}"))


def test_200_concurrent_allocations_from_separate_processes_never_duplicate(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    start_at = time.time() + 1.5
    procs = [ctx.Process(target=_allocate_one, args=(str(tmp_path), f"c{i}", start_at, q)) for i in range(200)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    errors = [v for v in results.values() if v.startswith("error")]
    assert not errors, errors[:3]
    addrs = list(results.values())
    assert len(addrs) == 200 and len(set(addrs)) == 200
    assert "10.40.0.1/24" not in addrs and "10.40.0.0/24" not in addrs and "10.40.0.255/24" not in addrs
    rows = sqlite3.connect(tmp_path / "busy.db").execute("SELECT count(*), count(DISTINCT ip) FROM leases").fetchone()
    assert rows == (200, 200)


def test_leases_survive_reopen_and_the_file_is_private(tmp_path: Path) -> None:
    ipam = parse_ipam({"type": "nodeplug", "ranges": [[{"subnet": "10.41.0.0/24"}]], "dataDir": str(tmp_path)})
    store = SqliteStore(tmp_path, "net")
    with store.transaction() as txn:
        first = allocator.allocate(txn, ipam, "a", "eth0")
    store.close()
    again = SqliteStore(tmp_path, "net")
    with again.transaction() as txn:
        assert allocator.allocate(txn, ipam, "a", "eth0") == first  # same lease after a restart
        assert str(allocator.allocate(txn, ipam, "b", "eth0")[0].address) == "10.41.0.3/24"  # continues after .2
    assert (tmp_path / "net.db").stat().st_mode & 0o777 == 0o600
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


_HOLD_OPEN = """
import sys, time
from cni.ipam.sqlite import SqliteStore
from cni.ipam.store import Lease
from cni.ipam.store import Lease
store = SqliteStore(sys.argv[1], "net")
with store.transaction() as txn:
    txn.reserve(Lease("10.42.0.9", "victim", "eth0", "0"))
    print("reserved", flush=True)
    time.sleep(60)
"""


def test_kill_9_inside_a_transaction_loses_nothing_committed_and_keeps_nothing_half_done(tmp_path: Path) -> None:
    ipam = parse_ipam({"type": "nodeplug", "ranges": [[{"subnet": "10.42.0.0/24"}]], "dataDir": str(tmp_path)})
    committed, _ = service.add("net", ipam, "kept", "eth0", opener=lambda d, n: SqliteStore(d, n))
    kill_9_when([sys.executable, "-c", _HOLD_OPEN, str(tmp_path)], "reserved")
    store = SqliteStore(tmp_path, "net")  # the write lock died with the process
    with store.transaction() as txn:
        owners = {x.container_id: x.ip for x in txn.leases()}
    assert owners == {"kept": str(committed[0].address.ip)}


def _ipam_plugin_conf(data_dir: Path, subnet: str = "10.43.0.0/24") -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "refnet",
        "type": "bridge",
        "ipam": {"type": "nodeplug", "ranges": [[{"subnet": subnet}]], "dataDir": str(data_dir)},
        "socket": str(data_dir / "no-agent.sock"),
    }


def test_entry_point_as_ipam_plugin_from_40_processes_at_once(tmp_path: Path) -> None:
    conf_file = tmp_path / "conf.json"
    conf_file.write_text(json.dumps(_ipam_plugin_conf(tmp_path)))
    procs = []
    for i in range(40):
        env = {
            "PATH": os.environ["PATH"],
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": f"c{i}",
            "CNI_NETNS": "/run/netns/unused",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/usr/lib/cni",
        }
        with conf_file.open("rb") as stdin:
            procs.append(subprocess.Popen(ENTRY, stdin=stdin, stdout=subprocess.PIPE, env=env))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        outs.append(json.loads(out))
        assert p.returncode == 0, outs[-1]
    addrs = [o["ips"][0]["address"] for o in outs]
    assert len(set(addrs)) == 40
    assert all("interfaces" not in o for o in outs)  # an IPAM plugin reports no interfaces
    ipam = parse_ipam(_ipam_plugin_conf(tmp_path)["ipam"])
    held = service.leased("refnet", ipam, "c7", "eth0", opener=lambda d, n: SqliteStore(d, n))
    assert [str(x.address) for x in held] == [addrs[7]]
    assert isinstance(held[0], IPConfig)


def test_leases_of_an_earlier_boot_are_released_on_open(tmp_path: Path) -> None:
    ipam = parse_ipam({"type": "nodeplug", "ranges": [[{"subnet": "10.44.0.0/24"}]], "dataDir": str(tmp_path)})
    before = SqliteStore(tmp_path, "net", boot_id="boot-a")
    with before.transaction() as txn:
        allocator.allocate(txn, ipam, "old-pod", "eth0")
        txn.reserve(Lease("10.44.0.50", "legacy", "eth0", "0"))
    before.db.execute("UPDATE leases SET boot_id = '' WHERE container_id = 'legacy'")  # written before boot ids
    before.close()
    same_boot = SqliteStore(tmp_path, "net", boot_id="boot-a")
    assert same_boot.released_stale == 0
    same_boot.close()
    after = SqliteStore(tmp_path, "net", boot_id="boot-b")
    assert after.released_stale == 1
    with after.transaction() as txn:
        assert sorted(x.container_id for x in txn.leases()) == ["legacy"]  # unknown boot: left to GC
    after.close()


def test_a_store_from_before_boot_ids_is_upgraded_in_place(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "net.db") as c:
        c.execute(
            "CREATE TABLE leases (ip TEXT PRIMARY KEY, container_id TEXT NOT NULL, ifname TEXT NOT NULL,"
            " range_key TEXT NOT NULL)"
        )
        c.execute("INSERT INTO leases VALUES ('10.45.0.2', 'kept', 'eth0', '0')")
    c.close()
    store = SqliteStore(tmp_path, "net", boot_id="boot-x")
    with store.transaction() as txn:
        assert [x.container_id for x in txn.leases()] == ["kept"]
        assert txn.reserve(Lease("10.45.0.3", "new", "eth0", "0"))
    store.close()


def test_status_is_code_50_when_the_store_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    conf = _ipam_plugin_conf(blocker / "ipam")
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": "STATUS"}
    p = subprocess.run(
        ENTRY, input=json.dumps({**conf, "cniVersion": "1.1.0"}).encode(), capture_output=True, env=env, timeout=30
    )
    err = json.loads(p.stdout)
    assert p.returncode == 1 and err["code"] == 50 and str(blocker) in err["details"]
