"""The manual API: flor.generator, flor.SkipBlock, flor.log, flor.label;
flor.dataframe, flor.dataframes and flor.names read the results
(flor/frames.py).

    import flor
    for epoch in flor.generator(range(N)):
        if flor.SkipBlock.step_into("train"):
            for x, y in loader:
                ...
        net, optimizer = flor.SkipBlock.end(net, optimizer)
        flor.log("val_acc", evaluate(net))

Run as ``python train.py`` (or ``python -m flor record train.py``) it records;
``python -m flor replay train.py`` replays it.  See docs/manual-api.md.
"""
from __future__ import annotations

import sys

from .runtime.session import Session

__all__ = ["generator", "SkipBlock", "log", "label", "dataframe", "dataframes", "names"]


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


def label(name: str | None = None, tags=(), note: str | None = None) -> None:
    """Name, tag or annotate the run this process records, as ``flor record
    --name NAME --tag TAG --note TEXT`` does (``flor tag`` changes them
    later).  A name is unique in the store and accepted wherever a run id
    is; one another run has raises FlorError.  In a replay it does nothing:
    the labels are the record's."""
    s = Session.get()
    if s.mode != "record":
        return
    from .runs import label as label_run

    if isinstance(tags, str):
        tags = (tags,)
    if s.policy.row.info.follower:  # (listed under rank 0's run, which is named)
        name = None
    label_run(s.store, s.run_id, name=name, add=tuple(tags), note=note)


def dataframe(*names: str, script: str | None = None, run: str | None = None,
              runs=None, level: int | None = None, where: str | None = None,
              sort: str | None = None):
    """The values logged by the runs of a script as a pandas DataFrame.

    By default every finished run (records and replays) of `script` (a path
    or a file name; default: the script of the latest run), oldest first;
    `run` (an id) or `runs` (ids) picks runs instead.  Columns: ``run``,
    ``kind`` ("record" or "replay": a replay holds the hindsight values),
    the script's configuration (what argparse parsed, defaults included,
    or its config object: docs/results.md; else its command line's words,
    ``--epochs 4`` making a column ``epochs``),
    ``iteration`` for the outermost flor.generator, ``iteration_1`` for the
    next and so on, ``seq`` numbering the values of a name within one
    iteration when it has several, then one column per name (every logged
    name if none are given).  Ranks other than 0 of data-parallel records
    are left out.

    A name's *level* is the number of those index columns it needs: 1 for a
    value logged once per main-loop iteration, 2 for one logged in every
    batch (``seq``) or in a nested flor.generator, 0 for one logged outside
    the main loop.  One frame holds one level: when the names span levels,
    pass ``level=`` or use `flor.dataframes`, which returns every level's
    frame; otherwise a ValueError says which names are where.

    Printed lines are stored too, one name per print statement:
    ``stdout@train.py:57`` (recorded line numbers); a statement that replay
    added is named by its function and text, ``stdout@train.py:train~3fa2c1d0``,
    so that it keeps its name when lines above it come and go (its old name
    by its line, ``stdout@train.py:new:57``, still works).  They are
    returned only when named.  `flor.names` lists what can be asked for.

    `where` keeps the runs for which an expression of their parameters and
    of what they logged holds (``"lr <= 0.01 and max(val_acc) > 0.9"``);
    `sort` orders them (``"-max(val_acc)"``): see docs/results.md, Queries."""
    from . import frames
    from .store import Store

    store = Store(create=False)
    run, runs, ordered = _queried(store, script, run, runs, where, sort)
    return frames.dataframe(store, names, script=script, run=run, runs=runs, level=level,
                            ordered=ordered)


def dataframes(*names: str, script: str | None = None, run: str | None = None,
               runs=None, where: str | None = None, sort: str | None = None) -> dict:
    """{level: DataFrame}: one `flor.dataframe` per loop level of the names
    (every logged name if none are given), so that per-epoch values are not
    padded with NaN in rows of per-batch ones; `where` and `sort` as there."""
    from . import frames
    from .store import Store

    store = Store(create=False)
    run, runs, ordered = _queried(store, script, run, runs, where, sort)
    return frames.dataframes(store, names, script=script, run=run, runs=runs, ordered=ordered)


def _queried(store, script, run, runs, where, sort):
    """(run, runs, ordered) for the frames: as given, or the ids of the runs
    that `where` keeps, in the order of `sort`."""
    if where is None and sort is None:
        return run, runs, False
    from .query import select

    return None, select(store, script, run, runs, where, sort), True


def names(script: str | None = None, run: str | None = None, runs=None):
    """What `flor.dataframe` can be asked for in the same runs (see there),
    as a pandas DataFrame of one row per name, by level, with columns
    ``name``, ``level``, ``kind`` ("log", "printed", or "printed number":
    a number in printed lines), ``values`` (how many, in all the runs),
    ``runs`` (the ids of those that have it), ``where`` (``file:line`` of
    the statement) and ``source`` (the statement's text, from the run's
    kept source)."""
    from . import frames
    from .store import Store

    return frames.names_frame(Store(create=False), script=script, run=run, runs=runs)
