"""The two ways a script process starts: recording a script (``flor
record``: instrumenting it hands-free, SIGTERM, argv, the summary it
prints) and replaying one segment of a plan (a replay worker, or
``replay --part I/N``, which stores into a database of the part's own that
merge imports).  Each sets up its Session (session.py) with its policy
(recording.py, replaying.py) and runs the script as __main__ (script.py).
"""
from __future__ import annotations

import atexit
import linecache
import os
import signal
import sys
import traceback
from contextlib import nullcontext

from .. import huggingface  # (importing it registers the Trainer's follower with effects.py)
from ..context import is_iteration, is_outermost, iteration_key, location
from ..errors import INTERRUPTIONS, FlorError, Interrupted, note
from ..program.frameworks import unfollowed
from ..program.instrument import instrument, uses_flor
from ..replay.plan import Plan
from ..store import Store
from . import blockstate
from .charge import UNCAPTURED
from . import resume as resuming
from .project import Instrumenting, modules_of, recording_keys, replay_keys
from .script import run_main
from .session import Session

__all__ = ["record_script", "run_part", "summary", "never_checkpointed"]


def _evicted(signum, frame):
    raise Interrupted()


def record_script(script, args, epsilon=None, adaptive=None, resume=False, force=False,
                  keep=None, labels=None) -> int:
    """``python -m flor record``: run `script` with `args` as ``__main__``,
    recording it (hands-free if it does not import flor); print the summary.
    `resume`: continue the latest interrupted record of `script` instead
    (with its arguments when `args` is None)
    (`force`: even if the script or its arguments changed).  `keep`: the
    iteration checkpoints kept of each loop (runtime/thinning.py).  `labels`:
    the run's name, tags and note, as flor/runs.py `label` takes them.  While the
    script runs, SIGTERM (when the script's process has no handler of its
    own) ends it as Interrupted; that and Ctrl-C leave the run interrupted,
    to continue with ``record --resume``.  Returns the script's exit status."""
    with open(script) as f:
        source = f.read()
    inst = None
    modules = None
    if not uses_flor(source):  # hands-free: instrument the unmodified script
        rel = os.path.basename(script)
        modules = modules_of(script)
        try:
            inst = instrument(source, os.path.abspath(script), lambda line: location(rel, line),
                              modules)
        except SyntaxError as e:
            traceback.print_exception(e, limit=0)
            return 1
    point = None
    if resume:
        store = Store(create=False)
        point = resuming.find(store, script, args, force)
        if args is None:  # no ARGS: the interrupted record's
            args = store.run(point.run_id)["argv"][1:]
    session = Session.record(script, [script, *args], epsilon=epsilon, adaptive=adaptive,
                             hands_free=inst, resume=point, keep=keep)
    if labels and any(labels.values()):
        from ..runs import label, remove

        if session.policy.row.info.follower:  # (listed under rank 0's run, which is named)
            labels = dict(labels, name=None)
        try:
            label(session.store, session.run_id, **labels)
        except FlorError:  # another record took the name meanwhile: this one never ran
            session.finish()
            remove(session.store, [session.run_id])
            raise
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    own = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if own:
        signal.signal(signal.SIGTERM, _evicted)
    def instrumented(path, rel, source, module):
        session.project_files.add(path)
        session.policy.instrumented_module(rel, source, module)

    hook = Instrumenting(os.path.dirname(os.path.abspath(script)), recording_keys(script),
                         instrumented, modules) if inst is not None else nullcontext()
    try:
        with hook:
            code, error = run_main(script, sys.stderr, inst.code if inst is not None else None)
    finally:
        if own:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    session.finish(error)
    if isinstance(error, FlorError):
        note(str(error))
        return 2
    if session.policy.restored and not isinstance(error, INTERRUPTIONS):
        for line in summary(session.store, session.run_id):
            note(line)
    return code


def summary(store, run_id) -> list[str]:
    """What a finished record stored: iterations, checkpoints and bytes, and
    a note for each outermost block the adaptive rule never checkpointed."""
    run = store.run(run_id)
    if run["status"] == "empty":
        libraries = unfollowed(sys.modules, huggingface.followed(sys.modules))
        if libraries:
            return [f"run {run_id} of {run['script_name']} ran no loop of flor's: its training "
                    f"ran inside {' and '.join(libraries)}, whose loop flor does not follow yet "
                    "(it follows loops written in the script and the project's own modules, "
                    "PyTorch Lightning's "
                    "Trainer.fit and the Trainer.train of transformers 5.3 and later: "
                    "docs/hands-free.md, docs/lightning.md, docs/huggingface.md). Replay never "
                    f"picks this run; `flor rm {run_id}` deletes it"]
        return [f"run {run_id} of {run['script_name']} ended before any loop of flor's ran "
                f"(a --help run, or an exit before the main loop): replay never picks it; "
                f"`flor rm {run_id}` deletes it"]
    decisions = store.notable_decisions(run_id, UNCAPTURED, blockstate.UNHELD)
    ckpt_dir = store.layout.ckpt_dir(run_id)
    def size(rows):
        return sum(os.path.getsize(os.path.join(ckpt_dir, d["file"])) for d in rows
                   if d["file"] and os.path.exists(os.path.join(ckpt_dir, d["file"]))) / 2**20

    # Checkpoints whose files exist: a write that failed (a full disk) is not one.
    written = [d for d in decisions if d["checkpoint"] and d["file"]
               and os.path.exists(os.path.join(ckpt_dir, d["file"]))]
    ckpts = [d for d in written if not is_iteration(d["block"])]
    iters = [d for d in written if is_iteration(d["block"])]
    more = f" and {len(iters)} iteration checkpoints ({size(iters):.1f} MiB)" if iters else ""
    return [f"recorded run {run_id} of {run['script_name']}: {run['iterations']} iterations of "
            f"the main loop, {len(ckpts)} checkpoints ({size(ckpts):.1f} MiB){more} in "
            f"{store.root}", *never_checkpointed(decisions, run["main_loop"])]


def never_checkpointed(decisions, main_loop=None):
    """A note for each outermost block that ran but was never checkpointed:
    what the adaptive rule weighed at its last execution, and the way out;
    of top-level loops, only the run's `main_loop` (where given: another,
    such as an evaluation's loop run once after it, is no main loop).
    (A state that cannot be checkpointed was noted when the record met it.)"""
    last, taken, unheld_loops, loops = {}, set(), {}, {}
    for d in decisions:
        if UNCAPTURED in (d["reason"] or ""):
            taken.add(d["block"])
        elif is_outermost(d["ctx"]) and not is_iteration(d["block"]):
            last[d["block"]] = d
            if d["checkpoint"]:
                taken.add(d["block"])
        elif is_iteration(d["block"]):
            loops[d["block"]] = d
            if d["checkpoint"]:
                taken.add(d["block"])
            if blockstate.UNHELD in (d["reason"] or ""):
                unheld_loops.setdefault(d["block"], d)
    for block, d in loops.items():
        if main_loop is not None and block != iteration_key(main_loop):
            continue
        if block not in taken and block not in unheld_loops:
            yield (f"the main loop {block[:-len(' (iteration)')]} was never checkpointed, so "
                   "replay workers reach their segments by running the iterations before them "
                   f"(the rule at its last decision, after {d['n']} iterations: {d['reason']}); "
                   "a larger --epsilon allows more record overhead")
    unheld_loops = unheld_loops.values()
    for block, d in last.items():
        if block in taken:
            continue
        if blockstate.UNHELD in d["reason"]:
            yield (f"block {block} ran {d['n']} times and was never checkpointed, so replay "
                   f"re-executes it: it changes what no checkpoint holds "
                   f"({d['reason'].split('none holds ', 1)[-1]})")
        else:
            yield (f"block {block} ran {d['n']} times and was never checkpointed, so replay "
                   f"re-executes it (the rule at its last execution: {d['reason']}); "
                   "`python -m flor record --no-adaptive` checkpoints every execution, a "
                   "larger --epsilon allows more record overhead")
    for d in unheld_loops:
        yield (f"the main loop {d['block'][:-len(' (iteration)')]} carries what no checkpoint "
               f"holds ({d['reason'].split('none holds ', 1)[-1]}): replay workers reach "
               "their segments by running the iterations before them")


def run_part(plan: Plan, part: int, tee=False, own_db=False, progress_fd=None,
             resume=True, forked=False) -> int:
    """Run segment `part` of the plan in this process (a worker, or --part):
    `tee` also shows the script's stdout, `own_db` stores into the part's
    own database (or into the database file it names), `progress_fd`
    reports the replayed iterations (replaying.REPORT_S), `resume` starts
    from an iteration checkpoint where the plan has one; a worker `forked`
    from the fork server has the script's directory on sys.path already
    (set before its imports, which may have put paths before it)."""
    store = Store(plan.store)
    if own_db:
        db = own_db if isinstance(own_db, str) else store.layout.part_db(plan.replay_id, part)
        store = Store(plan.store, db_file=db)
        if plan.threads and "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(plan.threads)  # before the script imports torch
    session = Session.replay(plan, part, store=store, tee=tee, progress_fd=progress_fd,
                             resume=resume)
    if session.effects.files is not None:  # (after the script's own exit handlers)
        atexit.register(session.effects.files.flush_open)
    script = plan.script
    sys.argv = list(plan.argv)
    if not forked:
        sys.path[0] = os.path.dirname(script)
    instrumented = plan.code()
    if plan.source is not None:  # a traceback shows the lines run, not the file's
        linecache.cache[script] = (len(plan.source), None, plan.source.splitlines(True), script)
    modules = (plan.hands_free or {}).get("modules") or []
    hook = Instrumenting(os.path.dirname(script), replay_keys(script, modules, plan.files),
                         lambda path, *_: session.project_files.add(path), modules_of(script)) \
        if modules else nullcontext()
    error, code = None, 0
    try:
        with hook:
            code, error = run_main(script, sys.__stderr__, instrumented)
    finally:
        session.finish(error)
    return code
