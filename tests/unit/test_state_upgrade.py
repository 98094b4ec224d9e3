"""An upgraded agent keeps every volume, snapshot, group snapshot, stage and publish record and lease of the release
before it: databases written by earlier releases (``tests/fixtures/state-<release>/``, made with that release's code
by ``tests/fixtures/make_state_fixtures.py``) are opened with today's code and compared with what that release itself
read back from them."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cni.errors import IPAM_STORE, CniError
from cni.ipam.sqlite import MIGRATIONS as IPAM_MIGRATIONS
from cni.ipam.sqlite import SqliteStore
from csi.state import SCHEMA_VERSION, StateStore
from nodeplug.sqlitedb import SchemaTooNew

from support.sqlitefiles import user_version

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RELEASES = sorted(p.name for p in FIXTURES.glob("state-*") if p.is_dir())


def _as_written(records: list[Any], expected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Today's records as dicts, limited to the fields the old release had (new fields are checked on their own)."""
    keys = set(expected[0]) if expected else set()
    out = []
    for r in records:
        d = json.loads(json.dumps(dataclasses.asdict(r)))  # tuples become lists, as in the JSON
        out.append({k: v for k, v in d.items() if k in keys})
    return out


def test_there_are_fixtures() -> None:
    assert RELEASES, f"no fixture databases under {FIXTURES}"


@pytest.mark.parametrize("release", RELEASES)
def test_csi_state_of_an_earlier_release_is_kept(tmp_path: Path, release: str) -> None:
    shutil.copy(FIXTURES / release / "csi-state.db", tmp_path / "state.db")
    expected = json.loads((FIXTURES / release / "csi-state.json").read_text())
    assert user_version(tmp_path / "state.db") == expected["user_version"]

    store = StateStore(tmp_path / "state.db")
    volumes = store.list_volumes()[0]
    snapshots = store.list_snapshots()[0]
    groups = [store.get_group_snapshot(g["group_snapshot_id"]) for g in expected["group_snapshots"]]
    assert _as_written(volumes, expected["volumes"]) == expected["volumes"]
    assert _as_written(snapshots, expected["snapshots"]) == expected["snapshots"]
    assert _as_written(groups, expected["group_snapshots"]) == expected["group_snapshots"]
    assert _as_written(store.list_stages(), expected["stages"]) == expected["stages"]
    assert _as_written(store.list_publishes(), expected["publishes"]) == expected["publishes"]
    for v in expected["volumes"]:  # and each one found the ways the servicers look it up
        got = store.get_volume(v["volume_id"])
        assert got is not None and store.get_volume_by_name(v["name"]) == got
    for s in expected["snapshots"]:
        assert store.get_snapshot(s["snapshot_id"]) == store.get_snapshot_by_name(s["name"]) is not None
    for p in expected["publishes"]:
        assert store.get_publish(p["volume_id"], p["target_path"]) is not None
    assert not any(p.created for p in store.list_publishes())  # unknown for old records: never removed
    store.close()
    assert user_version(tmp_path / "state.db") == SCHEMA_VERSION

    again = StateStore(tmp_path / "state.db")  # the migrated file opens as it is
    assert again.list_volumes()[0] == volumes and again.list_snapshots()[0] == snapshots
    again.close()


@pytest.mark.parametrize("release", RELEASES)
def test_ipam_leases_of_an_earlier_release_are_kept(tmp_path: Path, release: str) -> None:
    shutil.copy(FIXTURES / release / "fixture-net.db", tmp_path / "fixture-net.db")
    expected = json.loads((FIXTURES / release / "fixture-net.json").read_text())

    store = SqliteStore(tmp_path, "fixture-net", boot_id=expected["boot_id"])
    assert store.released_stale == 0
    with store.transaction() as txn:
        assert sorted([list(x) for x in txn.leases()]) == expected["leases"]
        assert {k: txn.last_reserved(k) for k in expected["last_reserved"]} == expected["last_reserved"]
        for ip, cid, ifname, _ in expected["leases"]:
            assert ip in [x.ip for x in txn.leases_of(cid, ifname)]
    boot_ids = dict(store.db.execute("SELECT ip, boot_id FROM leases").fetchall())
    assert boot_ids == expected["boot_ids"]
    store.close()
    assert user_version(tmp_path / "fixture-net.db") == len(IPAM_MIGRATIONS)

    rebooted = SqliteStore(tmp_path, "fixture-net", boot_id="another-boot")  # the behaviour carried over too
    with rebooted.transaction() as txn:
        assert [x.container_id for x in txn.leases()] == ["legacy"]  # no boot id: left to GC
    rebooted.close()


def test_a_state_database_of_a_newer_release_is_refused_untouched(tmp_path: Path) -> None:
    StateStore(tmp_path / "state.db").close()
    c = sqlite3.connect(tmp_path / "state.db")
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.close()
    before = (tmp_path / "state.db").read_bytes()
    with pytest.raises(SchemaTooNew, match="newer nodeplug"):
        StateStore(tmp_path / "state.db")
    assert (tmp_path / "state.db").read_bytes() == before


def test_an_ipam_store_of_a_newer_release_is_refused_with_the_store_error(tmp_path: Path) -> None:
    SqliteStore(tmp_path, "net", boot_id="b").close()
    c = sqlite3.connect(tmp_path / "net.db")
    c.execute(f"PRAGMA user_version = {len(IPAM_MIGRATIONS) + 1}")
    c.close()
    with pytest.raises(CniError) as e:
        SqliteStore(tmp_path, "net", boot_id="b")
    assert e.value.code == IPAM_STORE and "newer nodeplug" in str(e.value.details)
