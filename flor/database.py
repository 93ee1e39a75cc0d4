"""The SQLite file of a run store: opening it (the journal and sync that
suit the file: the store's own, or a replay part's), flor's schema checked,
made and migrated before anything is written, transactions, and refusals of
the file system turned into StoreErrors naming the file.  What flor stores
and reads in it is store.py's.
"""
from __future__ import annotations

import os
import sqlite3
import time

from .errors import StoreError, unusable
from .layout import Layout
from .schema import TABLES

__all__ = ["Database", "SCHEMA_VERSION", "MIGRATIONS", "ddl"]

SCHEMA_VERSION = 2
# What turns a store of version v into version v + 1.
MIGRATIONS = {
    1: ["ALTER TABLE output ADD COLUMN ctx TEXT",  # output rows know their block
        "ALTER TABLE output ADD COLUMN loc TEXT"],  # and the statement that printed them
}



def ddl() -> list[str]:
    """The statements that make flor's tables (flor/schema.py) in a new store."""
    out = []
    for t in TABLES:
        columns = [f"{name} {kind}" for name, kind in t.columns]
        if t.key:
            columns.append(f"PRIMARY KEY ({', '.join(t.key)})")
        out.append(f"CREATE TABLE IF NOT EXISTS {t.name} ({', '.join(columns)})")
        for name, on in t.indexes:
            out.append(f"CREATE INDEX IF NOT EXISTS {name} ON {t.name} ({', '.join(on)})")
    out.append("CREATE TABLE IF NOT EXISTS flor_schema (version INTEGER NOT NULL)")
    return out


# Columns of flor's runs table: a database without flor_schema that has
# them was written by flor before the schema was versioned.
_RUN_COLUMNS = {"run_id", "kind", "parent", "script", "script_name", "argv", "status",
                "main_loop", "main_run", "iterations", "info"}


class Database:
    """The store's SQLite connection, one per process: opened (and, with
    `create`, made) on first use, flor's schema checked before anything is
    written, refusals of the file system turned into StoreErrors.  Its
    files (`layout`, flor/layout.py) are beside it under `root`."""

    def __init__(self, root: str | None = None, db_file: str | None = None,
                 create: bool = True, readonly: bool = False):
        self.layout = Layout(root)
        self.root = self.layout.root
        self.db_file = db_file or os.path.join(self.root, "flor.db")
        # create=False: a store that does not exist is an error, not made;
        # readonly: nothing is written, not even the journal mode
        self.create = create and not readonly
        self.readonly = readonly
        self._conn = None
        self._pid = None

    def exists(self) -> bool:
        """Whether the store's database exists (a store path that is a file is
        a StoreError).  An empty file is no store yet: a process killed while
        it made the store leaves one (SQLite writes the file's header, with
        its journal mode, when it sets the mode, before any table)."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise unusable(self.db_file, NotADirectoryError(20, "Not a directory"))
        return os.path.isfile(self.db_file) and os.path.getsize(self.db_file) > 0

    # -- connection ---------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            if not self.create and not self.exists():
                raise StoreError(f"no flor run store at {self.root} (FLOR_DIR, default "
                                 "./.flor): run the command where the script was recorded, "
                                 "or point FLOR_DIR at the store that holds its runs")
            conn = None
            try:
                if self.readonly:
                    conn = _read_only(self.db_file)
                    _check_schema(conn, self.db_file, create=False, migrate=False)
                else:
                    os.makedirs(os.path.dirname(self.db_file), exist_ok=True)
                    conn = sqlite3.connect(self.db_file, timeout=120, isolation_level=None,
                                           check_same_thread=False)
                    # flor's own tables are checked before anything is written:
                    # another program's database is left as it was.
                    with _Transaction(conn):
                        _check_schema(conn, self.db_file, create=self.create)
                    if self.db_file.endswith("flor.db"):
                        _wal(conn)
                        conn.execute("PRAGMA synchronous=NORMAL")
                    else:
                        _scratch(conn)
            except (OSError, sqlite3.Error) as e:
                if conn is not None:
                    conn.close()
                raise unusable(self.db_file, e) from None
            except BaseException:
                if conn is not None:
                    conn.close()
                raise
            conn.row_factory = sqlite3.Row
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def close(self):
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def transaction(self):
        return _Transaction(self.db, self.db_file)

    def durable(self):
        """Every later commit waits for the disk, and with it what earlier
        ones wrote: a replay part's own database, which does not sync at
        every commit (`_scratch`), before the part says it finished."""
        if not self.db_file.endswith("flor.db"):
            self.db.execute("PRAGMA synchronous=FULL")

    def _many(self, sql, rows):
        if rows:
            with self.transaction():
                self.db.executemany(sql, rows)

    def _insert(self, table, rows):
        """Rows of `table` (flor/schema.py), each its named record."""
        if rows:
            marks = ", ".join("?" for _ in table.names)
            self._many(f"INSERT INTO {table.name} ({', '.join(table.names)}) VALUES ({marks})",
                       rows)


def _read_only(db_file) -> sqlite3.Connection:
    """A connection that writes nothing.  In a directory this process cannot
    write, SQLite reads a database in WAL mode only through its existing
    -wal and -shm files, and one without them only as immutable."""
    from urllib.parse import quote

    immutable = not os.access(os.path.dirname(db_file), os.W_OK) and not (
        os.path.exists(db_file + "-wal") and os.path.exists(db_file + "-shm"))
    flags = "mode=ro" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(f"file:{quote(db_file)}?{flags}", uri=True, timeout=120,
                           isolation_level=None, check_same_thread=False)


def _wal(conn, timeout_s=120.0):
    """Switch to write-ahead logging.  Processes that open a new store at
    once (the ranks of a torchrun launch) race for it, and SQLite answers
    the loser "locked" at once rather than waiting: try again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _check_schema(conn, db_file, create=True, migrate=True):
    """Create flor's tables in a new database (with `create`), and bring an
    older flor store up to this schema (with `migrate`); refuse a database
    of another program or of a newer schema.  Runs inside a write
    transaction when it may write, so that two processes opening a new
    store do not both create it."""
    objects = conn.execute("SELECT type, name FROM sqlite_master").fetchall()
    tables = {name for kind, name in objects if kind == "table"}
    if "flor_schema" in tables:
        row = conn.execute("SELECT version FROM flor_schema").fetchone()
        if row is None or row[0] > SCHEMA_VERSION:
            found = "no version" if row is None else f"schema version {row[0]}"
            raise StoreError(f"{db_file} has {found}; this flor reads schema version "
                             f"{SCHEMA_VERSION} and older. Use the flor that wrote it, or point "
                             "FLOR_DIR at another directory")
        version = row[0]
    elif objects or any(conn.execute(f"PRAGMA {p}").fetchone()[0]
                        for p in ("user_version", "application_id")):
        columns = ({r[1] for r in conn.execute("PRAGMA table_info(runs)")}
                   if "runs" in tables else set())
        if not _RUN_COLUMNS <= columns:
            held = f"the tables {', '.join(sorted(tables))}" if tables else "no flor tables"
            raise StoreError(f"{db_file} is not a flor store (it holds {held}); flor leaves "
                             "it untouched. Point FLOR_DIR at another directory")
        version = 1  # written by flor before the schema was versioned
        if migrate:
            conn.execute("CREATE TABLE flor_schema (version INTEGER NOT NULL)")
            conn.execute("INSERT INTO flor_schema (version) VALUES (1)")
    elif not create:  # an empty database: a store not made yet
        raise StoreError(f"{db_file} is empty: no run was stored there yet")
    else:
        for statement in ddl():
            conn.execute(statement)
        conn.execute("INSERT INTO flor_schema (version) VALUES (?)", (SCHEMA_VERSION,))
        return
    if migrate:
        for v in range(version, SCHEMA_VERSION):
            for statement in MIGRATIONS[v]:
                conn.execute(statement)
        if version != SCHEMA_VERSION:
            conn.execute("UPDATE flor_schema SET version = ?", (SCHEMA_VERSION,))
        # Tables and indexes added since a store was made: no schema change
        # for a reader (one that does not know a table leaves it alone).
        for statement in ddl():
            conn.execute(statement)


def _scratch(conn):
    """A replay part's own database: written by one worker at every main-loop
    iteration, read once the worker has finished.  A worker killed mid-write
    leaves it consistent (the rollback journal, which SQLite replays on the
    next open), and its segment runs again into a new file anyway; what must
    be durable is only the finished part, which `Store.durable` makes so.  So
    no commit waits for the disk (a sync per iteration was most of a
    step-loop replay's time), and the journal is truncated, not deleted."""
    conn.execute("PRAGMA journal_mode=TRUNCATE")
    conn.execute("PRAGMA synchronous=OFF")


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (or ROLLBACK) on an autocommit connection.
    One inside another is part of the outer one (writes grouped into one
    commit).  A write that the file system refuses (read-only, full) becomes
    a StoreError naming the store (`db_file`)."""

    def __init__(self, conn, db_file=None):
        self.conn, self.db_file = conn, db_file
        self.outer = False

    def __enter__(self):
        if not self.conn.in_transaction:
            self.conn.execute("BEGIN IMMEDIATE")
            self.outer = True
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        if not self.outer:
            return False
        if exc_type is None:
            try:
                self.conn.execute("COMMIT")
                return False
            except sqlite3.DatabaseError as e:
                exc = e
        if self.conn.in_transaction:  # (SQLite ends it itself on some errors)
            self.conn.execute("ROLLBACK")
        if self.db_file is not None and _refused(exc):
            raise unusable(self.db_file, exc) from None
        if exc_type is None:
            raise exc
        return False


def _refused(error) -> bool:
    """Whether an SQLite error is the file system refusing a write, or a
    damaged database."""
    return isinstance(error, sqlite3.DatabaseError) and any(
        m in str(error) for m in ("readonly", "disk is full", "unable to open", "disk I/O error",
                                  "malformed", "not a database"))
