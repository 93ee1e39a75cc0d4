"""The run store: ``.flor/`` in the working directory (``FLOR_DIR`` moves it),
its database ``flor.db`` (SQLite, WAL; the tables of schema.py) beside the
files that layout.py keeps (docs/results.md lists every one).

This module holds every query of flor's tables (database.py opens the
file, checks its schema and makes transactions).  Every process (the
recording script, each replay worker) opens its own connection; writes are
short transactions, so concurrent workers only wait on each other for
milliseconds.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import time

from .context import MAIN, PRE, PRINTED, printed_lines
from .database import SCHEMA_VERSION, Database, ddl
from .errors import FlorError, StoreError, unusable
from .layout import Layout, new_run_id, process_alive, process_start, store_root
from .runinfo import PartInfo, encoded, run_row
from .schema import (BLOCKRUNS, BLOCKS, DECISIONS, LOGS, LOOPS, OUTPUT, PART_TABLES, PARTS, RUNS,
                     WRITES)
from .statements import Sources

__all__ = ["Store", "Layout", "store_root", "new_run_id", "SCHEMA_VERSION", "ddl", "unusable",
           "printed_lines", "process_start", "process_alive"]


class Store(Database):
    """The run store.  `db_file` points a replay part at a database of its
    own (merge copies it into flor.db): one writer per file, which is safe
    where SQLite's write-ahead log is not, on network file systems."""

    @functools.cached_property
    def _sources(self) -> Sources:
        """The runs' kept sources, each file read once (flor/statements.py)."""
        return Sources(self)

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

    def resolve(self, ref: str, kind: str | None = None, script: str | None = None) -> str:
        """The run id `ref` names: itself, `latest` (the newest run, of
        `kind` and `script` if given), a run's name (flor/runs.py `label`),
        or a unique prefix of a run's id; as given where no run matches
        (the caller says there is none).  A prefix of several runs' ids is
        refused, naming them.  A data-parallel record's other ranks (listed
        under rank 0's run) are not candidates."""
        if ref is None or not self.exists() or self.run(ref) is not None:
            return ref
        rows = self.script_runs(script, kind) if script is not None else \
            [r for r in self.runs() if kind is None or r["kind"] == kind]
        rows = [r for r in rows if not getattr(r["info"], "follower", False)]
        if ref == "latest":
            return rows[-1]["run_id"] if rows else ref
        named = [r["run_id"] for r in rows if getattr(r["info"], "name", None) == ref]
        if named:  # (names are unique: the last, should two runs have one)
            return named[-1]
        ids = [r["run_id"] for r in rows if r["run_id"].startswith(ref)]
        if len(ids) > 1:
            shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            raise FlorError(f"{ref!r} is the start of {len(ids)} run ids ({shown}); give more "
                            "of the one you mean")
        return ids[0] if ids else ref

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

    def notable_decisions(self, run_id, always: str, first: str) -> list[dict]:
        """A record's decisions in order, less most of its main loop's:
        every block decision, every iteration checkpoint taken, every
        iteration decision whose reason holds `always`, of those whose
        reason holds `first` and not `always`, the first of each loop, and
        the last of each loop.  A step loop makes many decisions, and a
        record's closing summary wants none of the rest."""
        return [dict(r) for r in self.db.execute(
            "SELECT * FROM decisions WHERE run_id = ?1 AND (block NOT GLOB '* (iteration)' "
            "OR checkpoint = 1 OR instr(reason, ?2) > 0 OR rowid IN (SELECT min(rowid) "
            "FROM decisions WHERE run_id = ?1 AND block GLOB '* (iteration)' AND "
            "instr(reason, ?3) > 0 AND instr(reason, ?2) = 0 GROUP BY block) OR rowid IN "
            "(SELECT max(rowid) FROM decisions WHERE run_id = ?1 AND block GLOB "
            "'* (iteration)' GROUP BY block)) ORDER BY rowid",
            (run_id, always, first))]

    def checkpoints_removed(self, run_id, files, why):
        """The checkpoint `files` of a record were removed (thinned): their
        decisions hold no checkpoint now, and their reason ends with `why`."""
        with self.transaction():
            self.db.executemany(
                "UPDATE decisions SET checkpoint = 0, file = NULL, reason = reason || ? "
                "WHERE run_id = ? AND file = ?", [(why, run_id, f) for f in sorted(files)])

    def truncate_record(self, run_id, ord_, decisions):
        """Delete what a record stored after a resume point: logs and output
        after order `ord_`, decisions after rowid `decisions`."""
        with self.transaction():
            for table in ("logs", "output", "writes"):
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
            for table in (RUNS, *PART_TABLES, DECISIONS, WRITES):
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
            for r in self._printed(run_id, run):
                if names is None or r["name"] in names:
                    rows.append(r)
                old = PRINTED + (r["loc"] or "")  # an added line's name by its place
                if names is not None and old != r["name"] and old in names:
                    rows.append(dict(r, name=old))
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
        rows = self.run_rows("logs", run_id) + self._printed(run_id)
        return sorted(rows, key=lambda r: (r["part"], r["ord"]))

    def _printed(self, run_id, run=None) -> list[dict]:
        """The run's printed lines as log rows, a replay's added statements
        named by their function and text (flor/statements.py)."""
        run = run or self.run(run_id)
        name = self._sources.namer(run) if run and run.get("kind") == "replay" else None
        return printed_lines(self.run_rows("output", run_id), name)

    def add_writes(self, rows):
        self._insert(WRITES, rows)

    def writes_by_block(self, run_id, top, it) -> list[dict]:
        """What a record's blocks wrote to files in one main-loop iteration,
        with the context of each write, in order (none in a store read
        without the table: one made before it, opened read-only)."""
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                           "name = 'writes'").fetchone() is None:
            return []
        return [dict(r) for r in self.db.execute(
            "SELECT ctx, file, handle, mode, args, data FROM writes WHERE run_id = ? AND top IS ? "
            "AND iter IS ? ORDER BY ord", (run_id, top, it))]

    def output_by_block(self, run_id, top, it) -> list[dict]:
        """A record's output in one main-loop iteration, with the context of
        each chunk, in order."""
        return [dict(r) for r in self.db.execute(
            "SELECT stream, ctx, text FROM output WHERE run_id = ? AND top IS ? AND iter IS ? "
            "ORDER BY ord", (run_id, top, it))]


def _makes_up(row, nparts) -> bool:
    if nparts is None or row["phase"] == MAIN:
        return True
    if row["phase"] == PRE:
        return row["part"] == 0
    return row["part"] == nparts - 1


