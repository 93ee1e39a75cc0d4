"""Results across runs: flor.dataframe, flor.dataframes and flor.names.

The runs of a script are its finished records and replays (a replay holds
the hindsight values; the ``kind`` column tells them apart), each with the
configuration it ran with as columns (`script_args`).

Every logged name (and every printed statement, ``stdout@file:line``) has
a *level*: the number of index columns its values need.  A value logged
in the main loop has iteration vector ``[i]``, one inside a nested
flor.generator ``[i, j]``; a name that repeats within one iteration (a
``flor.log`` in a batch loop that is not a flor.generator, a print of
several lines) needs ``seq`` as well, one level deeper.  So per-epoch
values are level 1 and per-batch values level 2, and each level gets a
frame of its own: nothing is padded with NaN for rows of another level.
Values logged before or after the main loop are level 0, one row per run.
"""
from __future__ import annotations

import json
import os
import re

from .context import PRINTED, STATE
from .printed import field_name as printed_field
from .printed import fields as printed_fields
from .printed import split as split_printed

__all__ = ["select_runs", "script_args", "Values", "dataframes", "dataframe", "names",
           "names_frame", "statement"]


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


# -- which runs ---------------------------------------------------------------

def select_runs(store, script=None, run=None, runs=None, ordered=False) -> list[dict]:
    """The runs to read, oldest first (`ordered`: `runs` in the order given).
    `run` (one id) or `runs` (ids) are taken as given; otherwise every
    finished run (records and replays) of
    `script` (a path, else a file name; by default the script of the latest
    run), less the ranks other than 0 of data-parallel records, and with
    the record this process is making, if it is one of them."""
    if run is not None and runs is not None:
        raise ValueError("pass run= (one run) or runs= (several), not both")
    if run is not None:
        runs = [run]
    if runs is not None:
        if isinstance(runs, str):
            runs = [runs]
        rows = []
        for run_id in runs:
            row = store.run(run_id)
            if row is None:
                raise LookupError(f"no run {run_id!r} in {store.root}; "
                                  "`python -m flor runs` lists them")
            rows.append(row)
        return rows if ordered else sorted(rows, key=lambda r: r["started"] or 0)
    if script is None:
        every = store.runs()
        if not every:
            raise LookupError(f"no runs in {store.root}")
        script = every[-1]["script"]
    mine = _current_record()
    rows = [r for r in store.script_runs(script)
            if (r["status"] == "finished" or r["run_id"] == mine)
            and not (r["kind"] == "record" and r["info"].follower)]
    if not rows:
        raise LookupError(f"no finished run of {script or 'an interactive session'} in "
                          f"{store.root}; "
                          "`python -m flor runs` lists the runs")
    return rows


def _current_record():
    """The run this process records, if it does (flor.dataframe called at
    the end of a training script sees the run so far)."""
    from .runtime.session import Session

    s = Session._current
    if s is not None and getattr(s, "pid", None) == os.getpid() and s.mode == "record":
        return s.run_id
    return None


def script_args(run, store=None) -> dict:
    """The arguments a run's script ran with, as {column: value}: the
    configuration its record stored (flor/config.py: what argparse parsed,
    defaults included, and config objects, by dotted key), which a replay
    with the record's arguments shares (`store` finds its record); where
    that holds no parse of the command line, its words too (`_words`)."""
    record = run if run["kind"] == "record" else None
    if record is None and store is not None and run.get("parent"):
        record = store.run(run["parent"])
        if record is not None and _args(record) != _args(run):
            record = None
    info = record.get("info") if record is not None else None
    config = getattr(info, "config", None) or {}
    if getattr(info, "config_parsed", False):
        return dict(config)
    # No parse of the command line was found: its words, and a config object
    return {**_words(_args(run)), **config}


def _args(run) -> list:
    """The words after the script's name: a record stores [script, *args];
    a replay its arguments only."""
    argv = run["argv"]
    if argv and (run["kind"] == "record"
                 or os.path.basename(argv[0]) == (run["script_name"] or "")):
        argv = argv[1:]
    return list(argv)


def _words(argv) -> dict:
    """{column: value} from command-line words: ``--epochs 4`` and
    ``--epochs=4`` give epochs = 4 (numbers converted), ``--batch-size 8``
    batch_size = 8, an option followed by another option or by nothing
    True, other words arg0, arg1, ... (all words after ``--`` too).  An
    option given twice keeps its values in a tuple.  Defaults are not on
    the command line: a run that took them has no value here."""
    out, positional, rest, i = {}, [], False, 0
    while i < len(argv):
        word = argv[i]
        if rest or not _is_option(word):
            if word == "--" and not rest:
                rest = True
            else:
                positional.append(_convert(word))
            i += 1
            continue
        key, eq, text = word.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if eq:
            value = _convert(text)
        elif i + 1 < len(argv) and not _is_option(argv[i + 1]) and argv[i + 1] != "--":
            value = _convert(argv[i + 1])
            i += 1
        else:
            value = True
        if key in out:
            old = out[key]
            value = (*(old if isinstance(old, tuple) else (old,)), value)
        out[key] = value
        i += 1
    out.update((f"arg{n}", v) for n, v in enumerate(positional))
    return out


def _is_option(word) -> bool:
    return word.startswith("-") and word not in ("-", "--") and not _FLOAT.fullmatch(word)


def _convert(text):
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


# -- what they logged ---------------------------------------------------------

class Values:
    """The values the runs logged (and printed, when `printed`), by name:
    ``rows[name]`` is a list of (run id, iteration vector, seq, value as
    stored (decoded JSON), location), in run order, then as logged.  A
    name ``stdout@file:line/field`` is the numbers named `field` in that
    statement's printed lines (flor/printed.py): with `fields`, every such
    name of the printed statements read is there too."""

    def __init__(self, store, runs, names=None, printed=False, fields=False):
        self.store, self.runs = store, runs
        self.rows: dict[str, list] = {}
        self._depth, self._repeats = {}, {}
        wanted = None if names is None else set(names)
        derived: dict = {}  # printed statement -> the fields of it asked for
        for name in names or ():
            base, field = split_printed(name)
            if field is not None:
                derived.setdefault(base, set()).add(field)
        read = None if names is None else list(dict.fromkeys(split_printed(n)[0] for n in names))
        self._statement: dict[str, str] = {}  # a printed field's name -> its statement's
        for run in runs:
            counts: dict = {}
            for r in store.logged(run["run_id"], read, printed):
                name = r["name"]
                if names is None and name.startswith(STATE):
                    continue
                vec = tuple(json.loads(r["iter"] or "[]"))
                value = json.loads(r["value"])
                seq = counts.get((name, vec), 0)
                counts[(name, vec)] = seq + 1
                self._depth[name] = max(self._depth.get(name, 0), len(vec))
                if seq:
                    self._repeats[name] = True
                row = (run["run_id"], vec, seq, value, r["loc"])
                if wanted is None or name in wanted:
                    self.rows.setdefault(name, []).append(row)
                if name.startswith(PRINTED) and (fields or name in derived):
                    # A field's rows are its lines' (seq too): a field that
                    # some lines lack leaves a gap, not a shift.
                    for field, number in printed_fields(value).items():
                        if fields or field in derived[name]:
                            full = printed_field(name, field)
                            self._statement[full] = name
                            self.rows.setdefault(full, []).append(row[:3] + (number,) + row[4:])

    def depth(self, name) -> int:
        """The length of the name's iteration vectors (the longest; a printed
        field's are its statement's)."""
        return self._depth[self._statement.get(name, name)]

    def repeats(self, name) -> bool:
        """Whether the name has several values in one iteration of some run
        (a printed field: whether its statement has several lines)."""
        return self._repeats.get(self._statement.get(name, name), False)

    def level(self, name) -> int:
        return self.depth(name) + self.repeats(name)

    def by_level(self, names) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for name in names:
            out.setdefault(self.level(name), []).append(name)
        return dict(sorted(out.items()))


# -- frames -------------------------------------------------------------------

def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("flor.dataframe needs pandas, an optional dependency: "
                          "pip install pandas") from None
    return pd


def _read(store, names, script, run, runs, ordered=False):
    """(runs, Values, the names asked for, or every name logged)."""
    selected = select_runs(store, script, run, runs, ordered)
    wanted = list(dict.fromkeys(names)) if names else None
    values = Values(store, selected, wanted, printed=wanted is not None)
    if wanted is None:
        wanted = sorted(n for n in values.rows if not n.startswith(PRINTED))
    missing = [n for n in wanted if n not in values.rows]
    if missing:
        ids = ", ".join(r["run_id"] for r in selected)
        raise LookupError(f"no values named {', '.join(map(repr, missing))} in the runs "
                          f"{ids}; flor.names() lists what they logged and printed")
    return selected, values, wanted


def arg_columns(runs, taken=(), store=None) -> tuple[list[str], dict]:
    """(argument columns in order of first appearance, {run id: {column:
    value}}).  An argument whose name is taken by another column is
    prefixed ``arg_``."""
    columns, per_run = [], {}
    for run in runs:
        args = {}
        for key, value in script_args(run, store).items():
            col = f"arg_{key}" if key in taken or re.fullmatch(r"iteration(_\d+)?", key) else key
            args[col] = value
            if col not in columns:
                columns.append(col)
        per_run[run["run_id"]] = args
    return columns, per_run


def _frame(store, runs, values, names):
    """The frame of names that share a level."""
    pd = _pandas()
    depth = max(values.depth(n) for n in names)
    seq = any(values.repeats(n) for n in names)
    index = ["iteration"] + [f"iteration_{i}" for i in range(1, depth)] if depth else []
    index += ["seq"] if seq else []
    order = {r["run_id"]: i for i, r in enumerate(runs)}
    rows: dict = {}
    for name in names:
        repeats = values.repeats(name)
        for run_id, vec, s, raw, _ in values.rows[name]:
            vec = vec + (None,) * (depth - len(vec))
            key = (order[run_id], vec, s if repeats else None)
            rows.setdefault(key, {})[name] = store.layout.value(run_id, raw)
    present = [runs[i] for i in sorted({key[0] for key in rows})]
    args, per_run = arg_columns(present, {"run", "kind", "seq", *names}, store)
    records = []
    for key in sorted(rows, key=lambda k: (k[0], [-1 if v is None else v for v in k[1]],
                                           -1 if k[2] is None else k[2])):
        run = runs[key[0]]
        rec = {"run": run["run_id"], "kind": run["kind"], **per_run[run["run_id"]]}
        rec.update(zip(index, key[1] + ((key[2],) if seq else ())))
        rec.update(rows[key])
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=["run", "kind", *args, *index, *names])


def dataframes(store, names=(), script=None, run=None, runs=None, ordered=False) -> dict:
    """{level: the frame of the names at that level}; see `dataframe`."""
    selected, values, wanted = _read(store, names, script, run, runs, ordered)
    return {level: _frame(store, selected, values, group)
            for level, group in values.by_level(wanted).items()}


def dataframe(store, names=(), script=None, run=None, runs=None, level=None, ordered=False):
    """One frame: the names asked for (every logged name if none) at one
    level, `level` when given; a ValueError when they span levels.
    `ordered`: the rows of `runs` in the order given (else oldest first)."""
    selected, values, wanted = _read(store, names, script, run, runs, ordered)
    groups = values.by_level(wanted)
    if level is None:
        if len(groups) > 1:
            where = "; ".join(f"level {lv}: {', '.join(group)}" for lv, group in groups.items())
            choices = " or ".join(f"level={lv}" for lv in groups)
            asked = "the names asked for are" if names else "the runs' names are"
            raise ValueError(f"{asked} logged at different loop levels ({where}); pass "
                             f"{choices}, ask for names of one level, or use "
                             "flor.dataframes(...) for one frame per level")
        if not groups:
            pd = _pandas()
            args, _ = arg_columns(selected, {"run", "kind"}, store)
            return pd.DataFrame(columns=["run", "kind", *args])
        level = next(iter(groups))
    if level not in groups:
        where = ", ".join(f"{lv} ({', '.join(g)})" for lv, g in groups.items())
        raise ValueError(f"none of the names asked for is at level {level}; their levels: {where}")
    return _frame(store, selected, values, groups[level])


# -- what can be asked for ----------------------------------------------------

def names(store, script=None, run=None, runs=None) -> list[dict]:
    """What the runs logged and printed, one dict per name, by level:
    name, level, kind ("log", "printed", or "printed number": a field of
    the printed lines, ``stdout@file:line/field``), values (how many, in all runs),
    runs (the ids of those that have it), where (the statement's location)
    and source (its text, from the run's kept source)."""
    selected = select_runs(store, script, run, runs)
    values = Values(store, selected, None, printed=True, fields=True)
    by_id = {r["run_id"]: r for r in selected}
    sources = store._sources  # (read once per store)
    out = []
    for name, rows in values.rows.items():
        run_id, loc = rows[0][0], rows[0][4]
        kind = "log" if not name.startswith(PRINTED) else \
            "printed number" if split_printed(name)[1] is not None else "printed"
        out.append({"name": name, "level": values.level(name), "kind": kind,
                    "values": len(rows), "runs": list(dict.fromkeys(r[0] for r in rows)),
                    "where": loc, "source": sources.statement(by_id[run_id], loc)})
    return sorted(out, key=lambda d: (d["level"], d["kind"] != "log", d["name"]))


NAME_COLUMNS = ["name", "level", "kind", "values", "runs", "where", "source"]


def names_frame(store, script=None, run=None, runs=None):
    """names() as a pandas DataFrame (its columns even when there are none)."""
    return _pandas().DataFrame(names(store, script, run, runs), columns=NAME_COLUMNS)

