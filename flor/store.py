"""The run store: ``.flor/`` in the working directory (``FLOR_DIR`` moves it).

    .flor/flor.db                 SQLite (WAL): runs, parts, logs, output, decisions,
                                  blocks, loops
    .flor/runs/<run>/source.py    the exact source of the script as it ran
    .flor/runs/<run>/ckpt/        the run's checkpoints (record runs)
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
    epsilon REAL, c REAL, main_loop TEXT, iterations INTEGER, info TEXT);
CREATE TABLE IF NOT EXISTS logs (
    run_id TEXT, part INTEGER, ord INTEGER, phase TEXT, loop TEXT, name TEXT, iter TEXT,
    seq INTEGER, value TEXT, loc TEXT);
CREATE INDEX IF NOT EXISTS logs_by_run ON logs (run_id, name);
CREATE TABLE IF NOT EXISTS output (
    run_id TEXT, part INTEGER, ord INTEGER, phase TEXT, loop TEXT, iter INTEGER, text TEXT);
CREATE TABLE IF NOT EXISTS parts (
    run_id TEXT, part INTEGER, status TEXT, seconds REAL, info TEXT,
    PRIMARY KEY (run_id, part));
CREATE INDEX IF NOT EXISTS output_by_run ON output (run_id);
CREATE TABLE IF NOT EXISTS decisions (
    run_id TEXT, block TEXT, iter TEXT, occurrence INTEGER, main_iter INTEGER, n INTEGER,
    k INTEGER, compute_s REAL, mean_compute_s REAL, nbytes INTEGER, bandwidth REAL,
    materialize_s REAL, ratio REAL, limit_value REAL, checkpoint INTEGER, reason TEXT,
    file TEXT);
CREATE INDEX IF NOT EXISTS decisions_by_run ON decisions (run_id);
CREATE TABLE IF NOT EXISTS blocks (
    run_id TEXT, part INTEGER, block TEXT, n INTEGER, k INTEGER, compute_s REAL,
    materialize_s REAL, restore_s REAL, restores INTEGER, skips INTEGER, steps INTEGER,
    nbytes INTEGER);
CREATE TABLE IF NOT EXISTS loops (
    run_id TEXT, part INTEGER, loop TEXT, depth INTEGER, iterations INTEGER, seconds REAL);
"""


def store_root() -> str:
    return os.path.abspath(os.environ.get("FLOR_DIR") or os.path.join(os.getcwd(), ".flor"))


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class Store:
    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root) if root else store_root()
        self._conn = None
        self._pid = None

    # -- connection ---------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            os.makedirs(self.root, exist_ok=True)
            conn = sqlite3.connect(os.path.join(self.root, "flor.db"), timeout=120,
                                   isolation_level=None, check_same_thread=False)
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

    def _many(self, sql, rows):
        if rows:
            with self.db:  # one transaction
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
        with self.db:
            self.db.execute(f"INSERT OR REPLACE INTO runs ({cols}) VALUES ({marks})",
                            list(row.values()))
        return run_id

    def update_run(self, run_id, **fields):
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.db:
            self.db.execute(f"UPDATE runs SET {sets} WHERE run_id = ?",
                            [*fields.values(), run_id])

    def run(self, run_id) -> dict | None:
        row = self.db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM runs ORDER BY started")]

    def source(self, run_id) -> str | None:
        path = os.path.join(self.run_dir(run_id), "source.py")
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def latest_record(self, script) -> dict | None:
        """The newest finished record run of this script (by path, else by name)."""
        path = os.path.abspath(script)
        for key, value in (("script", path), ("script_name", os.path.basename(path))):
            row = self.db.execute(
                f"SELECT * FROM runs WHERE kind = 'record' AND {key} = ? AND status = 'finished' "
                "ORDER BY started DESC LIMIT 1", (value,)).fetchone()
            if row:
                return dict(row)
        return None

    # -- per-run data -------------------------------------------------------

    def add_logs(self, rows):
        self._many("INSERT INTO logs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def set_part(self, run_id, part, status, seconds=None, info=None):
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?)",
                            (run_id, part, status, seconds, json.dumps(info or {})))

    def add_output(self, rows):
        self._many("INSERT INTO output VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def add_decisions(self, rows):
        self._many("INSERT INTO decisions VALUES "
                   "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def add_blocks(self, rows):
        self._many("INSERT INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def add_loops(self, rows):
        self._many("INSERT INTO loops VALUES (?, ?, ?, ?, ?, ?)", rows)

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
