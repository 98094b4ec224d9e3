"""Prepared claims, in SQLite (``<state_dir>/claims.db``) through :mod:`nodeplug.sqlitedb`.

A claim is written in two steps so that a kill -9 at any moment leaves something NodeUnprepareResources (or the
next NodePrepareResources) can finish: :meth:`ClaimStore.begin` records the claim as ``preparing`` with the CDI spec
file it is about to write and the devices it takes, *before* anything is made on the host; :meth:`ClaimStore.finish`
marks it ``prepared`` once the spec is written and the devices reset. Unprepare removes exactly the recorded spec
file and then the row. A ``preparing`` row found later is a preparation that died half-way: prepare starts it again,
unprepare removes it like any other.

Schema 1 (``PRAGMA user_version``): ``claims`` (uid, namespace, name, state, spec file, time) and ``devices`` (one
row per prepared device: pool, device, the inventory entry it is, requests, CDI IDs, admin access).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from nodeplug.sqlitedb import Database

MIGRATIONS = (
    """
    CREATE TABLE claims (
        uid TEXT PRIMARY KEY,
        namespace TEXT NOT NULL,
        name TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('preparing', 'prepared')),
        spec_file TEXT NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE devices (
        claim_uid TEXT NOT NULL,
        pool TEXT NOT NULL,
        device TEXT NOT NULL,
        resource TEXT NOT NULL,
        device_id TEXT NOT NULL,
        requests TEXT NOT NULL,
        cdi_ids TEXT NOT NULL,
        admin_access INTEGER NOT NULL,
        PRIMARY KEY (claim_uid, pool, device)
    );
    CREATE INDEX devices_by_inventory ON devices (resource, device_id);
    """,
)


@dataclass(frozen=True)
class PreparedDevice:
    pool: str
    device: str
    resource: str  # the configured resource name (fuse)
    device_id: str  # what it holds in that resource: a replica (fuse::3) or a physical device (fuse, 0000:3b:00.0)
    requests: tuple[str, ...]
    cdi_ids: tuple[str, ...]
    admin_access: bool = False


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    state: str
    spec_file: str
    devices: tuple[PreparedDevice, ...]


class ClaimStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = Database(path, MIGRATIONS)

    def close(self) -> None:
        self.db.close()

    def begin(self, claim: PreparedClaim) -> None:
        """Record ``claim`` as ``preparing`` (replacing an earlier attempt of the same UID)."""
        with self.db.transaction() as c:
            c.execute("DELETE FROM devices WHERE claim_uid = ?", (claim.uid,))
            c.execute(
                "INSERT OR REPLACE INTO claims (uid, namespace, name, state, spec_file, updated) "
                "VALUES (?, ?, ?, 'preparing', ?, ?)",
                (claim.uid, claim.namespace, claim.name, claim.spec_file, time.time()),
            )
            c.executemany(
                "INSERT INTO devices (claim_uid, pool, device, resource, device_id, requests, cdi_ids, admin_access) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        claim.uid,
                        d.pool,
                        d.device,
                        d.resource,
                        d.device_id,
                        json.dumps(list(d.requests)),
                        json.dumps(list(d.cdi_ids)),
                        int(d.admin_access),
                    )
                    for d in claim.devices
                ],
            )

    def finish(self, uid: str) -> None:
        with self.db.transaction() as c:
            c.execute("UPDATE claims SET state = 'prepared', updated = ? WHERE uid = ?", (time.time(), uid))

    def remove(self, uid: str) -> None:
        with self.db.transaction() as c:
            c.execute("DELETE FROM devices WHERE claim_uid = ?", (uid,))
            c.execute("DELETE FROM claims WHERE uid = ?", (uid,))

    def get(self, uid: str) -> PreparedClaim | None:
        with self.db.read() as c:
            row = c.execute("SELECT * FROM claims WHERE uid = ?", (uid,)).fetchone()
            if row is None:
                return None
            devs = c.execute("SELECT * FROM devices WHERE claim_uid = ? ORDER BY pool, device", (uid,)).fetchall()
        return _claim(row, devs)

    def all(self) -> list[PreparedClaim]:
        with self.db.read() as c:
            rows = c.execute("SELECT * FROM claims ORDER BY uid").fetchall()
            devs = c.execute("SELECT * FROM devices ORDER BY claim_uid, pool, device").fetchall()
        by_claim: dict[str, list[object]] = {}
        for d in devs:
            by_claim.setdefault(d["claim_uid"], []).append(d)
        return [_claim(r, by_claim.get(r["uid"], [])) for r in rows]


def _claim(row: object, devs: list[object]) -> PreparedClaim:
    r: dict[str, object] = dict(row)  # type: ignore[call-overload]
    return PreparedClaim(
        uid=str(r["uid"]),
        namespace=str(r["namespace"]),
        name=str(r["name"]),
        state=str(r["state"]),
        spec_file=str(r["spec_file"]),
        devices=tuple(_device(dict(d)) for d in devs),  # type: ignore[call-overload]
    )


def _device(d: dict[str, object]) -> PreparedDevice:
    return PreparedDevice(
        pool=str(d["pool"]),
        device=str(d["device"]),
        resource=str(d["resource"]),
        device_id=str(d["device_id"]),
        requests=tuple(json.loads(str(d["requests"]))),
        cdi_ids=tuple(json.loads(str(d["cdi_ids"]))),
        admin_access=bool(d["admin_access"]),
    )
