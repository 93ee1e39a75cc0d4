"""A record's state read back: the objects its main loop carried at the end
of an iteration the record checkpointed, by the names the script gave them.

A record's iteration checkpoints (flor/runtime/carry.py) hold what the main
loop carries into its next iteration: hands-free, the script's own names
(``model``, ``optimizer``, ``self.scheduler``); with the manual API, the
objects given as ``flor.generator(..., state=(...))``, by position.  Modules,
optimizers, LR schedulers and scalers are held as their state dicts, so
that what comes back loads into the user's own objects:

    ck = flor.state("latest")                     # the record's last one
    model.load_state_dict(ck["model"])
    ck.restore(model=model, optimizer=optimizer)  # the same, for several

Files are read as replay reads them: refused unless their header tag is the
one this record wrote for that iteration, unpickled in full only where the
user's key signs them (safe mode otherwise), every section checked against
its CRC before use.
"""
from __future__ import annotations

import bisect
import operator
import os
import re
from collections.abc import Mapping

from .checkpoint import read
from .checkpoint import restore as restore_object
from .context import top_key
from .errors import FlorError, StoreError
from .layout import checkpoint_path
from .runtime.blockstate import UNREADABLE, belongs, expected, tag, tag_run
from .store import Store

__all__ = ["RecordedState", "state", "state_iterations", "main_loop_checkpoints"]


class RecordedState(Mapping):
    """The state a record's main loop carried out of one iteration: a
    mapping from the script's names (hands-free) or positions (the manual
    API's ``state=``) to what was saved, state dicts for objects that have
    one.  ``run``, ``loop`` (``file:line``), ``iteration`` and ``path`` say
    where it comes from; ``read`` is "signed" (the user's key signs the
    file, read in full) or "safe" (read in safe mode)."""

    def __init__(self, run, loop, iteration, path, read, keys, values):
        self.run, self.loop, self.iteration, self.path, self.read = \
            run, loop, iteration, path, read
        self._items = dict(zip(keys, values))

    def __getitem__(self, key):
        try:
            return self._items[key]
        except KeyError:
            raise KeyError(f"{key!r}: the main loop of run {self.run} carried "
                           f"{list(self._items)}") from None

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __repr__(self):
        return (f"RecordedState(run={self.run!r}, loop={self.loop!r}, "
                f"iteration={self.iteration}, keys={list(self._items)})")

    def restore(self, *objects, **named):
        """Load the saved state into the live objects, in place
        (`flor.restore`: ``load_state_dict`` for a module or optimizer,
        ``copy_`` for a tensor): positionally in the order of the keys, or
        by name (``ck.restore(model=model, optimizer=opt)``).  Returns the
        restored object, or a tuple of them for several (rebind those that
        cannot change in place, such as an int)."""
        keys = list(self._items)
        if len(objects) > len(keys):
            raise TypeError(f"{len(objects)} objects given, and run {self.run}'s main loop "
                            f"carried {len(keys)}: {keys}")
        pairs = list(zip(keys, objects))
        for name, obj in named.items():
            if name not in self._items:
                self[name]  # raises KeyError, naming what there is
            if name in keys[:len(objects)]:
                raise TypeError(f"{name!r} given twice, by position and by name")
            pairs.append((name, obj))
        out = tuple(restore_object(obj, self._items[key]) for key, obj in pairs)
        return out[0] if len(out) == 1 else out


def _record(store: Store, run, script):
    """The record run `run` names (an id, a unique prefix, a name, or
    ``latest``: the newest record, of `script` if given)."""
    if run is not None and (type(run) is not str or not run):
        raise TypeError(f"run must name a record (its id, a prefix of it, its name, or "
                        f"'latest'), not {run!r}; the iteration is the second argument")
    path = os.path.abspath(script) if script is not None else None
    rid = store.resolve(run if run is not None else "latest", "record", path)
    row = store.run(rid) if rid is not None else None
    if row is None:
        replay = store.resolve(run, "replay", path) if run not in (None, "latest") else None
        row = store.run(replay) if replay is not None else None
        if row is not None:
            raise FlorError(f"run {replay} is a replay; the state it starts from is its "
                            f"record's: flor.state({row['parent']!r})")
        what = f"record of {script}" if script is not None else "record"
        raise FlorError(f"no {what} {run or 'latest'!r} in {store.root} (`flor runs` lists "
                        "the runs)")
    if row["kind"] != "record":
        raise FlorError(f"run {rid} is a replay; the state it starts from is its record's: "
                        f"flor.state({row['parent']!r})")
    if row["info"].follower:  # rank 0 writes the replicated state (the model's parameters)
        raise FlorError(f"run {rid} is rank {row['info'].rank} of the data-parallel record "
                        f"{row['info'].group}, whose state rank 0 keeps: "
                        f"flor.state({row['info'].group!r})")
    return row


def main_loop_checkpoints(store: Store, run) -> list[dict]:
    """The written iteration checkpoints of `run`'s main loop, by iteration."""
    if not run["main_loop"]:
        return []
    main = top_key(run["main_loop"], run["main_run"])
    ckpt_dir = store.layout.ckpt_dir(run["run_id"])
    rows = {}
    for r in store.iteration_checkpoints(run["run_id"]):
        try:  # a name that is not a file of the run's directory is never followed
            there = r["top"] == main and os.path.exists(checkpoint_path(ckpt_dir, r["file"]))
        except StoreError:
            there = False
        if there:
            rows[r["top_iter"]] = r
    return [rows[i] for i in sorted(rows)]


def state_iterations(run: str | None = "latest", *, script: str | None = None) -> list[int]:
    """The iterations of a record's main loop whose end state the record
    checkpointed (and whose files are there), in order: what
    `flor.state` can read back.  `run` and `script` as there."""
    store = Store(create=False)
    return [r["top_iter"] for r in main_loop_checkpoints(store, _record(store, run, script))]


def state(run: str | None = "latest", iteration: int | None = None, *,
          script: str | None = None, map_location="cpu") -> RecordedState:
    """The state a record's main loop carried out of `iteration` (default:
    the last iteration it checkpointed), as a `RecordedState`: a mapping
    from the script's names for what the loop carries (``model``,
    ``optimizer``, ``scheduler``, ``step``) to what the record saved,
    modules, optimizers and schedulers as their state dicts.

    `run`: a record's id, a unique prefix of it, its name, or ``latest``
    (the newest record, of `script` if given).  `iteration`: a main-loop
    iteration, counted from 0 as `flor.dataframe` counts them, that the
    record checkpointed (`flor.state_iterations` lists them; the adaptive rule
    and thinning decide which).  `map_location`: as in `flor.load`; by
    default every tensor comes back on the CPU."""
    store = Store(create=False)
    run_row = _record(store, run, script)
    rid = run_row["run_id"]
    rows = main_loop_checkpoints(store, run_row)
    if not rows:
        raise FlorError(
            f"run {rid} has no iteration checkpoint of its main loop: the adaptive rule took "
            "none (`flor record --no-adaptive` takes one at every iteration), the loop "
            "carries what flor cannot checkpoint (the record said so as it ran), or, with "
            "the manual API, its flor.generator was given no state=")
    if iteration is None:
        row = rows[-1]
    else:
        given = iteration
        try:  # an int, numpy's included (flor.dataframe's iteration column)
            iteration = operator.index(iteration) if type(iteration) is not bool else None
        except TypeError:
            iteration = None
        if iteration is None:
            raise TypeError(f"iteration must be an int, not {type(given).__name__}")
        have = [r["top_iter"] for r in rows]
        at = bisect.bisect_left(have, iteration)
        if at == len(have) or have[at] != iteration:
            near = sorted({have[i] for i in (at - 1, at) if 0 <= i < len(have)})
            nearest = (f"the nearest it checkpointed are {near[0]} and {near[1]}"
                       if len(near) == 2 else f"the nearest it checkpointed is {near[0]}")
            raise FlorError(
                f"run {rid} has no checkpoint of iteration {iteration} of its main loop; "
                f"{nearest} (flor.state_iterations({rid!r}) lists all {len(have)})")
        row = rows[at]
    path = checkpoint_path(store.layout.ckpt_dir(rid), row["file"])
    want = expected(tag(row["block"], row["ctx"], 0), tag_run(rid, run_row["info"]))
    seen: list = []
    try:  # as replay reads it: the tag first, in full only where the user's key signs it
        saved = read(path, map_location, "signed", want, seen)
    except UNREADABLE as e:
        raise FlorError(f"{path} cannot be read back: {e}") from None
    if not belongs(saved, row["block"], row["ctx"], 0):
        raise FlorError(f"{path} is not the checkpoint of iteration {row['top_iter']} of run "
                        f"{rid}")
    sig, objs = list(saved["sig"]), list(saved["objs"])
    named = saved.get("named")
    if named is None:  # a record made before checkpoints said
        named = not all(_TYPE.fullmatch(label) for label in sig)
    keys = _keys(sig) if named else list(range(len(objs)))
    return RecordedState(rid, run_row["main_loop"], row["top_iter"], path, seen[0], keys, objs)



#: How the manual API's signature names an object: by its type, a module and
#: a class (``torch.nn.modules.linear.Linear``, ``builtins.int``).
_TYPE = re.compile(r"(builtins|numpy|torch)\.\w+(\.\w+)*|[A-Za-z_]\w*(\.\w+)*\.[A-Z]\w*")


def _keys(sig) -> list[str]:
    """The script's names in a hands-free signature: a label is a name or
    an attribute path (``model``, ``self.model``), ``global NAME`` for a
    module's variable, or ``NAME: why the loop carries it`` for what the
    analysis added (the module an optimizer's parameters live in).  A name
    met twice is told apart by its count: ``parameters``, ``parameters#2``."""
    keys, seen = [], {}
    for label in sig:
        name = label.split(": ", 1)[0]
        name = name[len("global "):] if name.startswith("global ") else name
        seen[name] = seen.get(name, 0) + 1
        keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return keys
