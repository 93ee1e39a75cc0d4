"""The run store's tables: each one's columns, in order, written once.

The store (store.py) makes its tables and its inserts from these lists;
what produces rows (the logbook, the policies, the session) builds each row
as its table's named record (`Table.Row`), so that no row is a tuple whose
fields must match the table's columns by position.  A column added here
needs a migration in database.py (MIGRATIONS), appending it to the table.
"""
from __future__ import annotations

from collections import namedtuple

__all__ = ["Table", "TABLES", "RUNS", "PARTS", "LOGS", "OUTPUT", "DECISIONS", "BLOCKRUNS",
           "BLOCKS", "LOOPS", "WRITES", "PART_TABLES"]


class Table:
    """A table: its name, its (column, type) pairs in order, the key over
    several columns, and its indexes, each (name, columns)."""

    def __init__(self, name: str, columns: list[tuple[str, str]], key: tuple = (),
                 indexes: tuple[tuple[str, tuple], ...] = ()):
        self.name, self.columns, self.key, self.indexes = name, columns, key, indexes
        self.names = tuple(c for c, _ in columns)
        self.Row = namedtuple(name.title().replace("_", "") + "Row", self.names)


RUNS = Table("runs", [
    ("run_id", "TEXT PRIMARY KEY"), ("kind", "TEXT NOT NULL"), ("parent", "TEXT"),
    ("script", "TEXT"), ("script_name", "TEXT"), ("argv", "TEXT"), ("cwd", "TEXT"),
    ("started", "REAL"), ("finished", "REAL"), ("status", "TEXT"), ("versions", "TEXT"),
    ("epsilon", "REAL"), ("c", "REAL"), ("main_loop", "TEXT"), ("main_run", "INTEGER"),
    ("iterations", "INTEGER"), ("info", "TEXT")])

# One row per replay part (status, seconds, info JSON).
PARTS = Table("parts", [
    ("run_id", "TEXT"), ("part", "INTEGER"), ("status", "TEXT"), ("seconds", "REAL"),
    ("info", "TEXT")], key=("run_id", "part"))

# Logged values (and state fingerprints) at their context; `iter` is the
# JSON list of loop indices.
LOGS = Table("logs", [
    ("run_id", "TEXT"), ("part", "INTEGER"), ("ord", "INTEGER"), ("phase", "TEXT"),
    ("top", "TEXT"), ("ctx", "TEXT"), ("name", "TEXT"), ("iter", "TEXT"), ("seq", "INTEGER"),
    ("value", "TEXT"), ("loc", "TEXT")], indexes=(("logs_by_run", ("run_id", "name")),))

# What the program printed, write by write; `iter` is the main loop's index.
OUTPUT = Table("output", [
    ("run_id", "TEXT"), ("part", "INTEGER"), ("ord", "INTEGER"), ("stream", "TEXT"),
    ("phase", "TEXT"), ("top", "TEXT"), ("iter", "INTEGER"), ("text", "TEXT"),
    ("ctx", "TEXT"), ("loc", "TEXT")], indexes=(("output_by_run", ("run_id",)),))

# The adaptive rule's decision for each block execution of a record.
DECISIONS = Table("decisions", [
    ("run_id", "TEXT"), ("block", "TEXT"), ("ctx", "TEXT"), ("occurrence", "INTEGER"),
    ("iter", "TEXT"), ("top", "TEXT"), ("top_iter", "INTEGER"), ("n", "INTEGER"),
    ("k", "INTEGER"), ("compute_s", "REAL"), ("mean_compute_s", "REAL"), ("nbytes", "INTEGER"),
    ("bandwidth", "REAL"), ("materialize_s", "REAL"), ("ratio", "REAL"),
    ("limit_value", "REAL"), ("checkpoint", "INTEGER"), ("reason", "TEXT"), ("file", "TEXT")],
    # by file: a record marks the rows of the iteration checkpoints it removes
    indexes=(("decisions_by_run", ("run_id",)), ("decisions_by_file", ("run_id", "file"))))

# The state machine's state for each block execution of a replay.
BLOCKRUNS = Table("blockruns", [
    ("run_id", "TEXT"), ("part", "INTEGER"), ("phase", "TEXT"), ("block", "TEXT"),
    ("ctx", "TEXT"), ("occurrence", "INTEGER"), ("state", "TEXT")])

# Each block's counters at the end of a run or part.
BLOCKS = Table("blocks", [
    ("run_id", "TEXT"), ("part", "INTEGER"), ("block", "TEXT"), ("n", "INTEGER"),
    ("k", "INTEGER"), ("compute_s", "REAL"), ("materialize_s", "REAL"), ("restore_s", "REAL"),
    ("restores", "INTEGER"), ("skips", "INTEGER"), ("steps", "INTEGER"),
    ("nbytes", "INTEGER")])

# Each run of a tracked loop: its depth, iterations and seconds.
LOOPS = Table("loops", [
    ("run_id", "TEXT"), ("part", "INTEGER"), ("loop", "TEXT"), ("run", "INTEGER"),
    ("depth", "INTEGER"), ("iterations", "INTEGER"), ("seconds", "REAL")])

# What a record's checkpointed blocks did to the script's files
# (runtime/filewrites.py): a replay that restores a block execution does it
# again.  `mode` is "write" (`data`: the text or bytes written), "flush",
# "close", or the mode the block opened the file with (`args`: open()'s
# encoding, errors and newline, JSON); `handle` numbers the file objects of
# the record; `file` is relative to the record's working directory where
# it is inside it.
WRITES = Table("writes", [
    ("run_id", "TEXT"), ("ord", "INTEGER"), ("top", "TEXT"), ("iter", "INTEGER"),
    ("ctx", "TEXT"), ("file", "TEXT"), ("handle", "INTEGER"), ("mode", "TEXT"),
    ("args", "TEXT"), ("data", "BLOB")], indexes=(("writes_by_run", ("run_id", "top", "iter")),))

TABLES = (RUNS, PARTS, LOGS, OUTPUT, DECISIONS, BLOCKRUNS, BLOCKS, LOOPS, WRITES)
# Tables a replay part writes; merge copies them from per-part databases.
PART_TABLES = (PARTS, LOGS, OUTPUT, BLOCKRUNS, BLOCKS, LOOPS)
