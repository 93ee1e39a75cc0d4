"""The run store: ``.flor/`` in the working directory (``FLOR_DIR`` moves it),
its database ``flor.db`` (SQLite, WAL; the tables of schema.py) beside the
files that layout.py keeps (docs/results.md lists every one).

This module holds every SQL statement flor runs.  Every process (the
recording script, each replay worker) opens its own connection; writes are
short transactions, so concurrent workers only wait on each other for
milliseconds.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import time

from .errors import StoreError, unusable
from .context import MAIN, PRE, PRINTED, printed_lines
from .layout import Layout, new_run_id, process_alive, process_start, store_root
from .runinfo import PartInfo, encoded, run_row
from .schema import (BLOCKRUNS, BLOCKS, DECISIONS, LOGS, LOOPS, OUTPUT, PART_TABLES, PARTS,
                     RUNS, TABLES)

__all__ = ["Store", "Layout", "store_root", "new_run_id", "SCHEMA_VERSION", "unusable",
           "printed_lines", "process_start", "process_alive"]

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
        if t.index:
            name, on = t.index
            out.append(f"CREATE INDEX IF NOT EXISTS {name} ON {t.name} ({', '.join(on)})")
    out.append("CREATE TABLE IF NOT EXISTS flor_schema (version INTEGER NOT NULL)")
    return out


# Columns of flor's runs table: a database without flor_schema that has
# them was written by flor before the schema was versioned.
_RUN_COLUMNS = {"run_id", "kind", "parent", "script", "script_name", "argv", "status",
                "main_loop", "main_run", "iterations", "info"}


class _Database:
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
        a StoreError)."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise unusable(self.db_file, NotADirectoryError(20, "Not a directory"))
        return os.path.isfile(self.db_file)

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


class Store(_Database):
    """The run store.  `db_file` points a replay part at a database of its
    own (merge copies it into flor.db): one writer per file, which is safe
    where SQLite's write-ahead log is not, on network file systems."""

    # -- runs ---------------------------------------------------------------

    def new_run(self, kind, script, argv, source, parent=None, run_id=None, **fields) -> str:
        run_id = run_id or new_run_id()
        self.db  # a store that cannot be used says so before any file is made
        try:
            os.makedirs(self.layout.run_dir(run_id), exist_ok=True)
            if source is not None:
                with open(os.path.join(self.layout.run_dir(run_id), "source.py"), "w") as f:
                    f.write(source)
        except OSError as e:
            shutil.rmtree(self.layout.run_dir(run_id), ignore_errors=True)
            raise unusable(self.db_file, e) from None
        row = dict(run_id=run_id, kind=kind, parent=parent, script=script,
                   script_name=os.path.basename(script) if script else None,
                   argv=json.dumps(list(argv)), cwd=os.getcwd(), started=time.time(),
                   status="running")
        row.update(encoded(fields))
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        try:
            with self.transaction():
                self.db.execute(f"INSERT OR REPLACE INTO runs ({cols}) VALUES ({marks})",
                                list(row.values()))
        except StoreError:
            shutil.rmtree(self.layout.run_dir(run_id), ignore_errors=True)
            raise
        return run_id

    def update_run(self, run_id, **fields):
        fields = encoded(fields)
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction():
            self.db.execute(f"UPDATE runs SET {sets} WHERE run_id = ?",
                            [*fields.values(), run_id])

    def run(self, run_id) -> dict | None:
        row = self.db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return run_row(row) if row else None

    def runs(self) -> list[dict]:
        return [run_row(r) for r in self.db.execute("SELECT * FROM runs ORDER BY started")]

    def script_runs(self, script, kind=None) -> list[dict]:
        """The runs of `script` (of `kind`, "record" or "replay", if given),
        oldest first: by its path, else by its file name; None: the runs of
        no file, recorded in an interactive session."""
        of_kind, args = ("", []) if kind is None else (" AND kind = ?", [kind])
        if script is None:
            return [run_row(r) for r in self.db.execute(
                f"SELECT * FROM runs WHERE script IS NULL{of_kind} ORDER BY started", args)]
        path = os.path.abspath(script)
        for key, value in (("script", path), ("script_name", os.path.basename(path))):
            rows = self.db.execute(
                f"SELECT * FROM runs WHERE {key} = ?{of_kind} ORDER BY started",
                [value, *args]).fetchall()
            if rows:
                return [run_row(r) for r in rows]
        return []

    def records(self, script) -> list[dict]:
        """Record runs of this script (by path, else by name), newest first.
        A data-parallel record is its rank 0's run (the others are its ranks)."""
        return [r for r in reversed(self.script_runs(script, "record"))
                if not r["info"].follower]

    def latest_record(self, script) -> dict | None:
        """The newest record run of this script that finished, or was
        interrupted after committing at least one main-loop iteration."""
        return next((r for r in self.records(script) if r["status"] == "finished" or (
            self.status(r) == "interrupted" and r["iterations"])), None)

    @staticmethod
    def status(run) -> str:
        """A run's status; a record still "running" whose process is gone
        (killed) on this host is "interrupted"."""
        if run["status"] != "running" or run["kind"] != "record":
            return run["status"]
        info = run["info"]
        if info.host != socket.gethostname() or not info.pid:
            return "running"
        return "running" if process_alive(info.pid, info.pid_start) else "interrupted"

    def iteration_checkpoints(self, run_id) -> list[dict]:
        """A record's written iteration checkpoint decisions, in order, with
        their rowid (as rowid_)."""
        return [dict(r) for r in self.db.execute(
            "SELECT rowid AS rowid_, * FROM decisions WHERE run_id = ? AND checkpoint = 1 "
            "AND block LIKE '% (iteration)' ORDER BY rowid", (run_id,))]

    def truncate_record(self, run_id, ord_, decisions):
        """Delete what a record stored after a resume point: logs and output
        after order `ord_`, decisions after rowid `decisions`."""
        with self.transaction():
            for table in ("logs", "output"):
                self.db.execute(f"DELETE FROM {table} WHERE run_id = ? AND ord > ?",
                                (run_id, ord_))
            self.db.execute("DELETE FROM decisions WHERE run_id = ? AND rowid > ?",
                            (run_id, decisions))

    def checkpoint_counts(self) -> dict[str, int]:
        """{run id: its record's checkpoints whose files exist}: a write that
        failed (a full disk) or a file deleted since is not counted."""
        counts: dict[str, int] = {}
        for run_id, name in self.db.execute(
                "SELECT run_id, file FROM decisions WHERE checkpoint = 1 AND file IS NOT NULL"):
            if os.path.exists(os.path.join(self.layout.ckpt_dir(run_id), name)):
                counts[run_id] = counts.get(run_id, 0) + 1
        return counts

    def delete_runs(self, run_ids):
        """Delete every row of these runs, in one transaction (their files
        are deleted by the caller, after)."""
        keys = [(r,) for r in run_ids]
        with self.transaction():
            for table in (RUNS, *PART_TABLES, DECISIONS):
                self.db.executemany(f"DELETE FROM {table.name} WHERE run_id = ?", keys)

    def restore_ratios(self, script_name) -> list[float]:
        """For each block of each earlier replay of this script that restored
        checkpoints: its seconds per restore over its record's estimated
        seconds per checkpoint."""
        rows = self.db.execute(
            "SELECT b.restore_s / b.restores AS r, m.materialize_s / m.k AS w "
            "FROM blocks b JOIN runs rp ON b.run_id = rp.run_id "
            "JOIN runs rc ON rp.parent = rc.run_id "
            "JOIN blocks m ON m.run_id = rc.run_id AND m.block = b.block "
            "WHERE rc.script_name = ? AND b.restores > 0 AND m.k > 0 AND m.materialize_s > 0",
            (script_name,)).fetchall()
        return [r["r"] / r["w"] for r in rows if r["w"] > 0]

    # -- results (flor/frames.py) -------------------------------------------

    def logged(self, run_id, names=None, printed=True) -> list[dict]:
        """``logs(run_id)`` restricted to `names` (all when None); printed
        lines only when `printed`, since finding them reads all output."""
        run = self.run(run_id) or {}
        nparts = run["info"].nparts if run.get("kind") == "replay" else None
        where = "" if names is None else f" AND name IN ({', '.join('?' for _ in names)})"
        rows = [dict(r) for r in self.db.execute(
            "SELECT * FROM logs WHERE run_id = ?" + where, [run_id, *(names or ())])]
        if printed and (names is None or any(n.startswith(PRINTED) for n in names)):
            rows += [r for r in printed_lines(self.run_rows("output", run_id))
                     if names is None or r["name"] in names]
        return sorted((r for r in rows if _makes_up(r, nparts)),
                      key=lambda r: (r["part"], r["ord"]))

    # -- per-run data -------------------------------------------------------

    def add_logs(self, rows):
        self._insert(LOGS, rows)

    def add_output(self, rows):
        self._insert(OUTPUT, rows)

    def add_decisions(self, rows):
        self._insert(DECISIONS, rows)

    def add_blockruns(self, rows):
        self._insert(BLOCKRUNS, rows)

    def add_blocks(self, rows):
        self._insert(BLOCKS, rows)

    def add_loops(self, rows):
        self._insert(LOOPS, rows)

    def set_part(self, run_id, part, status, seconds=None, info: PartInfo | None = None):
        row = PARTS.Row(run_id=run_id, part=part, status=status, seconds=seconds,
                        info=(info or PartInfo()).to_json())
        with self.transaction():
            self.db.execute(f"INSERT OR REPLACE INTO parts ({', '.join(PARTS.names)}) "
                            f"VALUES ({', '.join('?' for _ in row)})", row)

    def parts(self, run_id) -> list[dict]:
        """The parts of a replay, in order, each with its `PartInfo`."""
        return [dict(r, info=PartInfo.from_json(r["info"])) for r in self.db.execute(
            "SELECT * FROM parts WHERE run_id = ? ORDER BY part", (run_id,))]

    def clear_part(self, run_id, part):
        with self.transaction():
            for table in PART_TABLES:
                self.db.execute(f"DELETE FROM {table.name} WHERE run_id = ? AND part = ?",
                                (run_id, part))

    def import_part(self, db_file):
        """Copy a part's rows from its own database into this store."""
        self.db.execute("ATTACH DATABASE ? AS part", (db_file,))
        try:
            with self.transaction():
                for table in PART_TABLES:
                    t, cols = table.name, ", ".join(table.names)
                    keys = self.db.execute(f"SELECT DISTINCT run_id, part FROM part.{t}")
                    for run_id, part in keys.fetchall():
                        self.db.execute(f"DELETE FROM {t} WHERE run_id = ? AND part = ?",
                                        (run_id, part))
                    self.db.execute(f"INSERT INTO {t} ({cols}) SELECT {cols} FROM part.{t}")
        finally:
            self.db.execute("DETACH DATABASE part")

    def rows(self, table, run_id, order=""):
        return [dict(r) for r in self.db.execute(
            f"SELECT * FROM {table} WHERE run_id = ? {order}", (run_id,))]

    def run_rows(self, table, run_id) -> list[dict]:
        """The rows of `table` that make up the run: every replay part stores
        what came before and after the main loop, which only the first part
        (before) and the last part (after) contribute."""
        nparts = None
        run = self.run(run_id)
        if run is not None and run["kind"] == "replay":
            nparts = run["info"].nparts
        order = "ORDER BY part, ord" if table != "blockruns" else ""
        return [r for r in self.rows(table, run_id, order) if _makes_up(r, nparts)]

    def logs(self, run_id) -> list[dict]:
        """The run's logged values and printed lines, in the order logged.
        A printed line is a value of the statement that printed it, named
        ``stdout@file:line``; its ``seq`` counts its statement's lines in
        its context."""
        rows = self.run_rows("logs", run_id) + printed_lines(self.run_rows("output", run_id))
        return sorted(rows, key=lambda r: (r["part"], r["ord"]))

    def output_by_block(self, run_id, top, it) -> list[dict]:
        """A record's output in one main-loop iteration, with the context of
        each chunk, in order."""
        return [dict(r) for r in self.db.execute(
            "SELECT stream, ctx, text FROM output WHERE run_id = ? AND top IS ? AND iter IS ? "
            "ORDER BY ord", (run_id, top, it))]


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


def _makes_up(row, nparts) -> bool:
    if nparts is None or row["phase"] == MAIN:
        return True
    if row["phase"] == PRE:
        return row["part"] == 0
    return row["part"] == nparts - 1


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
