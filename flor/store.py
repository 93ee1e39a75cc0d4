"""The run store: ``.flor/`` in the working directory (``FLOR_DIR`` moves it).

    .flor/flor.db                 SQLite (WAL): runs, parts, logs, output, decisions,
                                  blockruns, blocks, loops
    .flor/runs/<run>/source.py    the exact source of the script as it ran
    .flor/runs/<run>/modules/     the source of the program's other files with flor calls
    .flor/runs/<run>/ckpt/        the run's checkpoints (record runs)
    .flor/runs/<run>/plan.json    a replay's plan
    .flor/runs/<run>/part-N.db    a --part worker's database, until merge imports it
    .flor/calibration.json        this machine's measured write bandwidth

Every process (the recording script, each replay worker) opens its own
connection; writes are short transactions, so concurrent workers only wait on
each other for milliseconds.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import time

__all__ = ["Store", "store_root"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, kind TEXT NOT NULL, parent TEXT, script TEXT, script_name TEXT,
    argv TEXT, cwd TEXT, started REAL, finished REAL, status TEXT, versions TEXT,
    epsilon REAL, c REAL, main_loop TEXT, main_run INTEGER, iterations INTEGER, info TEXT);
CREATE TABLE IF NOT EXISTS parts (
    run_id TEXT, part INTEGER, status TEXT, seconds REAL, info TEXT,
    PRIMARY KEY (run_id, part));
CREATE TABLE IF NOT EXISTS logs (
    run_id TEXT, part INTEGER, ord INTEGER, phase TEXT, top TEXT, ctx TEXT, name TEXT,
    iter TEXT, seq INTEGER, value TEXT, loc TEXT);
CREATE INDEX IF NOT EXISTS logs_by_run ON logs (run_id, name);
CREATE TABLE IF NOT EXISTS output (
    run_id TEXT, part INTEGER, ord INTEGER, stream TEXT, phase TEXT, top TEXT,
    iter INTEGER, text TEXT);
CREATE INDEX IF NOT EXISTS output_by_run ON output (run_id);
CREATE TABLE IF NOT EXISTS decisions (
    run_id TEXT, block TEXT, ctx TEXT, occurrence INTEGER, iter TEXT, top TEXT,
    top_iter INTEGER, n INTEGER, k INTEGER, compute_s REAL, mean_compute_s REAL,
    nbytes INTEGER, bandwidth REAL, materialize_s REAL, ratio REAL, limit_value REAL,
    checkpoint INTEGER, reason TEXT, file TEXT);
CREATE INDEX IF NOT EXISTS decisions_by_run ON decisions (run_id);
CREATE TABLE IF NOT EXISTS blockruns (
    run_id TEXT, part INTEGER, phase TEXT, block TEXT, ctx TEXT, occurrence INTEGER,
    state TEXT);
CREATE TABLE IF NOT EXISTS blocks (
    run_id TEXT, part INTEGER, block TEXT, n INTEGER, k INTEGER, compute_s REAL,
    materialize_s REAL, restore_s REAL, restores INTEGER, skips INTEGER, steps INTEGER,
    nbytes INTEGER);
CREATE TABLE IF NOT EXISTS loops (
    run_id TEXT, part INTEGER, loop TEXT, run INTEGER, depth INTEGER, iterations INTEGER,
    seconds REAL);
"""

# Tables a replay part writes; merge copies them from per-part databases.
PART_TABLES = ("parts", "logs", "output", "blockruns", "blocks", "loops")


def store_root() -> str:
    return os.path.abspath(os.environ.get("FLOR_DIR") or os.path.join(os.getcwd(), ".flor"))


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class Store:
    """The run store.  `db_file` points a replay part at a database of its
    own (merge copies it into flor.db): one writer per file, which is safe
    where SQLite's write-ahead log is not, on network file systems."""

    def __init__(self, root: str | None = None, db_file: str | None = None):
        self.root = os.path.abspath(root) if root else store_root()
        self.db_file = db_file or os.path.join(self.root, "flor.db")
        self._conn = None
        self._pid = None

    # -- connection ---------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            os.makedirs(os.path.dirname(self.db_file), exist_ok=True)
            conn = sqlite3.connect(self.db_file, timeout=120, isolation_level=None,
                                   check_same_thread=False)
            if self.db_file.endswith("flor.db"):
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA)
            conn.row_factory = sqlite3.Row
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def close(self):
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def transaction(self):
        return _Transaction(self.db)

    def _many(self, sql, rows):
        if rows:
            with self.transaction():
                self.db.executemany(sql, rows)

    # -- runs ---------------------------------------------------------------

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.root, "runs", run_id)

    def ckpt_dir(self, run_id: str) -> str:
        return os.path.join(self.run_dir(run_id), "ckpt")

    def new_run(self, kind, script, argv, source, parent=None, run_id=None, **fields) -> str:
        run_id = run_id or new_run_id()
        os.makedirs(self.run_dir(run_id), exist_ok=True)
        if source is not None:
            with open(os.path.join(self.run_dir(run_id), "source.py"), "w") as f:
                f.write(source)
        row = dict(run_id=run_id, kind=kind, parent=parent, script=script,
                   script_name=os.path.basename(script) if script else None,
                   argv=json.dumps(list(argv)), cwd=os.getcwd(), started=time.time(),
                   status="running")
        row.update(fields)
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self.transaction():
            self.db.execute(f"INSERT OR REPLACE INTO runs ({cols}) VALUES ({marks})",
                            list(row.values()))
        return run_id

    def update_run(self, run_id, **fields):
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction():
            self.db.execute(f"UPDATE runs SET {sets} WHERE run_id = ?",
                            [*fields.values(), run_id])

    def run(self, run_id) -> dict | None:
        row = self.db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM runs ORDER BY started")]

    def source(self, run_id) -> str | None:
        return self.module_sources(run_id).get(None)

    def save_module_source(self, run_id, relpath, text):
        """Keep the source of another file of the program (one with flor calls)."""
        path = os.path.join(self.run_dir(run_id), "modules", relpath)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def module_sources(self, run_id) -> dict:
        """{None: the script's source, relpath: another file's source}."""
        out = {}
        run_dir = self.run_dir(run_id)
        try:
            with open(os.path.join(run_dir, "source.py")) as f:
                out[None] = f.read()
        except FileNotFoundError:
            pass
        base = os.path.join(run_dir, "modules")
        for dirpath, _, files in os.walk(base):
            for name in files:
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    out[os.path.relpath(path, base)] = f.read()
        return out

    def records(self, script) -> list[dict]:
        """Record runs of this script (by path, else by name), newest first."""
        path = os.path.abspath(script)
        for key, value in (("script", path), ("script_name", os.path.basename(path))):
            rows = self.db.execute(
                f"SELECT * FROM runs WHERE kind = 'record' AND {key} = ? ORDER BY started DESC",
                (value,)).fetchall()
            if rows:
                return [dict(r) for r in rows]
        return []

    def latest_record(self, script) -> dict | None:
        """The newest finished record run of this script."""
        return next((r for r in self.records(script) if r["status"] == "finished"), None)

    # -- per-run data -------------------------------------------------------

    def _insert(self, table, rows):
        if rows:
            marks = ", ".join("?" for _ in rows[0])
            self._many(f"INSERT INTO {table} VALUES ({marks})", rows)

    def add_logs(self, rows):
        self._insert("logs", rows)

    def add_output(self, rows):
        self._insert("output", rows)

    def add_decisions(self, rows):
        self._insert("decisions", rows)

    def add_blockruns(self, rows):
        self._insert("blockruns", rows)

    def add_blocks(self, rows):
        self._insert("blocks", rows)

    def add_loops(self, rows):
        self._insert("loops", rows)

    def set_part(self, run_id, part, status, seconds=None, info=None):
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?)",
                            (run_id, part, status, seconds, json.dumps(info or {})))

    def clear_part(self, run_id, part):
        with self.transaction():
            for table in PART_TABLES:
                self.db.execute(f"DELETE FROM {table} WHERE run_id = ? AND part = ?",
                                (run_id, part))

    def import_part(self, db_file):
        """Copy a part's rows from its own database into this store."""
        self.db.execute("ATTACH DATABASE ? AS part", (db_file,))
        try:
            with self.transaction():
                for table in PART_TABLES:
                    keys = self.db.execute(f"SELECT DISTINCT run_id, part FROM part.{table}")
                    for run_id, part in keys.fetchall():
                        self.db.execute(f"DELETE FROM {table} WHERE run_id = ? AND part = ?",
                                        (run_id, part))
                    self.db.execute(f"INSERT INTO {table} SELECT * FROM part.{table}")
        finally:
            self.db.execute("DETACH DATABASE part")

    def rows(self, table, run_id, order=""):
        return [dict(r) for r in self.db.execute(
            f"SELECT * FROM {table} WHERE run_id = ? {order}", (run_id,))]

    # -- machine calibration -------------------------------------------------

    def bandwidth(self, measure) -> float:
        """Write bandwidth of this machine (bytes/s), measured once per store
        and host by `measure()` and kept in calibration.json."""
        path = os.path.join(self.root, "calibration.json")
        host = socket.gethostname()
        try:
            with open(path) as f:
                cal = json.load(f)
        except (FileNotFoundError, ValueError):
            cal = {}
        if host in cal and cal[host].get("write_bytes_per_s", 0) > 0:
            return float(cal[host]["write_bytes_per_s"])
        bps = float(measure())
        cal[host] = {"write_bytes_per_s": bps, "measured": time.time()}
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(cal, f)
        os.replace(tmp, path)
        return bps

class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (or ROLLBACK) on an autocommit connection."""

    def __init__(self, conn):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        self.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")
