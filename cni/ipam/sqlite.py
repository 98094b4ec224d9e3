"""The SQLite lease store: one database file per network in the IPAM ``dataDir``.

Shared by the warm agent and any number of concurrent entry-point processes. Safety comes from SQLite alone:

- WAL journal, ``synchronous=NORMAL``: a committed lease survives kill -9 of any process at any moment;
- every allocation, release and GC is one ``BEGIN IMMEDIATE`` transaction (the write lock is taken before the
  allocator reads what is free), so two processes never lease the same address;
- ``ip`` is the primary key: even a logic error cannot store a duplicate;
- a busy timeout (30 s) queues writers instead of failing them.

Leases remember the kernel boot they were made in (``/proc/sys/kernel/random/boot_id``). Every pod netns dies with
the kernel, so a lease from an earlier boot can only be stale: opening the store in a new boot releases them. This is
the leak host-local has after a reboot, closed without waiting for the runtime's GC. (Leases without a boot id, from
a store written before this existed, are left to GC.)

Within a process one connection is shared under a lock (the agent runs commands in a thread pool).
File names: ``<dataDir>/<network name>.db`` (network names are restricted to ``[A-Za-z0-9_.-]`` by the config parser).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator

from cni.errors import IPAM_STORE, CniError
from cni.ipam.store import Lease

BUSY_TIMEOUT = 30.0
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def current_boot_id() -> str:
    try:
        with open(BOOT_ID_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    ip TEXT PRIMARY KEY,
    container_id TEXT NOT NULL,
    ifname TEXT NOT NULL,
    range_key TEXT NOT NULL,
    boot_id TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS leases_owner ON leases (container_id, ifname);
CREATE TABLE IF NOT EXISTS last_reserved (
    range_key TEXT PRIMARY KEY,
    ip TEXT NOT NULL
);
"""


def db_path(data_dir: str | os.PathLike[str], network: str) -> str:
    return os.path.join(data_dir, f"{network}.db")


class SqliteTxn:
    def __init__(self, conn: sqlite3.Connection, boot_id: str) -> None:
        self._c = conn
        self._boot_id = boot_id

    def reserve(self, lease: Lease) -> bool:
        cur = self._c.execute(
            "INSERT OR IGNORE INTO leases (ip, container_id, ifname, range_key, boot_id) VALUES (?, ?, ?, ?, ?)",
            (lease.ip, lease.container_id, lease.ifname, lease.range_key, self._boot_id),
        )
        return cur.rowcount == 1

    def leases(self) -> list[Lease]:
        rows = self._c.execute("SELECT ip, container_id, ifname, range_key FROM leases").fetchall()
        return [Lease(*r) for r in rows]

    def leases_of(self, container_id: str, ifname: str) -> list[Lease]:
        rows = self._c.execute(
            "SELECT ip, container_id, ifname, range_key FROM leases WHERE container_id = ? AND ifname = ?",
            (container_id, ifname),
        ).fetchall()
        return [Lease(*r) for r in rows]

    def release_of(self, container_id: str, ifname: str) -> list[Lease]:
        gone = self.leases_of(container_id, ifname)
        self._c.execute("DELETE FROM leases WHERE container_id = ? AND ifname = ?", (container_id, ifname))
        return gone

    def release(self, ip: str) -> None:
        self._c.execute("DELETE FROM leases WHERE ip = ?", (ip,))

    def last_reserved(self, range_key: str) -> str | None:
        row = self._c.execute("SELECT ip FROM last_reserved WHERE range_key = ?", (range_key,)).fetchone()
        return None if row is None else str(row[0])

    def set_last_reserved(self, range_key: str, ip: str) -> None:
        self._c.execute(
            "INSERT INTO last_reserved (range_key, ip) VALUES (?, ?) ON CONFLICT (range_key) DO UPDATE SET ip = ?",
            (range_key, ip, ip),
        )


class SqliteStore:
    """Leases of one network in ``<data_dir>/<network>.db``."""

    def __init__(self, data_dir: str | os.PathLike[str], network: str, boot_id: str | None = None) -> None:
        self.boot_id = current_boot_id() if boot_id is None else boot_id
        self.released_stale = 0  # leases of earlier boots released when this store was opened
        self.path = db_path(data_dir, network)
        self._lock = threading.Lock()
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.close(fd)
            self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            self._init()
        except (OSError, sqlite3.Error) as e:
            raise CniError(IPAM_STORE, details=f"cannot open the IPAM store {self.path}: {e}") from None

    def _init(self) -> None:
        """WAL mode and the schema. Switching to WAL takes an exclusive lock for which SQLite does not wait, so many
        processes creating the file at once retry briefly here."""
        deadline = time.monotonic() + BUSY_TIMEOUT
        while True:
            try:
                if self._conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
                with self._write():
                    for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                        self._conn.execute(stmt)
                    columns = {row[1] for row in self._conn.execute("PRAGMA table_info(leases)")}
                    if "boot_id" not in columns:  # a store from before boot ids
                        self._conn.execute("ALTER TABLE leases ADD COLUMN boot_id TEXT NOT NULL DEFAULT ''")
                    if self.boot_id:
                        cur = self._conn.execute(
                            "DELETE FROM leases WHERE boot_id != '' AND boot_id != ?", (self.boot_id,)
                        )
                        self.released_stale = cur.rowcount
                return
            except sqlite3.OperationalError as e:
                if ("locked" not in str(e) and "busy" not in str(e)) or time.monotonic() > deadline:
                    raise
                import random  # only under contention: not on every CNI exec's start-up path

                time.sleep(random.uniform(0.005, 0.03))

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[SqliteTxn]:
        try:
            with self._write() as conn:
                yield SqliteTxn(conn, self.boot_id)
        except sqlite3.Error as e:
            raise CniError(IPAM_STORE, details=f"IPAM store {self.path}: {e}") from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()


_cache: dict[tuple[str, str], SqliteStore] = {}
_cache_lock = threading.Lock()


def open_store(data_dir: str, network: str) -> SqliteStore:
    """One store per (dataDir, network) per process; the agent keeps them open between requests."""
    key = (str(data_dir), network)
    with _cache_lock:
        store = _cache.get(key)
        if store is None or not os.path.exists(store.path):  # first use, or the file was removed under us
            if store is not None:
                store.close()
            store = _cache[key] = SqliteStore(data_dir, network)
        return store


def close_all() -> None:
    with _cache_lock:
        for store in _cache.values():
            store.close()
        _cache.clear()
