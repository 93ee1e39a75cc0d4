"""The manual API: flor.generator, flor.SkipBlock, flor.log, flor.dataframe.

    import flor
    for epoch in flor.generator(range(N)):
        if flor.SkipBlock.step_into("train"):
            for x, y in loader:
                ...
        net, optimizer = flor.SkipBlock.end(net, optimizer)
        flor.log("val_acc", evaluate(net))

Run as ``python train.py`` (or ``python -m flor record train.py``) it records;
``python -m flor replay train.py`` replays it.  See README.md.
"""
from __future__ import annotations

import json
import sys

from .runtime.session import Session

__all__ = ["generator", "SkipBlock", "log", "dataframe"]


def generator(iterable, name: str | None = None, state=None):
    """Iterate over `iterable`, tracking the iteration for checkpoints and logs.

    Wrap the main (epoch) loop: replay splits it among workers.  Nested
    generators add a level to each log's iteration.  Any iterable works,
    including unbounded ones (replay stops at the recorded count); for a
    ``while`` loop write ``for _ in flor.generator(itertools.count()):`` and
    ``break`` where the ``while`` condition fails.  A loop is identified by
    `name`, or by the line of this call when unnamed.

    `state`: the objects the main loop carries from one iteration into the
    next, e.g. ``state=(model, optimizer, scheduler)``.  At the end of an
    iteration the record may checkpoint them (with the random state; the
    adaptive rule decides when), and replay workers and ``record --resume``
    start from such a checkpoint instead of going through every earlier
    iteration.  They are restored in place, so list mutable objects (modules,
    optimizers, schedulers, tensors, lists, dicts), and everything the loop
    carries: a restore whose state differs from the record's is refused.
    """
    from .runtime.carry import Carried

    carrier = Carried(state) if state is not None else None
    return Session.get().loop(iterable, name, sys._getframe(1), carrier)


class SkipBlock:
    """Memoize a block of code by its side effects.

    In record the block always runs, and ``end`` checkpoints the objects it
    is given when the adaptive rule allows.  In replay a block that was not
    changed (probed) is skipped, and ``end`` restores the objects in place
    from the checkpoint of the same block at the same iteration.
    """

    @staticmethod
    def step_into(name: str | None = None, probed: bool = False) -> bool:
        """Whether to run the block.  `name` identifies the block (its call
        site when omitted); ``probed=True`` makes replay always run it."""
        return Session.get().step_into(name, probed, sys._getframe(1))

    @staticmethod
    def end(*objs):
        """Close the innermost block; returns `objs` (one object, a tuple, or
        None).  After a skipped block they hold the recorded state: modules,
        optimizers, schedulers and scalers through ``load_state_dict``,
        tensors and containers in place.  Rebind the results, since numbers
        and other immutable values can only be returned:
        ``net, optimizer, best = flor.SkipBlock.end(net, optimizer, best)``.
        The random-number state (torch, CUDA if initialised, numpy, random)
        is checkpointed and restored with the block."""
        return Session.get().end(objs, sys._getframe(1))


def log(name: str, value):
    """Record `value` under `name` at the current iteration of every enclosing
    flor.generator, and return it.  Tensors and arrays are stored as numbers
    (nested lists of them); those of more than 1024 elements as binary files,
    written in the background."""
    Session.get().log(name, value, sys._getframe(1))
    return value


def dataframe(*names: str, run: str | None = None):
    """The logs of the latest run (or of `run`) as a pandas DataFrame: one
    row per iteration, one column per log name (all names if none given).

    Iteration columns are ``iteration`` for the outermost flor.generator,
    ``iteration_1`` for the next level, and so on; ``seq`` numbers repeated
    values of a name within one iteration (for example per-batch values
    logged in a loop that is not a flor.generator).

    Printed lines are stored too, one name per print statement:
    ``stdout@train.py:57`` (recorded line numbers; ``train.py:new:57`` for a
    statement that replay added at line 57).  They are returned only when
    named."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            "flor.dataframe needs pandas, an optional dependency: pip install pandas"
        ) from None
    from .store import Store

    store = Store()
    if run is None:
        runs = store.runs()
        if not runs:
            raise LookupError(f"no runs in {store.root}")
        run = runs[-1]["run_id"]
    elif store.run(run) is None:
        raise LookupError(f"no run {run!r} in {store.root}; `python -m flor runs` lists them")
    rows = {}
    counters: dict = {}
    depth = 0
    for r in store.logs(run):
        if (r["name"] not in names) if names else r["name"].startswith(("stdout@", "state@")):
            continue
        vec = tuple(json.loads(r["iter"]))
        depth = max(depth, len(vec))
        seq = counters.get((r["name"], vec), 0)
        counters[(r["name"], vec)] = seq + 1
        rows.setdefault((vec, seq), {})[r["name"]] = store.value(run, json.loads(r["value"]))
    levels = ["iteration"] + [f"iteration_{i}" for i in range(1, depth)]
    records = []
    for (vec, seq), values in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rec = {lvl: (vec[i] if i < len(vec) else None) for i, lvl in enumerate(levels)}
        rec["seq"] = seq
        rec.update(values)
        records.append(rec)
    columns = levels + ["seq"] + (list(names) or sorted({k for v in rows.values() for k in v}))
    df = pd.DataFrame.from_records(records, columns=columns)
    if df.empty or (df["seq"] == 0).all():
        df = df.drop(columns="seq")
    return df
