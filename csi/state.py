"""Crash-safe state of the CSI driver in SQLite: volumes, snapshots, group snapshots, stage and publish records.

Design:

- Connections, WAL, busy timeouts, transactions and schema migrations are :mod:`nodeplug.sqlitedb`'s; this module
  holds the CSI schema (:data:`MIGRATIONS`) and the queries.
- ``synchronous=FULL``: a change is on disk when its call returns. A kill -9 loses nothing even with NORMAL, but the
  store records host objects (backing files, subvolumes) that the driver just made, and losing the newest records on
  power loss would orphan them; volume operations are rare and slow next to one fsync, so FULL.
- One transaction per change; writers never hold a transaction across a command, so a crash leaves either the old or
  the new row.
- Safe for threads: one connection per thread, so the servicers can call it from ``asyncio.to_thread`` workers.
- Pagination tokens are the decimal offset of the next entry in creation order, as in the reference hostpath
  driver, whose behaviour the community sanity suite checks (a token equals the entries already returned, and a
  token past the end is ABORTED). A token that is not a number, or is past the end, raises :class:`Aborted`, the
  CSI spec's answer to an invalid ``starting_token``. An entry deleted between pages shifts later entries by one,
  so one may be skipped: listing is a best-effort view, as the spec allows.

Schema versions: 1 is the schema of release 0.1.0 (which wrote ``user_version`` 1). Append a migration for every
change; ``tests/unit/test_state_upgrade.py`` opens databases written by earlier releases.

Constructed as ``StateStore(root(config.data_dir) / "state.db")``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from csi.errors import Aborted
from csi.model import AccessType, Backend, GroupSnapshot, PublishRecord, Snapshot, StageRecord, Volume
from nodeplug.sqlitedb import Database

T = TypeVar("T")

MIGRATIONS: tuple[str, ...] = (
    # 1: release 0.1.0
    """
CREATE TABLE IF NOT EXISTS volumes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    volume_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL UNIQUE,
    capacity_bytes INTEGER NOT NULL,
    backend TEXT NOT NULL,
    access_type TEXT NOT NULL,
    fs_type TEXT NOT NULL,
    path TEXT NOT NULL,
    source_snapshot_id TEXT NOT NULL DEFAULT '',
    source_volume_id TEXT NOT NULL DEFAULT '',
    parameters TEXT NOT NULL DEFAULT '{}',
    ephemeral INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    snapshot_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL UNIQUE,
    source_volume_id TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    path TEXT NOT NULL,
    created_at REAL NOT NULL,
    ready_to_use INTEGER NOT NULL DEFAULT 1,
    group_snapshot_id TEXT NOT NULL DEFAULT '',
    backend TEXT NOT NULL DEFAULT '',
    access_type TEXT NOT NULL DEFAULT '',
    fs_type TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS snapshots_source ON snapshots(source_volume_id);
CREATE TABLE IF NOT EXISTS group_snapshots (
    group_snapshot_id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    snapshot_ids TEXT NOT NULL,
    created_at REAL NOT NULL,
    ready_to_use INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS stages (
    volume_id TEXT PRIMARY KEY,
    staging_path TEXT NOT NULL,
    device TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS publishes (
    volume_id TEXT NOT NULL,
    target_path TEXT NOT NULL,
    readonly INTEGER NOT NULL,
    staging_path TEXT NOT NULL,
    PRIMARY KEY (volume_id, target_path)
);
""",
    # 2: whether the driver created a publish target (and may remove it); 0.1.0's records do not say, so never
    "ALTER TABLE publishes ADD COLUMN created INTEGER NOT NULL DEFAULT 0",
)
SCHEMA_VERSION = len(MIGRATIONS)

_VOL_COLS = (
    "volume_id, name, capacity_bytes, backend, access_type, fs_type, path, source_snapshot_id, source_volume_id,"
    " parameters, ephemeral, created_at"
)
_SNAP_COLS = (
    "snapshot_id, name, source_volume_id, size_bytes, path, created_at, ready_to_use, group_snapshot_id,"
    " backend, access_type, fs_type"
)


def _volume(row: sqlite3.Row) -> Volume:
    return Volume(
        volume_id=row["volume_id"],
        name=row["name"],
        capacity_bytes=row["capacity_bytes"],
        backend=cast(Backend, row["backend"]),
        access_type=cast(AccessType, row["access_type"]),
        fs_type=row["fs_type"],
        path=row["path"],
        source_snapshot_id=row["source_snapshot_id"],
        source_volume_id=row["source_volume_id"],
        parameters=json.loads(row["parameters"]),
        ephemeral=bool(row["ephemeral"]),
        created_at=row["created_at"],
    )


def _snapshot(row: sqlite3.Row) -> Snapshot:
    return Snapshot(
        snapshot_id=row["snapshot_id"],
        name=row["name"],
        source_volume_id=row["source_volume_id"],
        size_bytes=row["size_bytes"],
        path=row["path"],
        created_at=row["created_at"],
        ready_to_use=bool(row["ready_to_use"]),
        group_snapshot_id=row["group_snapshot_id"],
        backend=row["backend"],
        access_type=row["access_type"],
        fs_type=row["fs_type"],
    )


def _insert_snapshot(c: sqlite3.Connection, s: Snapshot) -> None:
    c.execute(
        f"INSERT INTO snapshots ({_SNAP_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(snapshot_id) DO UPDATE"
        " SET name=excluded.name, source_volume_id=excluded.source_volume_id, size_bytes=excluded.size_bytes,"
        " path=excluded.path, created_at=excluded.created_at, ready_to_use=excluded.ready_to_use,"
        " group_snapshot_id=excluded.group_snapshot_id, backend=excluded.backend,"
        " access_type=excluded.access_type, fs_type=excluded.fs_type",
        (
            s.snapshot_id,
            s.name,
            s.source_volume_id,
            s.size_bytes,
            s.path,
            s.created_at,
            int(s.ready_to_use),
            s.group_snapshot_id,
            s.backend,
            s.access_type,
            s.fs_type,
        ),
    )


def _group(row: sqlite3.Row) -> GroupSnapshot:
    return GroupSnapshot(
        group_snapshot_id=row["group_snapshot_id"],
        name=row["name"],
        snapshot_ids=tuple(json.loads(row["snapshot_ids"])),
        created_at=row["created_at"],
        ready_to_use=bool(row["ready_to_use"]),
    )


def _offset(token: str) -> int:
    if not token:
        return 0
    if not token.isdigit() or len(token) > 18:
        raise Aborted(f"starting_token: not a token this driver issued, got {token[:64]!r}")
    return int(token)


class StateStore:
    """SQLite-backed store; every public method is one transaction and safe to call from any thread."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.db = Database(self.path, MIGRATIONS, synchronous="FULL")

    def _one(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self.db.execute(sql, args).fetchone()
        return row

    def _find(self, table: str, cols: str, column: str, value: str, load: Callable[[sqlite3.Row], T]) -> T | None:
        """The row of ``table`` whose ``column`` (a unique key) is ``value``, loaded; None when there is none."""
        row = self._one(f"SELECT {cols} FROM {table} WHERE {column} = ?", (value,))
        return load(row) if row else None

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ volumes

    def get_volume(self, volume_id: str) -> Volume | None:
        return self._find("volumes", _VOL_COLS, "volume_id", volume_id, _volume)

    def get_volume_by_name(self, name: str) -> Volume | None:
        return self._find("volumes", _VOL_COLS, "name", name, _volume)

    def put_volume(self, v: Volume) -> None:
        """Insert or replace (by volume_id) a volume; its list position is kept on replace."""
        args = (
            v.volume_id,
            v.name,
            v.capacity_bytes,
            v.backend,
            v.access_type,
            v.fs_type,
            v.path,
            v.source_snapshot_id,
            v.source_volume_id,
            json.dumps(dict(v.parameters), sort_keys=True),
            int(v.ephemeral),
            v.created_at,
        )
        with self.db.transaction() as c:
            c.execute(
                f"INSERT INTO volumes ({_VOL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(volume_id) DO UPDATE"
                " SET name=excluded.name, capacity_bytes=excluded.capacity_bytes, backend=excluded.backend,"
                " access_type=excluded.access_type, fs_type=excluded.fs_type, path=excluded.path,"
                " source_snapshot_id=excluded.source_snapshot_id, source_volume_id=excluded.source_volume_id,"
                " parameters=excluded.parameters, ephemeral=excluded.ephemeral, created_at=excluded.created_at",
                args,
            )

    def delete_volume(self, volume_id: str) -> bool:
        with self.db.transaction() as c:
            return c.execute("DELETE FROM volumes WHERE volume_id = ?", (volume_id,)).rowcount > 0

    def list_volumes(self, max_entries: int = 0, starting_token: str = "") -> tuple[list[Volume], str]:
        """A page of volumes in creation order and the token for the next page ("" when this is the last)."""
        rows, token = self._page("volumes", _VOL_COLS, "", (), max_entries, starting_token)
        return [_volume(r) for r in rows], token

    def _page(
        self, table: str, cols: str, where: str, args: tuple[Any, ...], max_entries: int, starting_token: str
    ) -> tuple[list[sqlite3.Row], str]:
        """One page of ``table`` in creation order, read in one snapshot of the database."""
        offset = _offset(starting_token)
        limit = max_entries if max_entries > 0 else -1
        clause = f" WHERE {where}" if where else ""
        with self.db.read() as conn:
            total = int(conn.execute(f"SELECT COUNT(*) FROM {table}{clause}", args).fetchone()[0])
            if offset > total:
                raise Aborted(f"starting_token: {starting_token} is past the end of the list ({total} entries)")
            rows = conn.execute(
                f"SELECT {cols} FROM {table}{clause} ORDER BY seq LIMIT ? OFFSET ?", (*args, limit, offset)
            ).fetchall()
        end = offset + len(rows)
        return rows, (str(end) if max_entries > 0 and end < total else "")

    def count_volumes(self) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM volumes", ())
        return int(row["n"]) if row else 0

    # ------------------------------------------------------------ snapshots

    def get_snapshot(self, snapshot_id: str) -> Snapshot | None:
        return self._find("snapshots", _SNAP_COLS, "snapshot_id", snapshot_id, _snapshot)

    def get_snapshot_by_name(self, name: str) -> Snapshot | None:
        return self._find("snapshots", _SNAP_COLS, "name", name, _snapshot)

    def put_snapshot(self, s: Snapshot) -> None:
        with self.db.transaction() as c:
            _insert_snapshot(c, s)

    def delete_snapshot(self, snapshot_id: str) -> bool:
        with self.db.transaction() as c:
            return c.execute("DELETE FROM snapshots WHERE snapshot_id = ?", (snapshot_id,)).rowcount > 0

    def list_snapshots(
        self, max_entries: int = 0, starting_token: str = "", source_volume_id: str = ""
    ) -> tuple[list[Snapshot], str]:
        """A page of snapshots (optionally only those of one source volume) and the next page's token."""
        where, args = ("source_volume_id = ?", (source_volume_id,)) if source_volume_id else ("", ())
        rows, token = self._page("snapshots", _SNAP_COLS, where, args, max_entries, starting_token)
        return [_snapshot(r) for r in rows], token

    # ------------------------------------------------------------ group snapshots

    def get_group_snapshot(self, group_snapshot_id: str) -> GroupSnapshot | None:
        return self._find("group_snapshots", "*", "group_snapshot_id", group_snapshot_id, _group)

    def get_group_snapshot_by_name(self, name: str) -> GroupSnapshot | None:
        return self._find("group_snapshots", "*", "name", name, _group)

    def put_group_snapshot(self, g: GroupSnapshot, members: list[Snapshot]) -> None:
        """Record a group snapshot and all its member snapshots in one transaction."""
        with self.db.transaction() as c:
            for s in members:
                _insert_snapshot(c, s)
            c.execute(
                "INSERT OR REPLACE INTO group_snapshots (group_snapshot_id, name, snapshot_ids, created_at,"
                " ready_to_use) VALUES (?,?,?,?,?)",
                (g.group_snapshot_id, g.name, json.dumps(list(g.snapshot_ids)), g.created_at, int(g.ready_to_use)),
            )

    def delete_group_snapshot(self, group_snapshot_id: str) -> bool:
        with self.db.transaction() as c:
            return (
                c.execute("DELETE FROM group_snapshots WHERE group_snapshot_id = ?", (group_snapshot_id,)).rowcount > 0
            )

    # ------------------------------------------------------------ stage records

    def put_stage(self, r: StageRecord) -> None:
        with self.db.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO stages (volume_id, staging_path, device) VALUES (?,?,?)",
                (r.volume_id, r.staging_path, r.device),
            )

    def get_stage(self, volume_id: str) -> StageRecord | None:
        row = self._one("SELECT volume_id, staging_path, device FROM stages WHERE volume_id = ?", (volume_id,))
        return StageRecord(row["volume_id"], row["staging_path"], row["device"]) if row else None

    def delete_stage(self, volume_id: str) -> bool:
        with self.db.transaction() as c:
            return c.execute("DELETE FROM stages WHERE volume_id = ?", (volume_id,)).rowcount > 0

    def list_stages(self) -> list[StageRecord]:
        rows = self.db.execute("SELECT volume_id, staging_path, device FROM stages ORDER BY volume_id")
        return [StageRecord(r["volume_id"], r["staging_path"], r["device"]) for r in rows]

    # ------------------------------------------------------------ publish records

    def put_publish(self, r: PublishRecord) -> None:
        with self.db.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO publishes (volume_id, target_path, readonly, staging_path, created)"
                " VALUES (?,?,?,?,?)",
                (r.volume_id, r.target_path, int(r.readonly), r.staging_path, int(r.created)),
            )

    def get_publish(self, volume_id: str, target_path: str) -> PublishRecord | None:
        row = self._one(
            "SELECT * FROM publishes WHERE volume_id = ? AND target_path = ?",
            (volume_id, target_path),
        )
        return _publish(row) if row else None

    def list_publishes(self, volume_id: str = "") -> list[PublishRecord]:
        """Publish records of one volume, or of all volumes when ``volume_id`` is empty."""
        if volume_id:
            rows = self.db.execute("SELECT * FROM publishes WHERE volume_id = ? ORDER BY target_path", (volume_id,))
        else:
            rows = self.db.execute("SELECT * FROM publishes ORDER BY volume_id, target_path")
        return [_publish(r) for r in rows]

    def delete_publish(self, volume_id: str, target_path: str) -> bool:
        with self.db.transaction() as c:
            n = c.execute(
                "DELETE FROM publishes WHERE volume_id = ? AND target_path = ?", (volume_id, target_path)
            ).rowcount
            return n > 0


def _publish(row: sqlite3.Row) -> PublishRecord:
    return PublishRecord(
        volume_id=row["volume_id"],
        target_path=row["target_path"],
        readonly=bool(row["readonly"]),
        staging_path=row["staging_path"],
        created=bool(row["created"]),
    )
