"""The SQLite lease store: one database file per network in the IPAM ``dataDir``.

Shared by the warm agent and any number of concurrent entry-point processes. Safety comes from SQLite alone, through
the agent's one SQLite layer (:mod:`nodeplug.sqlitedb`: connections, WAL, busy timeout, transactions, migrations):

- WAL journal, ``synchronous=NORMAL``: a committed lease survives kill -9 of any process at any moment;
- every allocation, release and GC is one ``BEGIN IMMEDIATE`` transaction (the write lock is taken before the
  allocator reads what is free), so two processes never lease the same address;
- ``ip`` is the primary key: even a logic error cannot store a duplicate;
- a busy timeout (30 s) queues writers instead of failing them;
- the schema version is kept in the file (:data:`MIGRATIONS`); a store written by a newer release is refused.

Leases remember the kernel boot they were made in (``/proc/sys/kernel/random/boot_id``). Every pod netns dies with
the kernel, so a lease from an earlier boot can only be stale: opening the store in a new boot releases them. This is
the leak host-local has after a reboot, closed without waiting for the runtime's GC. (Leases without a boot id, from
a store written before this existed, are left to GC.)

Within a process each thread has its own connection and writers queue on a lock (the agent runs commands in a
thread pool).
File names: ``<dataDir>/<network name>.db`` (network names are restricted to ``[A-Za-z0-9_.-]`` by the config parser).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading

from cni.errors import IPAM_STORE, CniError
from cni.ipam.store import Lease
from nodeplug.sqlitedb import Database

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the entry point's start-up path)
if TYPE_CHECKING:
    from collections.abc import Iterator

BUSY_TIMEOUT = 30.0
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def current_boot_id() -> str:
    try:
        with open(BOOT_ID_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


def _adopt_0_1_0(c: sqlite3.Connection) -> None:
    """Schema 1: the leases store as release 0.1.0 wrote it (no version in the file), created or adopted as found.
    Stores older still lack the boot id column, added here."""
    c.execute(
        "CREATE TABLE IF NOT EXISTS leases (ip TEXT PRIMARY KEY, container_id TEXT NOT NULL, ifname TEXT NOT NULL,"
        " range_key TEXT NOT NULL, boot_id TEXT NOT NULL DEFAULT '')"
    )
    c.execute("CREATE INDEX IF NOT EXISTS leases_owner ON leases (container_id, ifname)")
    c.execute("CREATE TABLE IF NOT EXISTS last_reserved (range_key TEXT PRIMARY KEY, ip TEXT NOT NULL)")
    if "boot_id" not in {row[1] for row in c.execute("PRAGMA table_info(leases)")}:
        c.execute("ALTER TABLE leases ADD COLUMN boot_id TEXT NOT NULL DEFAULT ''")


MIGRATIONS = (_adopt_0_1_0,)


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
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            self.db = Database(self.path, MIGRATIONS, synchronous="NORMAL", busy_timeout=BUSY_TIMEOUT)
            if self.boot_id:
                with self.db.transaction() as c:
                    cur = c.execute("DELETE FROM leases WHERE boot_id != '' AND boot_id != ?", (self.boot_id,))
                    self.released_stale = cur.rowcount
        except (OSError, sqlite3.Error) as e:
            raise CniError(IPAM_STORE, details=f"cannot open the IPAM store {self.path}: {e}") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[SqliteTxn]:
        try:
            with self.db.transaction() as conn:
                yield SqliteTxn(conn, self.boot_id)
        except sqlite3.Error as e:
            raise CniError(IPAM_STORE, details=f"IPAM store {self.path}: {e}") from None

    def close(self) -> None:
        self.db.close()


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
