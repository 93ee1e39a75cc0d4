"""The flor command line: ``flor COMMAND`` (or ``python -m flor COMMAND``).

    flor record [options] SCRIPT [ARGS...]    run SCRIPT, recording it
    flor replay [options] SCRIPT [ARGS...]    replay its record with the edited SCRIPT
    flor merge [REPLAY]                       assemble a replay run in --part pieces
    flor runs | show RUN | rm RUN... | prune  the runs of the store
    flor plot NAME | export --tensorboard DIR the stored values

``flor COMMAND --help`` describes each.  The exit status is 0 on success;
the script's own status when it fails (1 for an uncaught exception); 1
when ``replay --check strict`` finds values that differ; 2 when flor
refuses (an argument, option, script or store it cannot use).
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import traceback

from .cli import build_parser, options_of, parse
from .context import statement_at
from .errors import FlorError, note, unusable
from . import _cuda
from .materializer import mode_from_env


# -- the commands ------------------------------------------------------------

def cmd_record(o) -> int:
    from .runtime import ranks
    from .runtime.entry import record_script

    if o.force and not o.resume:
        raise FlorError("--force goes with --resume")
    try:
        mode_from_env()
        _cuda.mode()  # imports no torch
    except ValueError as e:
        raise FlorError(str(e)) from None
    labels = {"name": o.name, "add": o.tags, "note": o.note}
    if o.resume and (o.name is not None or o.tags or o.note is not None):
        raise FlorError("record --resume keeps the run's name, tags and note; change them "
                        "with `flor tag RUN`")
    from .runs import check_name, check_tags

    check_tags(o.tags)
    if o.name is not None and (ranks.world() or (0,))[0] == 0:
        from .store import Store

        check_name(Store(), o.name)  # before it runs (rank 0 names a data-parallel record)
    code = record_script(o.script, o.args if o.explicit_args or not o.resume else None,
                         epsilon=o.epsilon, adaptive=False if o.no_adaptive else None,
                         resume=o.resume, force=o.force, keep=o.iteration_checkpoints,
                         labels=labels)
    hint = _hint_options(o) if code else None
    if hint:
        note(hint)
    return code


def _parse_part(text):
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise FlorError(f"--part takes I/N counting from 0, for example 0/4, not {text!r}") \
            from None
    if n < 1:
        raise FlorError(f"--part {text}: N, the number of parts, must be at least 1")
    if not 0 <= i < n:
        raise FlorError(f"--part {text}: I counts from 0, so 0 <= I < N (0/{max(n, 1)} to "
                        f"{max(n, 1) - 1}/{max(n, 1)})")
    return i, n


def _threads(o):
    """Torch threads per replay worker as told: --threads, else OMP_NUM_THREADS."""
    if o.threads is not None:
        return o.threads
    text = os.environ.get("OMP_NUM_THREADS")
    if text is None:
        return None
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise FlorError(f"OMP_NUM_THREADS takes a whole number of at least 1, not {text!r}")
    return threads


def _cores():
    """Cores for this replay's workers: FLOR_REPLAY_CORES, else those this
    process may run on; a rank of a data-parallel replay shares them with
    the other ranks that torchrun started on this machine."""
    text = os.environ.get("FLOR_REPLAY_CORES")
    if text is not None:
        try:
            cores = int(text)
        except ValueError:
            cores = 0
        if cores < 1:
            raise FlorError(f"FLOR_REPLAY_CORES takes a whole number of at least 1, not {text!r}")
        return cores
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    from .runtime.ranks import world

    if world() is not None:
        try:
            cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            pass
    return max(1, cores)


def _plan(store, o, jobs, part=None, source=None):
    from .replay.plan import plan_replay

    try:
        plan, notes = plan_replay(
            store, o.script, o.args if o.explicit_args else None, jobs, o.run, part=part,
            tolerance=o.tolerance, threads=_threads(o),
            cores=None if part is not None else _cores(), args_differ_ok=o.args_differ_ok,
            source=source)
    except FlorError as e:
        hint = _hint_options(o) if "arguments" in str(e) else None
        if o.peeled and "arguments" in str(e):
            hint = (f"flor took {' '.join(o.peeled)} at the end of ARGS as its own options; "
                    f"`flor replay {o.script} -- ARGS...` gives all of ARGS to the script")
        raise FlorError(f"{e}\n{hint}" if hint else str(e)) from None
    for line in notes:
        note(line)
    hf = plan.hands_free
    if o.strict and hf and hf["other"]:
        raise FlorError("--strict: the script changed in ways other than hindsight "
                        "statements:\n" + "\n".join(f"  {statement_at(ln)}: {t}"
                                                     for ln, t in hf["other"]))
    return plan


def cmd_replay(o) -> int:
    from .replay.plan import describe
    from .runtime.entry import run_part
    from .store import Store

    started = time.time()
    strict = o.check == "strict"
    if o.backend == "ray":
        from .replay.distributed import import_ray

        import_ray()  # first: say how to install it
    store = Store(create=False)
    o.run = store.resolve(o.run, "record", os.path.abspath(o.script))
    if not store.exists():
        raise FlorError(f"no recorded run of {os.path.basename(o.script)}: there is no run "
                        f"store at {store.root} (FLOR_DIR, default ./.flor). Record it first "
                        f"(flor record {o.script}), or point FLOR_DIR at the store that holds "
                        "its record")
    from . import trust

    try:  # a key that others can read is refused here, not in every worker
        trust.signing_key()
    except OSError as e:
        raise FlorError(f"flor's signing key {trust.key_path()} cannot be read ({e}); fix its "
                        "permissions, or delete it (checkpoints then load in safe mode)") from None
    if o.runs is not None and (o.run is not None or o.part is not None or o.parts is not None):
        raise FlorError("--runs chooses the records itself: it does not go with --run, --part "
                        "or --parts")
    if o.parts is not None:
        from .replay.distributed import array_index

        index = array_index()
        if not 0 <= index < o.parts:
            raise FlorError(f"--parts {o.parts}: the scheduler's array index is {index} "
                            "(SLURM_ARRAY_TASK_ID less SLURM_ARRAY_TASK_MIN, or "
                            f"JOB_COMPLETION_INDEX), outside 0 to {o.parts - 1}; make the "
                            f"array {o.parts} jobs long")
        o.part = f"{index}/{o.parts}"
    if o.part is not None:
        i, n = _parse_part(o.part)
        plan = _plan(store, o, n, part=i)
        nparts = len(plan.segments)
        if i >= nparts:
            note(f"the recorded checkpoints allow only {nparts} segment"
                 f"{'s' if nparts > 1 else ''}; part {i}/{n} has nothing to replay")
            return 0
        for line in describe(plan, store):
            note(line)
        plan.save(store.layout.plan_path(plan.replay_id))
        code = run_part(plan, i, tee=True, own_db=True)
        note(f"part {i}/{nparts} of replay {plan.replay_id} "
             f"{'finished' if code == 0 else 'failed'}; once every part has run: "
             f"flor merge {plan.replay_id}")
        return code
    if o.runs is not None:
        return _replay_runs(store, o, strict, started)
    code, plan = _replay_one(store, o, strict, started)
    hint = _hint_options(o) if code and _failed(store, plan.replay_id) else None
    if hint:
        note(hint)
    return code


def _replay_one(store, o, strict, started, source=None):
    """Plan and run the replay of record o.run (None: the latest) on the
    local workers or on Ray; (exit status, plan)."""
    from .replay.plan import describe
    from .replay.workers import run_local

    if o.backend == "ray":
        from .replay.distributed import run_ray

        plan = _plan(store, o, o.jobs, part=-1, source=source)
        return run_ray(store, plan, describe(plan, store), strict=strict, started=started), plan
    server = _fork_server(o, store)  # its imports go on while the replay plans
    try:
        plan = _plan(store, o, o.jobs, source=source)
    except BaseException:
        if server is not None:
            server.close()
        raise
    return run_local(store, plan, describe(plan, store), strict=strict, started=started,
                     server=server), plan


def _replay_runs(store, o, strict, started) -> int:
    """replay --runs: the added statements over every chosen record, one
    record after another (flor/replay/many.py)."""
    from .replay.many import choose, targets

    if o.explicit_args:
        raise FlorError("--runs replays each record with the arguments it was recorded with; "
                        "give no ARGS")
    script = os.path.abspath(o.script)
    records, unusable = choose(store, script, o.runs)
    chosen, base = targets(store, script, records)
    for rec, why in unusable:
        note(f"run {rec['run_id']} is not replayed: {why}")
    todo = [t for t in chosen if t.skipped is None]
    for t in chosen:
        if t.skipped is not None:
            note(f"run {t.record['run_id']} is skipped: {t.skipped}")
    if not todo:
        raise FlorError(f"--runs {o.runs!r}: no record of {os.path.basename(script)} can be "
                        "replayed (see above)")
    note(f"replaying {len(todo)} record{'s' if len(todo) > 1 else ''} of "
         f"{os.path.basename(script)} with the statements added to it (edited from the "
         f"version of run {base})")
    ray = None
    if o.backend == "ray":
        from .replay.distributed import import_ray

        ray = import_ray()
        if not ray.is_initialized():  # one cluster for every record's segments
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False,
                     include_dashboard=False)
        else:
            ray = None
    done, failed = [], []
    try:
        for k, t in enumerate(todo, 1):
            rid = t.record["run_id"]
            how = "the script as edited" if t.source is None else \
                f"its own version, {t.carried} added line{'s' if t.carried != 1 else ''} carried"
            note(f"record {k} of {len(todo)}: run {rid} ({how})")
            o.run = rid
            try:
                code, plan = _replay_one(store, o, strict, time.time() if k > 1 else started,
                                         t.source)
            except FlorError as e:
                note(f"run {rid} is not replayed: {e}")
                failed.append(rid)
                continue
            if t.names:  # its carried statements, by their names in the script edited
                store.layout.save_printed_names(plan.replay_id,
                                                {os.path.basename(script): t.names})
            (done if code == 0 else failed).append(plan.replay_id if code == 0 else rid)
    finally:
        if ray is not None:
            ray.shutdown()
    skipped = len(chosen) - len(todo) + len(unusable)
    note(f"replay --runs: {len(done)} of {len(chosen) + len(unusable)} records replayed"
         + (f", {len(failed)} failed ({', '.join(failed)})" if failed else "")
         + (f", {skipped} skipped" if skipped else "")
         + (f"; their values beside each run's arguments: flor.dataframe(NAME, runs="
            f"{done!r}) (flor.names(runs=...) lists the names)" if done else ""))
    return 1 if failed else 0


def _fork_server(o, store):
    """The fork server of a local replay's workers (not for the ranks of a
    data-parallel replay, which torchrun starts), with the thread count the
    workers will have: as told, else the record's."""
    from .replay.forkserver import ForkServer
    from .runtime.ranks import world

    if world() is not None:
        return None
    threads = _threads(o)
    if threads is None:
        rec = store.run(o.run) if o.run is not None else store.latest_record(o.script)
        if rec is None or rec["kind"] != "record":
            return None  # planning says why
        threads = rec["info"].threads
    return ForkServer.start(os.path.abspath(o.script), threads)


def _failed(store, replay_id) -> bool:
    run = store.run(replay_id)
    return run is not None and run["status"] == "failed"


def _hint_options(o) -> str | None:
    """Options of flor's that went to the script as its arguments, if any."""
    opts = options_of(build_parser()._subparsers._group_actions[0].choices[o.command])
    mine = []
    for i, a in enumerate(o.args):
        name, eq, _ = a.partition("=")
        if name in opts and name not in ("-h", "--help"):
            mine += o.args[i:i + 2] if opts[name] and not eq else [a]
    if mine:
        return (f"{' '.join(mine)} went to the script as its arguments; flor's options go "
                f"before SCRIPT (flor {o.command} {' '.join(mine)} {o.script} ...) or at the "
                "very end")
    return None


def cmd_merge(o) -> int:
    from .replay.results import merge
    from .store import Store

    store = Store(create=False)
    store.db  # an unusable store says so first
    return merge(store, store.resolve(o.replay, "replay"), strict=o.check == "strict")


def _store(readonly=True):
    from .store import Store

    return Store(create=False, readonly=readonly)


def _resolved(store, refs):
    """Run ids for what the command line named (a full id, a unique prefix, a
    name, `latest`)."""
    return None if refs is None else [store.resolve(r) for r in refs]


def cmd_runs(o) -> int:
    from . import runs

    from .query import Query, QueryError, SortKey

    try:
        where = None if o.where is None else Query(o.where)
        sort = None if o.sort is None else SortKey(o.sort)
    except QueryError as e:
        raise FlorError(str(e)) from None
    store = _store()
    if not store.exists():
        rows = []
    else:
        rows = runs.listing(store, o.script, o.status, o.kind, where, sort)
    if o.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no runs in {store.root}" + (" matching" if o.script or o.status or o.kind
                                            or o.where else ""))
    else:
        runs.print_runs(rows)
    return 0


def cmd_show(o) -> int:
    from . import runs

    store = _store()
    d = runs.show(store, store.resolve(o.run))
    if o.json:
        print(json.dumps(d, indent=1, default=str))
    else:
        runs.print_show(d)
    return 0


def _report_deleted(ids, dry_run):
    for rid in ids:
        print(("would delete " if dry_run else "deleted ") + rid)
    if not ids:
        print("nothing to delete")


def cmd_tag(o) -> int:
    from . import runs

    store = _store(readonly=False)
    run_id = store.resolve(o.run)
    got = runs.label(store, run_id, name=o.name, add=o.tags, remove=o.remove, note=o.note)
    print(" ".join([run_id, *([got["name"]] if got["name"] else []),
                    *(f"#{t}" for t in got["tags"])]))
    return 0


def cmd_rm(o) -> int:
    from . import runs

    store = _store(readonly=o.dry_run)
    ids = [store.resolve(r) for r in o.runs]
    _report_deleted(runs.remove(store, ids, o.dry_run), o.dry_run)
    return 0


def cmd_prune(o) -> int:
    from . import runs

    store = _store(readonly=o.dry_run)
    ids = runs.prune(store, o.keep, o.script, o.dry_run) if store.exists() else []
    _report_deleted(ids, o.dry_run)
    return 0


def cmd_plot(o) -> int:
    from .export import plot

    try:
        store = _store()
        path = plot(store, o.name, runs=_resolved(store, o.runs), script=o.script, out=o.out)
    except (LookupError, ValueError) as e:
        raise FlorError(str(e).strip("'\"")) from None
    print(path if isinstance(path, str) else path[0])
    return 0


def cmd_export(o) -> int:
    from .export import export_mlflow, export_tensorboard

    try:
        store = _store()
        runs = _resolved(store, o.runs)
        if o.mlflow is not None:
            for run_id, mlrun, n in export_mlflow(store, o.mlflow, runs=runs, script=o.script):
                print(f"{run_id}: MLflow run {mlrun}, {n} metric values written")
            return 0
        files = export_tensorboard(store, o.tensorboard, runs=runs, script=o.script)
    except (LookupError, ValueError) as e:
        raise FlorError(str(e).strip("'\"")) from None
    for f in files:
        print(f)
    return 0


def cmd_worker(rest, forked=False) -> int:
    """A local replay worker: PLAN PART [PROGRESS_FD] [--db FILE] [--no-resume]
    (started by run_local, or `forked` from the fork server)."""
    from .replay.plan import Plan
    from .runtime.entry import run_part

    words = [w for i, w in enumerate(rest)
             if not w.startswith("--") and (i == 0 or rest[i - 1] != "--db")]
    progress_fd = int(words[2]) if len(words) > 2 else None
    db = rest[rest.index("--db") + 1] if "--db" in rest else False
    return run_part(Plan.load(rest[0]), int(rest[1]), progress_fd=progress_fd, own_db=db,
                    resume="--no-resume" not in rest, forked=forked)


COMMANDS = {"record": cmd_record, "replay": cmd_replay, "merge": cmd_merge, "runs": cmd_runs,
            "show": cmd_show, "tag": cmd_tag, "rm": cmd_rm, "prune": cmd_prune, "plot": cmd_plot,
            "export": cmd_export}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["_worker"]:
            return cmd_worker(argv[1:])
        if argv[:1] == ["_forkserver"]:  # SCRIPT FD (started by replay)
            from .replay.forkserver import serve

            rest = serve(argv[1], int(argv[2]))
            return 0 if rest is None else cmd_worker(rest[1:], forked=True)
        parser = build_parser()
        try:
            o = parse(parser, argv)
        except SystemExit as e:  # --help, --version, or a usage error already reported
            return e.code if isinstance(e.code, int) else 2
        return COMMANDS[o.command](o)
    except FlorError as e:
        note(str(e))
        return 2
    except SyntaxError as e:  # the script does not parse: as python would report it
        traceback.print_exception(e, limit=0)
        return 1
    except sqlite3.Error as e:  # the store failed under a command (damaged, say)
        from .layout import store_root

        note(str(unusable(os.path.join(store_root(), "flor.db"), e)))
        return 2
    except BrokenPipeError:  # `flor runs | head`: the reader is gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        note("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
