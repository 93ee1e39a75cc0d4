"""The flor command line.

    python -m flor record [--epsilon E] [--no-adaptive] SCRIPT [ARGS...]
    python -m flor replay [--jobs N] [--run ID] [--part I/N] [--check warn|strict]
                          [--tolerance REL] [--strict] SCRIPT [ARGS...]
    python -m flor merge [--check warn|strict] [REPLAY_ID]
    python -m flor runs

flor's options go before SCRIPT.  When none do, options of flor's at the very
end of the script's arguments are flor's (`replay train.py --epochs 20 --jobs 2`);
write `SCRIPT -- ARGS` to pass everything after `--` to the script.  flor's
own messages go to stderr; replay's stdout is what the edited script prints.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from .instrument import instrument, uses_flor
from .replay import (FlorError, _describe, _outermost, merge, plan_replay, run_local,
                     run_main, run_part)
from .session import Session
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


def _run_script(script, args, inst=None):
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    return run_main(script, sys.stderr, inst)


def cmd_record(rest) -> int:
    opts, script, args = _split(rest, {"--epsilon"}, flags={"--no-adaptive"})
    epsilon = float(opts["--epsilon"]) if "--epsilon" in opts else None
    adaptive = False if opts.get("--no-adaptive") else None
    mode = os.environ.get("FLOR_MATERIALIZER", "thread")
    if mode not in ("thread", "fork", "inline"):
        raise FlorError(f"FLOR_MATERIALIZER must be thread, fork or inline, not {mode!r}")
    with open(script) as f:
        source = f.read()
    inst = None
    if not uses_flor(source):  # hands-free: instrument the unmodified script
        rel = os.path.basename(script)
        try:
            inst = instrument(source, os.path.abspath(script), lambda line: f"{rel}:{line}")
        except SyntaxError as e:
            traceback.print_exception(e, limit=0)
            return 1
    session = Session.record(script, [script, *args], epsilon=epsilon, adaptive=adaptive,
                             hands_free=inst)
    code, error = _run_script(script, args, inst)
    session.finish(error)
    run = session.store.run(session.run_id)
    decisions = session.store.rows("decisions", session.run_id, "ORDER BY rowid")
    ckpts = [d for d in decisions if d["checkpoint"]]
    size = sum(os.path.getsize(os.path.join(session.store.ckpt_dir(session.run_id), d["file"]))
               for d in ckpts if d["file"] and os.path.exists(
                   os.path.join(session.store.ckpt_dir(session.run_id), d["file"])))
    print(f"flor: recorded run {session.run_id} of {os.path.basename(script)}: "
          f"{run['iterations']} iterations of the main loop, {len(ckpts)} checkpoints "
          f"({size / 2**20:.1f} MiB) in {session.store.root}", file=sys.stderr)
    for note in _never_checkpointed(decisions):
        print(f"flor: {note}", file=sys.stderr)
    return code


def _never_checkpointed(decisions):
    """A note for each outermost block that ran but was never checkpointed:
    what the adaptive rule weighed at its last execution, and the way out."""
    last, taken = {}, set()
    for d in decisions:
        if _outermost(d):
            last[d["block"]] = d
            if d["checkpoint"]:
                taken.add(d["block"])
    for block, d in last.items():
        if block not in taken:
            yield (f"block {block} ran {d['n']} times and was never checkpointed, so replay "
                   f"re-executes it (the rule at its last execution: {d['reason']}); "
                   "`python -m flor record --no-adaptive` checkpoints every execution, a "
                   "larger --epsilon allows more record overhead")


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


def _plan(store, script, args, jobs, opts, part=None):
    plan, rec, cmp, source = plan_replay(store, script, args, jobs, opts.get("--run"), part=part)
    hf = plan.get("hands_free")
    if opts.get("--strict") and hf and hf["other"]:
        raise FlorError("--strict: the script changed in ways other than hindsight "
                        "statements:\n" + "\n".join(f"  line {ln}: {t}" for ln, t in hf["other"]))
    if "--tolerance" in opts:
        try:
            plan["tolerance"] = float(opts["--tolerance"])
        except ValueError:
            raise FlorError(f"--tolerance takes a number, not {opts['--tolerance']!r}") from None
        if not plan["tolerance"] >= 0:
            raise FlorError("--tolerance must be at least 0")
    return plan, rec, cmp, source


def cmd_replay(rest) -> int:
    opts, script, args = _split(rest, {"--jobs", "--run", "--part", "--check", "--tolerance"},
                                flags={"--strict"}, trailing=True)
    strict = _strict(opts)
    store = Store()
    if "--part" in opts:
        i, n = _parse_part(opts["--part"])
        plan, rec, cmp, source = _plan(store, script, args, n, opts, part=i)
        nparts = len(plan["segments"])
        if i >= nparts:
            print(f"flor: the recorded checkpoints allow only {nparts} segments; "
                  f"part {i}/{n} has nothing to replay", file=sys.stderr)
            return 0
        for note in _describe(plan, rec, cmp, args, json.loads(rec["argv"])):
            print(f"flor: {note}", file=sys.stderr)
        plan_path = os.path.join(store.run_dir(plan["replay_id"]), "plan.json")
        os.makedirs(os.path.dirname(plan_path), exist_ok=True)
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        code = run_part(plan, i, tee=True, own_db=True)
        print(f"flor: part {i}/{nparts} of replay {plan['replay_id']} "
              f"{'finished' if code == 0 else 'failed'}; once every part has run: "
              f"python -m flor merge {plan['replay_id']}", file=sys.stderr)
        return code
    jobs = int(opts.get("--jobs", 1))
    if jobs < 1:
        raise FlorError("--jobs must be at least 1")
    plan, rec, cmp, source = _plan(store, script, args, jobs, opts)
    return run_local(store, plan, rec, cmp, source, args, strict=strict)


def cmd_runs(rest) -> int:
    store = Store()
    runs = store.runs()
    if not runs:
        print(f"no runs in {store.root}")
        return 0
    ckpts = dict(store.db.execute(
        "SELECT run_id, COUNT(*) FROM decisions WHERE checkpoint = 1 GROUP BY run_id").fetchall())
    print(f"{'run':28} {'kind':7} {'script':18} {'started':19} {'seconds':>8} "
          f"{'iters':>6} {'ckpts':>6} status")
    for r in runs:
        secs = f"{r['finished'] - r['started']:.1f}" if r["finished"] else "-"
        kind = r["kind"]
        print(f"{r['run_id']:28} {kind:7} {(r['script_name'] or '-')[:18]:18} "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['started']))} "
              f"{secs:>8} {r['iterations'] or 0:>6} {ckpts.get(r['run_id'], 0):>6} "
              f"{r['status']}" + (f" (of {r['parent']})" if r["parent"] else ""))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "record":
            return cmd_record(rest)
        if cmd == "replay":
            return cmd_replay(rest)
        if cmd == "merge":
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
        if cmd == "runs":
            return cmd_runs(rest)
        if cmd == "_worker":
            with open(rest[0]) as f:
                return run_part(json.load(f), int(rest[1]))
        raise FlorError(f"unknown command {cmd!r}\n{USAGE}")
    except FlorError as e:
        print(f"flor: {e}", file=sys.stderr)
        return 2
    except SyntaxError as e:  # the script does not parse: as python would report it
        traceback.print_exception(e, limit=0)
        return 1


if __name__ == "__main__":
    sys.exit(main())
