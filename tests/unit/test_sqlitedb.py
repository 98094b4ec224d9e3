"""The one SQLite layer: migrations forward on open (once, atomically, across processes), a newer schema refused
untouched, write transactions that commit or roll back whole, per-thread connections."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nodeplug.sqlitedb import Database, SchemaTooNew, statements

from support.processes import kill_9_when, run_threads
from support.sqlitefiles import user_version

V1 = "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL); CREATE INDEX items_name ON items(name)"
V2 = "ALTER TABLE items ADD COLUMN note TEXT NOT NULL DEFAULT 'none'"


def test_a_new_file_gets_every_migration_wal_and_a_private_mode(tmp_path: Path) -> None:
    db = Database(tmp_path / "a.db", [V1, V2])
    with db.transaction() as c:
        c.execute("INSERT INTO items (name) VALUES ('x')")
    assert [tuple(r) for r in db.execute("SELECT name, note FROM items")] == [("x", "none")]
    assert db.version == 2 and user_version(tmp_path / "a.db") == 2
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL unless asked otherwise
    assert (tmp_path / "a.db").stat().st_mode & 0o777 == 0o600
    db.close()


def test_an_older_file_is_migrated_forward_keeping_its_rows(tmp_path: Path) -> None:
    old = Database(tmp_path / "a.db", [V1])
    with old.transaction() as c:
        c.executemany("INSERT INTO items (name) VALUES (?)", [("a",), ("b",)])
    old.close()
    new = Database(tmp_path / "a.db", [V1, V2])
    assert [tuple(r) for r in new.execute("SELECT name, note FROM items ORDER BY id")] == [("a", "none"), ("b", "none")]
    assert user_version(tmp_path / "a.db") == 2
    new.close()


def test_a_current_file_is_opened_without_a_write(tmp_path: Path) -> None:
    Database(tmp_path / "a.db", [V1]).close()
    blocker = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        db = Database(tmp_path / "a.db", [V1], busy_timeout=0.2)  # does not wait for it: nothing to write
        assert db.execute("SELECT count(*) FROM items").fetchone()[0] == 0
        db.close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_a_newer_file_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    Database(tmp_path / "a.db", [V1, V2]).close()
    before = (tmp_path / "a.db").read_bytes()
    with pytest.raises(SchemaTooNew, match=r"schema version 2 is newer than this release understands \(1\)") as e:
        Database(tmp_path / "a.db", [V1])
    assert str(tmp_path / "a.db") in str(e.value) and isinstance(e.value, sqlite3.DatabaseError)
    assert (tmp_path / "a.db").read_bytes() == before and user_version(tmp_path / "a.db") == 2


def test_a_failing_migration_changes_nothing(tmp_path: Path) -> None:
    Database(tmp_path / "a.db", [V1]).close()

    def half_done(c: sqlite3.Connection) -> None:
        c.execute("CREATE TABLE other (x)")
        raise RuntimeError("step 3 failed")

    with pytest.raises(RuntimeError, match="step 3"):
        Database(tmp_path / "a.db", [V1, V2, half_done])
    c = sqlite3.connect(tmp_path / "a.db")
    tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    columns = {r[1] for r in c.execute("PRAGMA table_info(items)")}
    c.close()
    assert tables == {"items"} and "note" not in columns and user_version(tmp_path / "a.db") == 1


MIGRATE_SLOWLY = """
import sys, time
from nodeplug.sqlitedb import Database

def slow(c):
    c.execute("INSERT INTO items (name) VALUES ('migrated')")
    print("inside", flush=True)
    time.sleep(60)

Database(sys.argv[1], [{v1!r}, slow])
"""


def test_kill_9_in_the_middle_of_a_migration_leaves_the_old_version(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    Database(path, [V1]).close()
    kill_9_when([sys.executable, "-c", MIGRATE_SLOWLY.format(v1=V1), str(path)], "inside")
    assert user_version(path) == 1

    def once(c: sqlite3.Connection) -> None:
        c.execute("INSERT INTO items (name) VALUES ('migrated')")

    db = Database(path, [V1, once])
    assert [r[0] for r in db.execute("SELECT name FROM items")] == ["migrated"]
    db.close()


OPEN_AT_ONCE = """
import sys, time
from nodeplug.sqlitedb import Database

def count(c):
    c.execute("INSERT INTO items (name) VALUES ('migration ran')")

time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
Database(sys.argv[1], [{v1!r}, count]).close()
"""


def test_many_processes_opening_a_new_file_at_once_migrate_it_once(tmp_path: Path) -> None:
    import time

    path = tmp_path / "a.db"
    start_at = str(time.time() + 1.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_AT_ONCE.format(v1=V1), str(path), start_at], stderr=subprocess.PIPE
        )
        for _ in range(16)
    ]
    errors = [err for p in procs if (err := p.communicate(timeout=60)[1]) or p.returncode != 0]
    assert errors == []
    c = sqlite3.connect(path)
    assert c.execute("SELECT count(*) FROM items").fetchone()[0] == 1
    c.close()
    assert user_version(path) == 2


def test_a_transaction_commits_whole_or_not_at_all(tmp_path: Path) -> None:
    db = Database(tmp_path / "a.db", [V1])
    with pytest.raises(ValueError), db.transaction() as c:
        c.execute("INSERT INTO items (name) VALUES ('a')")
        raise ValueError("abandon")
    with db.transaction() as c:
        c.execute("INSERT INTO items (name) VALUES ('b')")
    assert [r[0] for r in db.execute("SELECT name FROM items")] == ["b"]
    with db.transaction(), pytest.raises(RuntimeError, match="already open"), db.transaction():
        pass  # pragma: no cover
    with db.read(), pytest.raises(RuntimeError, match="already open"), db.transaction():
        pass  # pragma: no cover
    db.close()


def test_a_read_sees_one_state_while_another_thread_writes(tmp_path: Path) -> None:
    db = Database(tmp_path / "a.db", [V1])
    with db.transaction() as c:
        c.execute("INSERT INTO items (name) VALUES ('first')")
    with db.read() as c:
        assert c.execute("SELECT count(*) FROM items").fetchone()[0] == 1

        def write() -> None:
            with db.transaction() as w:  # a writer is not blocked by the reader (WAL)
                w.execute("INSERT INTO items (name) VALUES ('second')")

        t = threading.Thread(target=write)
        t.start()
        t.join(10)
        assert not t.is_alive()
        assert c.execute("SELECT count(*) FROM items").fetchone()[0] == 1  # still the state the read began with
    assert db.execute("SELECT count(*) FROM items").fetchone()[0] == 2
    db.close()


def test_threads_get_their_own_connections_and_writers_queue(tmp_path: Path) -> None:
    db = Database(tmp_path / "a.db", [V1])
    seen: set[int] = set()

    def work(t: int) -> None:
        seen.add(id(db.connection()))
        for i in range(50):
            with db.transaction() as c:  # read-then-write, atomic against the other threads
                n = c.execute("SELECT count(*) FROM items").fetchone()[0]
                c.execute("INSERT INTO items (id, name) VALUES (?, ?)", (n + 1, f"{t}-{i}"))

    assert run_threads(work, 6) == [] and len(seen) == 6
    assert db.execute("SELECT count(*), max(id) FROM items").fetchone()[:] == (300, 300)
    db.close()
    db.close()  # twice is fine
    assert db.execute("SELECT count(*) FROM items").fetchone()[0] == 300  # and a later use opens anew
    db.close()


def test_statements_split_only_where_a_statement_ends() -> None:
    sql = """
        CREATE TABLE t (a TEXT DEFAULT 'x;y');
        CREATE TRIGGER tr AFTER INSERT ON t BEGIN UPDATE t SET a = 'z;'; END;

        INSERT INTO t VALUES ('1;2')
    """
    got = statements(sql)
    assert len(got) == 3
    assert got[0].startswith("CREATE TABLE") and "'x;y'" in got[0]
    assert got[1].startswith("CREATE TRIGGER") and got[1].endswith("END")
    assert got[2] == "INSERT INTO t VALUES ('1;2')"
    assert statements(" ; ;\n") == []
