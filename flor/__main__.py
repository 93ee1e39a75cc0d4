"""The flor command line.

    python -m flor record [--epsilon E] [--no-adaptive] [--resume [--force]] SCRIPT [ARGS...]
    python -m flor replay [--jobs N] [--backend local|ray] [--threads T] [--run ID]
                          [--part I/N | --parts N] [--check warn|strict]
                          [--tolerance REL] [--strict] SCRIPT [ARGS...]
    python -m flor merge [--check warn|strict] [REPLAY_ID]
    python -m flor runs

flor's options go before SCRIPT.  When none do, options of flor's at the very
end of the script's arguments are flor's (`replay train.py --epochs 20 --jobs 2`);
write `SCRIPT -- ARGS` to pass everything after `--` to the script.  flor's
own messages go to stderr; replay's stdout is what the edited script prints.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from .errors import FlorError, note
from .materializer import mode_from_env
from .store import Store

USAGE = __doc__.split("\n\n")[1]


def _split(rest, options, flags=(), trailing=False):
    """(flor options, SCRIPT, script args) from the words after the command.
    `options` take a value; `flags` do not (their value is True)."""
    opts, i = {}, 0
    while i < len(rest) and rest[i].startswith("-"):
        name, eq, value = rest[i].partition("=")
        if name in flags and not eq:
            opts[name] = True
            i += 1
            continue
        if name not in options:
            raise FlorError(f"unknown option {name}\n{USAGE}")
        if not eq:
            i += 1
            if i >= len(rest):
                raise FlorError(f"{name} needs a value")
            value = rest[i]
        opts[name] = value
        i += 1
    if i >= len(rest):
        raise FlorError(f"missing SCRIPT\n{USAGE}")
    script, args = rest[i], list(rest[i + 1:])
    if args[:1] == ["--"]:
        args, trailing = args[1:], False
    if opts:
        trailing = False  # flor's options came first: the rest is the script's
    while trailing and args:
        if args[-1] in flags:
            opts.setdefault(args.pop(), True)
        elif len(args) >= 2 and args[-2] in options:
            opts.setdefault(args[-2], args[-1])
            del args[-2:]
        elif args[-1].partition("=")[0] in options and "=" in args[-1]:
            name, _, value = args.pop().partition("=")
            opts.setdefault(name, value)
        else:
            break
    if not os.path.isfile(script):
        raise FlorError(f"no such script: {script}")
    return opts, script, args


def cmd_record(rest) -> int:
    from .runtime.recording import record_script

    opts, script, args = _split(rest, {"--epsilon"}, flags={"--no-adaptive", "--resume",
                                                            "--force"})
    epsilon = float(opts["--epsilon"]) if "--epsilon" in opts else None
    adaptive = False if opts.get("--no-adaptive") else None
    if opts.get("--force") and not opts.get("--resume"):
        raise FlorError("--force goes with --resume")
    try:
        mode_from_env()
    except ValueError as e:
        raise FlorError(str(e)) from None
    return record_script(script, args, epsilon=epsilon, adaptive=adaptive,
                         resume=bool(opts.get("--resume")), force=bool(opts.get("--force")))


def _parse_part(text):
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise FlorError(f"--part takes I/N, for example 0/4, not {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise FlorError(f"--part {text}: need 0 <= I < N")
    return i, n


def _strict(opts):
    check = opts.get("--check", "warn")
    if check not in ("warn", "strict"):
        raise FlorError(f"--check takes warn or strict, not {check!r}")
    return check == "strict"


def _tolerance(opts):
    if "--tolerance" not in opts:
        return None
    try:
        tolerance = float(opts["--tolerance"])
    except ValueError:
        raise FlorError(f"--tolerance takes a number, not {opts['--tolerance']!r}") from None
    if not tolerance >= 0:
        raise FlorError("--tolerance must be at least 0")
    return tolerance


def _threads(opts):
    """Torch threads per replay worker as told: --threads, else OMP_NUM_THREADS."""
    text = opts.get("--threads", os.environ.get("OMP_NUM_THREADS"))
    if text is None:
        return None
    try:
        threads = int(text)
    except ValueError:
        raise FlorError(f"--threads (or OMP_NUM_THREADS) takes a whole number, not {text!r}") \
            from None
    if threads < 1:
        raise FlorError("--threads must be at least 1")
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


def _plan(store, script, args, jobs, opts, part=None):
    from .replay.plan import plan_replay

    plan, rec, cmp, source, notes = plan_replay(
        store, script, args, jobs, opts.get("--run"), part=part, tolerance=_tolerance(opts),
        threads=_threads(opts), cores=None if part is not None else _cores())
    for line in notes:
        note(line)
    hf = plan.hands_free
    if opts.get("--strict") and hf and hf["other"]:
        raise FlorError("--strict: the script changed in ways other than hindsight "
                        "statements:\n" + "\n".join(f"  line {ln}: {t}" for ln, t in hf["other"]))
    return plan, rec, cmp, source


def cmd_replay(rest) -> int:
    from .replay.plan import describe
    from .replay.workers import run_local, run_part

    opts, script, args = _split(rest, {"--jobs", "--run", "--part", "--parts", "--check",
                                       "--tolerance", "--threads", "--backend"},
                                flags={"--strict"}, trailing=True)
    strict = _strict(opts)
    store = Store()
    backend = opts.get("--backend", "local")
    if backend not in ("local", "ray"):
        raise FlorError(f"--backend takes local or ray, not {backend!r}")
    if "--parts" in opts:
        from .replay.distributed import array_index

        if "--part" in opts:
            raise FlorError("give --part I/N or --parts N, not both")
        opts["--part"] = f"{array_index()}/{opts['--parts']}"
    if "--part" in opts:
        i, n = _parse_part(opts["--part"])
        plan, rec, cmp, source = _plan(store, script, args, n, opts, part=i)
        nparts = len(plan.segments)
        if i >= nparts:
            note(f"the recorded checkpoints allow only {nparts} segments; "
                 f"part {i}/{n} has nothing to replay")
            return 0
        for line in describe(plan, rec, cmp, args):
            note(line)
        plan.save(store.plan_path(plan.replay_id))
        code = run_part(plan, i, tee=True, own_db=True)
        note(f"part {i}/{nparts} of replay {plan.replay_id} "
             f"{'finished' if code == 0 else 'failed'}; once every part has run: "
             f"python -m flor merge {plan.replay_id}")
        return code
    jobs = int(opts.get("--jobs", 1))
    if jobs < 1:
        raise FlorError("--jobs must be at least 1")
    if backend == "ray":
        from .replay.distributed import _ray, run_ray

        _ray()  # before planning: say how to install it
        plan, rec, cmp, source = _plan(store, script, args, jobs, opts, part=-1)
        return run_ray(store, plan, rec, describe(plan, rec, cmp, args), source, strict=strict)
    plan, rec, cmp, source = _plan(store, script, args, jobs, opts)
    return run_local(store, plan, rec, describe(plan, rec, cmp, args), source, strict=strict)


def cmd_merge(rest) -> int:
    from .replay.results import merge

    opts, i = {}, 0
    while i < len(rest) and rest[i].startswith("--"):
        name, eq, value = rest[i].partition("=")
        if name != "--check":
            raise FlorError(f"unknown option {name}\n{USAGE}")
        if not eq:
            i += 1
            value = rest[i] if i < len(rest) else ""
        opts[name] = value
        i += 1
    return merge(Store(), rest[i] if i < len(rest) else None, strict=_strict(opts))


def cmd_runs(rest) -> int:
    store = Store()
    runs = store.runs()
    if not runs:
        print(f"no runs in {store.root}")
        return 0
    ckpts = store.checkpoint_counts()
    print(f"{'run':28} {'kind':7} {'script':18} {'started':19} {'seconds':>8} "
          f"{'iters':>6} {'ckpts':>6} status")
    for r in runs:
        secs = f"{r['finished'] - r['started']:.1f}" if r["finished"] else "-"
        kind = r["kind"]
        print(f"{r['run_id']:28} {kind:7} {(r['script_name'] or '-')[:18]:18} "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['started']))} "
              f"{secs:>8} {r['iterations'] or 0:>6} {ckpts.get(r['run_id'], 0):>6} "
              f"{store.status(r)}" + (f" (of {r['parent']})" if r["parent"] else "")
              + _ranks_of(r))
    return 0


def _ranks_of(run) -> str:
    """Where a run is one rank of a data-parallel record, which."""
    import json

    info = json.loads(run["info"] or "{}")
    if not info.get("world_size"):
        return ""
    if info.get("rank"):
        return f" (rank {info['rank']} of {info['group']})"
    return f" ({info['world_size']} ranks)"


def cmd_worker(rest) -> int:
    """A local replay worker: PLAN PART [PROGRESS_FD] [--db FILE] [--no-resume]
    (started by run_local)."""
    from .replay.plan import Plan
    from .replay.workers import run_part

    words = [w for i, w in enumerate(rest)
             if not w.startswith("--") and (i == 0 or rest[i - 1] != "--db")]
    progress_fd = int(words[2]) if len(words) > 2 else None
    db = rest[rest.index("--db") + 1] if "--db" in rest else False
    return run_part(Plan.load(rest[0]), int(rest[1]), progress_fd=progress_fd, own_db=db,
                    resume="--no-resume" not in rest)


COMMANDS = {"record": cmd_record, "replay": cmd_replay, "merge": cmd_merge, "runs": cmd_runs,
            "_worker": cmd_worker}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd not in COMMANDS:
            raise FlorError(f"unknown command {cmd!r}\n{USAGE}")
        return COMMANDS[cmd](rest)
    except FlorError as e:
        note(str(e))
        return 2
    except SyntaxError as e:  # the script does not parse: as python would report it
        traceback.print_exception(e, limit=0)
        return 1


if __name__ == "__main__":
    sys.exit(main())
