"""The CSI state store: survives a restart, paginates with tokens, stays consistent under threads."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi.errors import Aborted
from csi.model import GroupSnapshot, PublishRecord, Snapshot, StageRecord, Volume
from csi.state import StateStore

from support.processes import run_threads


def vol(i: int, **kw: object) -> Volume:
    base: dict[str, object] = dict(
        volume_id=f"vol-{i:04d}",
        name=f"pvc-{i}",
        capacity_bytes=(i + 1) << 20,
        backend="loopfile",
        access_type="mount",
        fs_type="ext4",
        path=f"/data/volumes/vol-{i:04d}.img",
        parameters={"backend": "loopfile"},
        created_at=1000.0 + i,
    )
    base.update(kw)
    return Volume(**base)  # type: ignore[arg-type]


def snap(i: int, source: str = "vol-0000", group: str = "") -> Snapshot:
    return Snapshot(
        f"snap-{i}",
        f"s-{i}",
        source,
        1 << 20,
        f"/data/snapshots/snap-{i}.img",
        5.0,
        True,
        group,
        "loopfile",
        "mount",
        "ext4",
    )


def test_state_survives_reopen(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    s = StateStore(db)
    s.put_volume(vol(1, source_snapshot_id="snap-9", ephemeral=True))
    s.put_snapshot(snap(1, "vol-0001"))
    s.put_stage(StageRecord("vol-0001", "/k/staging", "/dev/loop7"))
    s.put_publish(PublishRecord("vol-0001", "/k/target", True, "/k/staging"))
    s.close()

    s2 = StateStore(db)
    assert s2.get_volume("vol-0001") == vol(1, source_snapshot_id="snap-9", ephemeral=True)
    assert s2.get_volume_by_name("pvc-1") == s2.get_volume("vol-0001")
    assert s2.get_snapshot("snap-1") == snap(1, "vol-0001")
    assert s2.get_stage("vol-0001") == StageRecord("vol-0001", "/k/staging", "/dev/loop7")
    assert s2.get_publish("vol-0001", "/k/target") == PublishRecord("vol-0001", "/k/target", True, "/k/staging")
    assert s2.list_publishes("vol-0001") == [PublishRecord("vol-0001", "/k/target", True, "/k/staging")]
    assert s2.get_volume("vol-9999") is None


def test_wal_and_full_sync(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    conn = s.db.connection()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_put_replaces_and_keeps_position(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    for i in range(3):
        s.put_volume(vol(i))
    s.put_volume(vol(0, capacity_bytes=99 << 20))
    vols, token = s.list_volumes()
    assert [v.volume_id for v in vols] == ["vol-0000", "vol-0001", "vol-0002"]
    assert vols[0].capacity_bytes == 99 << 20 and token == ""


def test_unique_names(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    s.put_volume(vol(1))
    with pytest.raises(Exception, match="UNIQUE"):
        s.put_volume(vol(2, name="pvc-1"))
    assert s.get_volume("vol-0002") is None


def test_volume_pagination(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    for i in range(7):
        s.put_volume(vol(i))
    seen, token, pages = [], "", 0
    while True:
        page, token = s.list_volumes(3, token)
        seen += [v.volume_id for v in page]
        pages += 1
        if not token:
            break
    assert seen == [f"vol-{i:04d}" for i in range(7)] and pages == 3
    # exactly max_entries left: no dangling token
    assert s.list_volumes(7)[1] == ""
    assert s.list_volumes(7, "7") == ([], "")  # the end itself is a valid (empty) page


def test_pagination_as_the_sanity_suite_checks_it(tmp_path: Path) -> None:
    """The token counts the entries already returned; deleting the last of a page and adding one between pages
    leaves exactly total - page entries from the token onwards."""
    s = StateStore(tmp_path / "state.db")
    for i in range(4):
        s.put_volume(vol(i))
    page, token = s.list_volumes(2)
    assert token == "2"
    s.delete_volume(page[-1].volume_id)
    s.put_volume(vol(9))
    rest, token2 = s.list_volumes(0, token)
    assert len(rest) == 4 - 2 and token2 == ""
    with pytest.raises(Aborted, match="past the end"):
        s.list_volumes(0, "9")
    with pytest.raises(Aborted, match="past the end"):
        s.list_snapshots(0, "1")


@pytest.mark.parametrize("token", ["invalid-token", "-1", "1e3", "9" * 40, "x"])
def test_invalid_token_is_aborted(tmp_path: Path, token: str) -> None:
    s = StateStore(tmp_path / "state.db")
    with pytest.raises(Aborted, match="starting_token"):
        s.list_volumes(1, token)
    with pytest.raises(Aborted):
        s.list_snapshots(1, token)


def test_snapshots_by_source_and_groups(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    for i in range(5):
        s.put_snapshot(snap(i, "vol-a" if i % 2 else "vol-b"))
    assert [x.snapshot_id for x in s.list_snapshots(source_volume_id="vol-a")[0]] == ["snap-1", "snap-3"]
    page, token = s.list_snapshots(1, "", "vol-a")
    assert [x.snapshot_id for x in page] == ["snap-1"] and token
    page, token = s.list_snapshots(1, token, "vol-a")
    assert [x.snapshot_id for x in page] == ["snap-3"] and token == ""
    g = GroupSnapshot("group-1", "g", ("snap-10", "snap-11"), 7.0)
    s.put_group_snapshot(g, [snap(10, group="group-1"), snap(11, group="group-1")])
    assert s.get_group_snapshot("group-1") == g and s.get_group_snapshot_by_name("g") == g
    assert s.get_snapshot("snap-11") is not None and s.get_snapshot("snap-11").group_snapshot_id == "group-1"  # type: ignore[union-attr]
    assert s.delete_group_snapshot("group-1") and not s.delete_group_snapshot("group-1")


def test_deletes_report_whether_something_was_there(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    s.put_volume(vol(1))
    s.put_stage(StageRecord("vol-0001", "/s", ""))
    s.put_publish(PublishRecord("vol-0001", "/t", False, "/s"))
    assert s.delete_publish("vol-0001", "/t") and not s.delete_publish("vol-0001", "/t")
    assert s.delete_stage("vol-0001") and not s.delete_stage("vol-0001")
    assert s.delete_volume("vol-0001") and not s.delete_volume("vol-0001")
    assert s.list_stages() == [] and s.list_publishes() == []


def test_threads_write_concurrently(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")

    def work(t: int) -> None:
        for i in range(25):
            s.put_volume(vol(t * 100 + i))
            s.put_stage(StageRecord(f"vol-{t * 100 + i:04d}", "/s", ""))

    assert run_threads(work, 6) == []
    assert s.count_volumes() == 150 and len(s.list_stages()) == 150
