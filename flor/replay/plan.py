"""The plan of a replay: what changed, which checkpoints exist, and how the
main loop is split among workers.

    plan = what changed in the program (blocks to step into, line maps), the
           recorded checkpoints, and the main loop's iterations split into
           contiguous segments whose boundaries fall just after checkpointed
           iterations, balanced by the times the record measured

A `Plan` is written once, to ``.flor/runs/<replay>/plan.json``, by the
process that plans the replay, and read by every worker and by merge.  It
holds only what is true of the replay wherever it runs: no process-local
value (a file descriptor, a thread count) belongs in it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import marshal
import os
import shlex
from dataclasses import dataclass

from ..context import is_epoch, is_iteration, is_outermost, location, statement_at, top_key
from ..errors import FlorError, note
from ..program.instrument import instrument
from ..program.probe import detect
from ..program.frameworks import EPOCH_END
from ..program.source import (Comparison, FileMap, changed_functions, changed_outside,
                              manual_blocks, map_files, passed_as_values)
from ..runinfo import ReplayInfo
from ..runtime import ranks as ranking
from ..runtime.project import modules_of
from ..seal import check_plan, check_run, seal_plan
from ..store import Store, new_run_id
from .estimate import ALL_JOBS_ENV, planning_notes, workers_that_pay
from .segments import (SEGMENTS_ENV, Costs, forced_segments, iteration_costs, main_iteration,
                       partition, resume_points, segments_for)

__all__ = ["Plan", "plan_replay", "instrument_current",
           "register", "describe", "worker_threads"]


@dataclass(frozen=True)
class Plan:
    """Typed in memory; `save` and `load` are the one JSON form."""

    store: str  # the run store's root
    script: str  # absolute path of the edited script
    argv: tuple[str, ...]  # (script, *args) as the workers run it
    record: str  # the recorded run replayed
    replay_id: str
    segments: tuple[tuple[int, int], ...]  # [start, end) of main-loop iterations, per part
    probed: frozenset[str]  # blocks to step into
    changed_end: frozenset[str]  # blocks whose end() call changed: checkpoints not used
    files: dict[str, FileMap]  # by path relative to the script's directory
    checkpoints: dict[tuple[str, str, int], str | None]  # (block, ctx, occurrence) -> file
    # name; None where the record checkpointed it but replay runs it on every rank
    ckpt_dir: str
    main_loop: str | None
    main_run: int | None
    iterations: int
    epsilon: float
    c: float
    hands_free: dict | None  # {"hindsight", "other", "blocks"} for a hands-free record
    tolerance: float | None = None  # --tolerance REL for the deferred checks
    threads: int | None = None  # torch intra-op threads of each worker
    workers: int | None = None  # local worker processes (segments may be more)
    resume: dict[int, str] = dataclasses.field(default_factory=dict)  # iteration i -> the
    # file of its iteration checkpoint: a segment starting at i + 1 starts there
    ranks: dict | None = None  # a data-parallel record: {"rank", "size", "ckpt_dirs" (by
    # rank), "ports" (by segment: its process group's)}; flor/runtime/ranks.py
    ended: bool = False  # the record's main loop ended with its iterable (not by a
    # break): the last part draws it to its end too, so its code after the last item runs
    changed_functions: frozenset[str] = frozenset()  # functions whose code changed
    sealed: bool = False  # the record's seal verified with this user's key, which then
    # signed its checkpoints: one whose signature does not verify is refused
    # The script's text that the workers run where it is not the file's: the
    # record's version with the statements added to the script carried onto
    # it (replay --runs, flor/program/transplant.py).
    source: str | None = None
    # A hands-free replay's instrumented script, compiled once by the process
    # that plans; saved beside plan.json (not in it), compiled again only by
    # a worker of another Python version (see code()).
    instrumented: object = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "instrumented"}
        data.update(argv=list(self.argv), segments=[list(s) for s in self.segments],
                    probed=sorted(self.probed), changed_end=sorted(self.changed_end),
                    changed_functions=sorted(self.changed_functions),
                    files={rel: f.to_json() for rel, f in self.files.items()},
                    checkpoints=[[*k, f] for k, f in self.checkpoints.items()],
                    resume={str(i): f for i, f in self.resume.items()})
        for optional in ("tolerance", "threads", "workers", "ranks", "source"):
            if data[optional] is None:
                del data[optional]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in names - {"instrumented"}}
        data.update(argv=tuple(data["argv"]), segments=tuple(tuple(s) for s in data["segments"]),
                    probed=frozenset(data["probed"]),
                    changed_end=frozenset(data["changed_end"]),
                    changed_functions=frozenset(data.get("changed_functions", ())),
                    files={rel: FileMap.from_json(f) for rel, f in data["files"].items()},
                    checkpoints={(b, c, int(o)): f for b, c, o, f in data["checkpoints"]},
                    resume={int(i): f for i, f in data.get("resume", {}).items()})
        return cls(**data)

    def save(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        code = None  # the compiled script beside the plan, which its seal covers
        if self.instrumented is not None:
            try:
                data = marshal.dumps(self.instrumented)
            except ValueError:  # a constant marshal cannot write: workers instrument
                data = None
            if data is not None:
                code = importlib.util.MAGIC_NUMBER + data
                _write(_code_path(path), code)
        _write(path, json.dumps(seal_plan(self.to_json(), code)).encode())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            text = json.load(f)
        try:
            with open(_code_path(path), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = None
        plan = cls.from_json(check_plan(text, data, path))
        if data is None:
            return plan
        magic = importlib.util.MAGIC_NUMBER
        if not plan.hands_free or not data.startswith(magic):
            return plan  # planned by another Python: code() compiles it again
        return dataclasses.replace(plan, instrumented=marshal.loads(data[len(magic):]))

    def threads_per_worker(self, cores: int, workers: int) -> int:
        """Torch threads of each worker: the plan's (as given, else the
        record's), else the `cores` shared among the `workers`."""
        return self.threads or max(1, cores // max(1, workers))

    def text(self) -> str:
        """The script's text that the replay runs."""
        if self.source is not None:
            return self.source
        with open(self.script) as f:
            return f.read()

    def code(self):
        """The code a worker runs for the script: None for the script file
        itself (manual API), else its instrumented code (hands-free), or the
        compiled `source` that the plan carries."""
        if not self.hands_free:
            return None if self.source is None else compile(self.source, self.script, "exec",
                                                            dont_inherit=True)
        if self.instrumented is not None:
            return self.instrumented
        fmap = self.files.get(os.path.basename(self.script))
        return instrument_current(self.text(), self.script, fmap.lines if fmap else {}).code


def _code_path(plan_path: str) -> str:
    return os.path.join(os.path.dirname(plan_path), "instrumented.code")


def _write(path: str, data: bytes):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def instrument_current(source, script, lines: dict, rel=None, modules=None):
    """Instrument the current script of a hands-free replay (or the module
    of the project at `rel`, relative to the script's directory), naming
    each loop and block by its line in the recorded file (``file:new:N`` if
    new); `lines` maps current lines to recorded ones."""
    path = os.path.abspath(script if rel is None else
                           os.path.join(os.path.dirname(os.path.abspath(script)), rel))
    rel = rel or os.path.basename(script)
    return instrument(source, path,
                      lambda line: location(rel, line, lines.get(line), mapped=True),
                      modules if modules is not None else modules_of(script),
                      imported=path != os.path.abspath(script))


def _arguments(rec, script, args, differ_ok) -> list:
    """The script's arguments for the replay: the recorded ones when none
    are given; given ones that differ only with `differ_ok`."""
    recorded = rec["argv"][1:]
    if args is None:
        return recorded
    if list(args) != recorded and not differ_ok:
        def show(a):
            return " ".join(shlex.quote(x) for x in a) or "(none)"
        raise FlorError(
            f"run {rec['run_id']} recorded {os.path.basename(script)} with the arguments "
            f"{show(recorded)}, and this replay gives {show(args)}. Replay with the recorded "
            "ones (give none, or the same), or pass --args-differ-ok to replay with others "
            "(values that depend on them will differ from the record's)")
    return list(args)


def _pick_record(store: Store, script: str, run_id):
    if run_id is not None:
        rec = store.run(run_id)
        if rec is None or rec["kind"] != "record":
            raise FlorError(f"no recorded run {run_id!r} in {store.root}; "
                            "`flor runs` lists them")
        return rec
    rec = store.latest_record(script)
    if rec is None:
        name = os.path.basename(script)
        others = store.records(script)
        if others:
            newest = others[0]
            raise FlorError(
                f"no record of {name} in {store.root} can be replayed: the latest, run "
                f"{newest['run_id']}, is {store.status(newest)}" +
                (" (it ended before its main loop)" if newest["status"] == "empty" else "")
                + f". `flor show {newest['run_id']}` says more; replay it anyway with --run "
                f"{newest['run_id']}, or record again: flor record {script}")
        raise FlorError(f"no recorded run of {name} in {store.root} (FLOR_DIR, default "
                        f"./.flor); record it first (flor record {script}), or point FLOR_DIR "
                        "at the store that holds its record")
    newest = store.records(script)[0]
    if newest["run_id"] != rec["run_id"]:
        note(f"the latest record of {os.path.basename(script)}, run {newest['run_id']}, "
             f"{store.status(newest)}; replaying run {rec['run_id']}")
    return rec


def _this_rank(store, script, args, rec):
    """(the record of this process's rank, the runs of all ranks or None):
    a data-parallel record is replayed under torchrun with its world size,
    each rank replaying its own rank's record."""
    runs = ranking.group_runs(store, rec)
    w = ranking.world()
    name = os.path.basename(script)
    command = " ".join(shlex.quote(a) for a in [script, *args])
    if runs is None:
        if w is not None:
            raise FlorError(f"run {rec['run_id']} of {name} was recorded by one process; "
                            f"replay it without torchrun: python -m flor replay {command}")
        return rec, None
    if w is None or w[1] != len(runs):
        raise FlorError(f"run {rec['run_id']} of {name} was recorded by {len(runs)} "
                        f"data-parallel ranks; replay it under torchrun with as many: torchrun "
                        f"--nproc_per_node {len(runs)} -m flor replay {command}")
    return runs[w[0]], runs


def _interrupted(store, rec):
    """A note when `rec` was interrupted: how far replay goes."""
    if store.status(rec) != "interrupted":
        return []
    return [f"run {rec['run_id']} was interrupted after {rec['iterations']} iterations of its "
            "main loop: replay covers those, then runs the code after the loop as the script "
            "does (`python -m flor record --resume` completes the record)"]


def _compare(store, script, rec, source=None):
    """(Comparison, hands-free summary or None, the instrumented code or
    None, the current sources: the script's is `source` where given)."""
    recorded = store.layout.module_sources(rec["run_id"])
    if None not in recorded:
        raise FlorError(f"the source of run {rec['run_id']} is missing from {store.root}")
    base = os.path.dirname(os.path.abspath(script))
    old, new = {}, {}
    for rel, text in recorded.items():
        rel = rel or os.path.basename(script)
        old[rel] = text
        path = os.path.join(base, rel)
        if source is not None and rel == os.path.basename(script):
            new[rel] = source
        elif os.path.isfile(path):
            with open(path) as f:
                new[rel] = f.read()
    cmp = Comparison(files=map_files(old, new), changed_functions=changed_functions(old, new),
                     training_changed=changed_outside(old, new, EPOCH_END))
    hands_free = code = None
    if rec["info"].hands_free:
        # What to step into: the blocks that hold (or reach) a change.
        rel = os.path.basename(script)
        lines = cmp.files[rel].lines if rel in cmp.files else {}
        modules = modules_of(script)
        inst = instrument_current(new[rel], script, lines, modules=modules)
        probe = detect(old[rel], new[rel], inst, cmp.changed_functions)
        cmp.probed = probe.probed
        summary = inst.summary()
        hands_free = {"hindsight": probe.hindsight, "other": probe.other,
                      "blocks": summary["blocks"], "grads": [], "grads_loops": []}
        code = inst.code
        _gradients_read_anew(cmp, hands_free, store.layout.handsfree_summary(rec["run_id"]),
                             summary)
        _compare_modules(cmp, hands_free, script, old, new,
                         store.layout.handsfree_modules(rec["run_id"]), modules)
        # A changed function handed to other code as a value (a callback)
        # may run in any block: every block runs.
        hands_free["passed"] = sorted(passed_as_values(new, cmp.changed_functions))
        if hands_free["passed"]:
            cmp.probed |= {b["key"] for b in hands_free["blocks"]}
    else:
        cmp.probed, cmp.changed_end, cmp.added = manual_blocks(old, new, cmp.files,
                                                               cmp.changed_functions)
    return cmp, hands_free, code, new


def _compare_modules(cmp, hands_free, script, old, new, modules, analysis):
    """The project's modules the record instrumented (runtime/project.py),
    compared as the script is: their blocks holding or reaching a change
    are probed, and their statements count as hindsight or other, at
    ``file:line``.  `hands_free["modules"]` names them for the workers."""
    for rel in sorted(modules):
        if rel not in new:
            hands_free["other"].append((rel, "removed: the module is not in the project now"))
            continue
        lines = cmp.files[rel].lines if rel in cmp.files else {}
        inst = instrument_current(new[rel], script, lines, rel=rel, modules=analysis)
        probe = detect(old[rel], new[rel], inst, cmp.changed_functions)
        cmp.probed |= probe.probed
        summary = inst.summary()
        _gradients_read_anew(cmp, hands_free, modules[rel], summary)
        hands_free["hindsight"] += [(f"{rel}:{line}", text) for line, text in probe.hindsight]
        hands_free["other"] += [(f"{rel}:{line}", text) for line, text in probe.other]
        hands_free["blocks"] += summary["blocks"]
    hands_free["modules"] = sorted(rel for rel in modules if rel in new)


def _gradients_read_anew(cmp, hands_free, recorded: dict, current: dict):
    """Blocks and loops after which the current script reads the parameters'
    gradients where the recorded one did not (a hindsight statement that
    prints a gradient norm after the batch loop): the record's checkpoints
    of them do not hold the gradients (program/gradients.py), so such a
    block runs again, and such a loop is not started from its iteration
    checkpoints.  `recorded` and `current` are summaries as handsfree.json's."""
    def live(summary, kind):
        return {x["key"]: x.get("grads", False) for x in summary.get(kind) or []}
    for kind, into in (("blocks", "grads"), ("loops", "grads_loops")):
        before = live(recorded, kind)
        anew = sorted(k for k, now in live(current, kind).items()
                      if now and not before.get(k, False))
        hands_free[into] += anew
        if kind == "blocks":
            cmp.probed |= set(anew)


def worker_threads(rec, jobs: int, threads=None, cores=None):
    """(torch threads per worker, workers, notes): the record's thread count
    unless `threads` says otherwise, and no more workers than `cores` (when
    given) can run at that count without oversubscribing them.  A script
    that sets its own count (the record ran another than OMP_NUM_THREADS
    asked for) runs it in every worker, whatever `threads` says."""
    info = rec["info"]
    recorded = info.threads
    own = bool(recorded and info.threads_asked and recorded != info.threads_asked)
    notes = []
    if own and threads and threads != recorded:
        notes.append(f"the script sets its own torch thread count ({recorded} in the record, "
                     f"where OMP_NUM_THREADS asked for {info.threads_asked}): each worker "
                     f"runs {recorded} thread{'s' if recorded > 1 else ''}, not {threads}")
        threads = None
    chosen = threads or recorded
    if cores is not None:
        if chosen is None:
            chosen = max(1, cores // jobs)
        allowed = max(1, cores // chosen)
        whose = "as given" if threads else "the script's own" if own else "the record's"
        if jobs > allowed:
            notes.append(f"--jobs {jobs} asks for {jobs} workers of {chosen} torch threads "
                         f"each ({whose}), and {cores} cores are available: replaying with "
                         f"{allowed} worker{'s' if allowed > 1 else ''}"
                         + ("; --threads N runs more workers of fewer threads, but CPU "
                            "values may then differ in their last bits"
                            if not threads and not own else ""))
            jobs = allowed
        if chosen > cores:
            notes.append(f"each worker runs {chosen} torch threads ({whose}) on {cores} "
                         "available cores")
    return chosen, jobs, notes


def plan_replay(store: Store, script: str, args, jobs: int, run_id=None, part=None,
                tolerance=None, threads=None, cores=None, args_differ_ok=False, source=None):
    """Plan the replay of the latest finished record of `script` (or `run_id`)
    with `args` (None: the recorded ones) on up to `jobs` workers of
    `threads` torch threads each (the record's by default; no more workers
    than `cores` allow).  `part`: the part of a --part I/N replay, or -1 for
    Ray (one segment per worker).  Arguments that differ from the recorded
    ones are refused unless `args_differ_ok`.  `source`: the script's text
    to run instead of the file's (replay --runs).  Returns (plan, notes)."""
    if not os.path.isfile(script):
        raise FlorError(f"no such script: {script}")
    rec = _pick_record(store, script, run_id)
    args = _arguments(rec, script, args, args_differ_ok)
    rec, group = _this_rank(store, script, args, rec)
    unsealed = check_run(store, rec)  # raises where the store changed since the record
    if group is not None and part is not None:
        raise FlorError("a data-parallel record is replayed by local workers under torchrun: "
                        "--part, --parts and --backend ray do not replay it")
    asked_threads = threads
    threads, jobs, notes = worker_threads(rec, jobs, threads, cores)
    notes += _interrupted(store, rec) + ([unsealed] if unsealed else [])
    cmp, hands_free, code, new = _compare(store, script, rec, source)
    recorded = store.rows("decisions", rec["run_id"])
    epochs = {d["block"] for d in recorded if is_epoch(d["block"])}
    if epochs and (cmp.training_changed or (hands_free or {}).get("other")):
        # Code that runs in the epochs' training changed, or a change that is
        # not a hindsight statement (in an epoch-end hook too: what it
        # changes, the next epochs train with).
        cmp.probed = set(cmp.probed) | epochs
    # A data-parallel replay skips an execution on every rank or on none.
    dropped = ranking.unusable(store, group) if group is not None else {}
    for (block, ctx, occurrence), why in dropped.items():
        notes.append(f"block {block} at {ctx}, occurrence {occurrence}: {why}; it runs on "
                     "every rank")
    decisions = [dict(d, checkpoint=0, file=None)
                 if (d["block"], d["ctx"], d["occurrence"]) in dropped else d for d in recorded]
    iterations = [d for d in decisions if is_iteration(d["block"])]
    decisions = [d for d in decisions if not is_iteration(d["block"])]
    loops = store.rows("loops", rec["run_id"])
    main_top = top_key(rec["main_loop"], rec["main_run"])
    total = min(r["iterations"] or 0 for r in group or [rec])
    restorable: dict = {}
    # A worker passes the iterations before its segment by restoring their
    # blocks; one after which the script now reads the gradients cannot be.
    grads = set((hands_free or {}).get("grads", ()))
    reads_grads = set()  # iterations with such a block
    for d in decisions:
        if is_outermost(d["ctx"]):
            ok = bool(d["checkpoint"]) and d["block"] not in cmp.changed_end and \
                d["block"] not in grads
            restorable.setdefault(main_iteration(d, main_top), []).append(ok)
            if d["block"] in grads:
                reads_grads.add(main_iteration(d, main_top))
    resumable = {i for i in range(total) if all(restorable.get(i, [True]))}
    work, pseudo = iteration_costs(rec, decisions, loops, cmp.probed, cmp.changed_end)
    resume, restart = resume_points(store, rec, iterations, total)
    if rec["main_loop"] in (hands_free or {}).get("grads_loops", ()):
        resume, restart = {}, {}
        notes.append(f"an iteration of the main loop ({rec['main_loop']}) may now read the "
                     "gradients the one before left, which its iteration checkpoints do not "
                     "hold: replay runs it from its first iteration")
    segments = partition(total, segments_for(jobs, work, rec) if part is None else jobs,
                         resumable, work, pseudo, restart)
    runs = {r["run"] for r in loops if r["loop"] == rec["main_loop"] and r["depth"] == 0}
    local = part is None and group is None and len(runs) <= 1
    main_s = sum(r["seconds"] or 0.0 for r in loops if (r["loop"], r["run"], r["depth"])
                 == (rec["main_loop"], rec["main_run"], 0))
    costs = Costs(total, work, pseudo, restart)
    alone = [[0, total]]  # one worker's segments, that planning_notes compares with
    if local and jobs > 1 and len(segments) > 1 and not os.environ.get(SEGMENTS_ENV) \
            and os.environ.get(ALL_JOBS_ENV) != "1":
        # 1, 2, 4 ... workers and --jobs: a partition of a long step loop
        # takes a while, and these bound what fewer workers could save.
        options = {k: partition(total, segments_for(k, work, rec), resumable, work, pseudo,
                                restart) for k in (2 ** n for n in range(1, jobs.bit_length()))
                   if k < jobs}
        options.update({1: alone, jobs: segments})
        chosen, why = workers_that_pay(rec, main_s, options, costs)
        alone = None  # the planner compared them
        if why:
            notes.append(why)
            jobs, segments = chosen, options[chosen]
            threads = worker_threads(rec, jobs, asked_threads, cores)[0]
    if os.environ.get(SEGMENTS_ENV):
        segments = forced_segments(os.environ[SEGMENTS_ENV], total)
        for start, _ in segments:
            passed = sorted(i for i in reads_grads if i is not None and i < start)
            if passed and start not in restart:
                raise FlorError(
                    f"{SEGMENTS_ENV}: a segment cannot start at iteration {start}: its worker "
                    f"would pass over iteration {passed[-1]} by restoring a block whose "
                    "gradients the edited script now reads, which its checkpoints do not "
                    "hold; leave the planner to choose the segments")
    if local:
        notes += planning_notes(rec, main_s, segments, alone, costs, jobs)
    if len(runs) > 1:
        # A worker would have to find its segment's execution among the
        # others, and start it from a checkpoint of that execution alone.
        segments, resume = [[0, total]], {}
        notes.append(f"the main loop ({rec['main_loop']}) ran {len(runs)} times in the "
                     "record: replay neither splits it nor starts it from an iteration "
                     "checkpoint")
    group_plan = None
    if group is not None:  # every rank replays rank 0's segments
        segments, ports = ranking.share_plan(segments)
        group_plan = {"rank": ranking.world()[0], "size": len(group), "ports": ports,
                      "ckpt_dirs": [store.layout.ckpt_dir(r["run_id"]) for r in group]}
    if part is not None and part >= 0:
        # Parts run on other machines must agree on one replay id.
        digest = hashlib.sha1(json.dumps(
            [sorted(new.items()), list(args), jobs, rec["run_id"]]).encode()).hexdigest()[:10]
        replay_id = f"{rec['run_id']}-r{digest}"
    else:
        replay_id = new_run_id()
    plan = Plan(
        store=store.root, script=os.path.abspath(script), argv=(script, *args),
        record=rec["run_id"], replay_id=replay_id,
        segments=tuple(tuple(s) for s in segments),
        probed=frozenset(cmp.probed), changed_end=frozenset(cmp.changed_end),
        files=dict(cmp.files),
        checkpoints={(d["block"], d["ctx"], d["occurrence"]):
                     None if (d["block"], d["ctx"], d["occurrence"]) in dropped else d["file"]
                     for d in recorded if d["checkpoint"] and d["file"]
                     and not is_iteration(d["block"])},
        ckpt_dir=store.layout.ckpt_dir(rec["run_id"]), main_loop=rec["main_loop"],
        main_run=rec["main_run"], iterations=total, epsilon=rec["epsilon"], c=rec["c"],
        hands_free=hands_free, tolerance=tolerance, threads=threads, resume=resume,
        workers=jobs, ranks=group_plan, ended=rec["info"].main_ended,
        changed_functions=frozenset(cmp.changed_functions), source=source, instrumented=code,
        sealed=unsealed is None)
    return plan, notes


def register(store: Store, plan: Plan, mode: str):
    """Create the replay run (if new), with the script's source (and those
    of the project's modules it instruments: a statement added there is
    named from them), and write its plan next to it."""
    if store.run(plan.replay_id) is None:
        store.new_run("replay", plan.script, plan.argv, plan.text(), parent=plan.record,
                      run_id=plan.replay_id, main_loop=plan.main_loop,
                      main_run=plan.main_run, iterations=plan.iterations,
                      info=ReplayInfo(nparts=len(plan.segments), mode=mode,
                                      segments=[list(s) for s in plan.segments],
                                      probed=sorted(plan.probed)))
        for rel in (plan.hands_free or {}).get("modules") or []:
            path = os.path.join(os.path.dirname(plan.script), rel)
            try:
                with open(path) as f:
                    store.layout.save_module_source(plan.replay_id, rel, f.read())
            except OSError:
                continue
    plan.save(store.layout.plan_path(plan.replay_id))


def describe(plan: Plan, store: Store) -> list[str]:
    """What replay is about to do, as notes."""
    notes = []
    hf = plan.hands_free
    epochs = any(is_epoch(key) for key, _, _ in plan.checkpoints)
    if hf is not None and not hf["blocks"] and not epochs:
        notes.append("the script has no SkipBlock (no loop nested in a loop, no call of a "
                     "looping function of the script): replay re-executes all of it")
    elif plan.probed:
        notes.append("stepping into changed blocks: " + ", ".join(sorted(plan.probed)))
    else:
        notes.append("no block changed: every block is skipped")
    if hf is not None and hf.get("grads"):
        notes.append("gradients read after " + ", ".join(hf["grads"]) + " (their "
                     "checkpoints do not hold them): they run again")
    if plan.changed_end:
        notes.append("end() changed for: " + ", ".join(sorted(plan.changed_end)) +
                     " (their checkpoints are not used)")
    if plan.changed_functions:
        notes.append("changed functions: " + ", ".join(sorted(plan.changed_functions)))
    if hf is not None and hf.get("passed"):
        notes.append("changed functions handed to other code as values (callbacks): "
                     f"{', '.join(hf['passed'])}; any block may call them, so every block runs")
    if hf is not None:
        for line, text in hf["hindsight"]:
            notes.append(f"hindsight statement at {statement_at(line)}: {text}")
        if hf["other"]:
            notes.append("WARNING: the script changed in ways other than hindsight "
                         "statements (their blocks are re-executed; --strict refuses):\n" +
                         "\n".join(f"    {statement_at(line)}: {text}"
                                   for line, text in hf["other"]))
    recorded_args = store.run(plan.record)["argv"][1:]
    if list(plan.argv[1:]) != recorded_args:
        notes.append(f"the script's arguments differ from the record's {recorded_args} "
                     "(--args-differ-ok)")
    segs = ", ".join(f"[{s}, {e})" for s, e in plan.segments)
    notes.append(f"replaying run {plan.record}: {plan.iterations} iterations "
                 f"in segments {segs}")
    return notes
