"""The one SQLite layer of the agent's state databases: CSI volumes, IPAM leases, prepared DRA claims.

A database is opened with the list of its schema migrations and used through two context managers::

    MIGRATIONS = (
        "CREATE TABLE leases (ip TEXT PRIMARY KEY, owner TEXT NOT NULL)",         # schema 1
        "ALTER TABLE leases ADD COLUMN note TEXT NOT NULL DEFAULT ''",            # schema 2
    )
    db = Database("/var/lib/nodeplug/x.db", MIGRATIONS)
    with db.transaction() as c:          # BEGIN IMMEDIATE ... COMMIT (ROLLBACK when the block raises)
        c.execute("INSERT INTO leases (ip, owner) VALUES (?, ?)", (ip, owner))
    with db.read() as c:                 # several SELECTs seeing one state of the database
        ...
    db.execute("SELECT ...", args)       # one statement on its own (reads)
    db.close()

What it guarantees, in one place:

- **Durability**: WAL journal; ``synchronous`` FULL by default (a committed change is on disk when the call
  returns) or NORMAL where the caller chooses it (survives kill -9 of any process, may lose the newest commits on
  power loss). Either way a kill -9 at any moment leaves the old or the new state, never half of one.
- **Writers queue, never fail**: a write transaction starts with ``BEGIN IMMEDIATE``, taking the write lock before it
  reads, so a read-then-write (an allocator's "what is free?") is atomic across threads and processes. Writers of one
  process queue on a lock of the process; writers of other processes wait in SQLite's busy handler (``busy_timeout``,
  30 s by default). Readers never wait for writers (WAL).
- **Threads**: one connection per thread, made on first use, so any thread (``asyncio.to_thread`` workers, a
  thread pool) may call any method. Nesting a transaction inside another of the same thread raises at once.
- **Schema versions**: the schema version is ``PRAGMA user_version``, the number of migrations applied. Opening
  applies the missing ones in order, all in one write transaction with the new version (a crash mid-way leaves the
  old version, and the next open starts again); many processes opening at once migrate once. A database whose
  version is *newer* than the migrations given (written by a later release) is refused with :class:`SchemaTooNew`
  and left untouched. Migrations are append-only: a released one is never edited, a change is a new one.
- **Cheap to import and open**: the standard library only, nothing beyond what ``sqlite3`` itself loads; an open
  whose schema is current runs no write transaction. The CNI entry point opens the IPAM store on every exec.

A migration is SQL text (statements separated by ``;``, run one by one inside the transaction) or a function of the
connection, for steps SQL cannot say conditionally (e.g. adopting tables written before versions existed).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the CNI entry point imports this module
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from typing import Any, Literal

    Migration = str | Callable[[sqlite3.Connection], None]
    Synchronous = Literal["FULL", "NORMAL"]

BUSY_TIMEOUT = 30.0


class SchemaTooNew(sqlite3.DatabaseError):
    """The database was written by a newer release: its schema version is past the migrations this code knows."""

    def __init__(self, path: str, found: int, known: int) -> None:
        super().__init__(
            f"{path}: schema version {found} is newer than this release understands ({known}); it was written by a "
            "newer nodeplug: run that release again, or restore the file from before the upgrade"
        )
        self.path, self.found, self.known = path, found, known


def statements(sql: str) -> list[str]:
    """Split SQL text into complete statements (a ``;`` inside a string literal or a trigger body does not end one)."""
    out: list[str] = []
    buf = ""
    for piece in sql.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            stmt = buf.strip(" \t\r\n;")
            if stmt:
                out.append(stmt)
            buf = ""
    return out


def _contended(e: sqlite3.OperationalError) -> bool:
    text = str(e)
    return "locked" in text or "busy" in text


def _backoff() -> None:
    import random  # only under contention: not on every CNI exec's start-up path

    time.sleep(random.uniform(0.005, 0.03))


class Database:
    """A SQLite database file with its schema kept current (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        migrations: Sequence[Migration],
        *,
        synchronous: Synchronous = "FULL",
        busy_timeout: float = BUSY_TIMEOUT,
        file_mode: int = 0o600,
    ) -> None:
        self.path = os.fspath(path)
        self.migrations = tuple(migrations)
        self.synchronous = synchronous
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self._write_lock = threading.Lock()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode)  # never wider than file_mode
        os.close(fd)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    @property
    def version(self) -> int:
        """The schema version this code writes: the number of migrations."""
        return len(self.migrations)

    # ------------------------------------------------------------ connections

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (autocommit mode: statements outside a transaction commit on their own)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False)
            try:
                conn.row_factory = sqlite3.Row
                conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            except BaseException:
                conn.close()
                raise
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def _open(self) -> None:
        """WAL on, then the schema brought to :attr:`version`. Switching to WAL takes an exclusive lock for which
        SQLite does not wait, so many processes creating the file at once retry briefly here."""
        deadline = time.monotonic() + self.busy_timeout
        while True:
            try:
                conn = self.connection()
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    conn.execute("PRAGMA journal_mode = WAL")
                if self._user_version(conn) != self.version:
                    self._migrate()
                return
            except sqlite3.OperationalError as e:
                if not _contended(e) or time.monotonic() > deadline:
                    raise
                _backoff()

    @staticmethod
    def _user_version(conn: sqlite3.Connection) -> int:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        with self.transaction() as conn:
            found = self._user_version(conn)  # again, under the write lock: another process may have migrated
            if found > self.version:
                raise SchemaTooNew(self.path, found, self.version)
            for step in self.migrations[found:]:
                if isinstance(step, str):
                    for stmt in statements(step):
                        conn.execute(stmt)
                else:
                    step(conn)
            if found != self.version:
                conn.execute(f"PRAGMA user_version = {int(self.version)}")

    def close(self) -> None:
        """Close every thread's connection, after the write transaction in flight (if any) ends; a later call opens
        new ones. Not from inside a transaction."""
        with self._write_lock, self._all_lock:
            conns, self._all = self._all, []
            self._local = threading.local()
            for c in conns:
                c.close()

    # ------------------------------------------------------------ transactions

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: ``BEGIN IMMEDIATE`` (the write lock first), COMMIT at the end of the block, ROLLBACK
        when it raises."""
        conn = self.connection()
        if conn.in_transaction:
            raise RuntimeError(f"{self.path}: a transaction is already open in this thread")
        with self._write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """Reads that see one state of the database (a deferred transaction: no lock that blocks writers)."""
        conn = self.connection()
        if conn.in_transaction:
            raise RuntimeError(f"{self.path}: a transaction is already open in this thread")
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        """One statement on this thread's connection, on its own (for reads; writes belong in :meth:`transaction`)."""
        return self.connection().execute(sql, args)
