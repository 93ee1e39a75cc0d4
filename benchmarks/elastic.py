"""Resume and elastic replay, on the evaluation workloads (benchmarks/workloads/).

Per workload, from one hands-free record (one torch thread per process), in
interleaved rounds, with a statement added to the training loop (every
epoch's blocks run again, so that workers have work to share):

  1 worker        replay --jobs 1
  2 workers       replay --jobs 2; efficiency = T1 / (2 T2)
  late segment    replay --part 1/2 alone: one worker that restores the
                  iteration checkpoint before its segment; against T1 / 2
  slowed worker   replay --jobs 2 where worker 0 (FLOR_REPLAY_WORKER=0)
                  sleeps 3x the 1-worker replay's time per iteration at the
                  end of each epoch (4x slower, or a little more);
                  against the 2-worker time
  killed worker   replay --jobs 2 with one worker process SIGKILLed at a
                  random moment of the replay; against the 2-worker time;
                  its stdout must equal the 2-worker replay's

Then the kill/resume trials on a small hands-free trainer (digits, 200
epochs): a record SIGKILLed at a random epoch (once it has committed a
random number of iterations, after a random part of an epoch's time), then
`record --resume` (recorded again when it was killed before its run
existed); its final model (torch.save at the
end), printed lines and end-of-iteration state fingerprints must equal an
uninterrupted record's (the block fingerprints are left out: which blocks
the adaptive rule checkpoints depends on timing).

    python benchmarks/elastic.py --trials 0 --out benchmarks/results/elastic-replay
    python benchmarks/elastic.py --workloads "" --out benchmarks/results/elastic-resume
    python benchmarks/elastic.py --quick         # smoke sizes
Writes benchmarks/results/elastic.json and .md (see --out).
"""
import argparse
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (add_line, cpu_name, median, timed,  # noqa: E402  (benchmarks/harness.py)
                     write_report)
from run import GRAD, WORKLOADS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = {"image": ["--epochs", "12"], "language": ["--epochs", "6"],
        "finetune": ["--epochs", "10"]}
SLOW = ("__import__('time').sleep(3 * __import__('flor_bench_slow').t) "
        "if __import__('os').environ.get('FLOR_REPLAY_WORKER') == '0' else None")
TRIAL_SCRIPT = os.path.join(ROOT, "tests", "scripts", "handsfree", "digits_epochs.py")


def _workers_of(pid):
    """Pids of the `flor _worker` processes under the replay `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline") as f:
                    cmd = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid and "_worker" in cmd:
                out.append(int(entry))
    return out


def replay_killing(argv, cwd, env, at, rng):
    """A replay with one worker SIGKILLed `at` seconds after it started."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = None
    while proc.poll() is None and killed is None:
        try:
            proc.wait(timeout=max(0.0, at - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            workers = _workers_of(proc.pid)
            if workers:
                killed = rng.choice(workers)
                os.kill(killed, signal.SIGKILL)
            else:
                at += 0.2
    out, err = proc.communicate()
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"replay with a killed worker failed:\n{err[-4000:]}")
    return dt, out, err, killed is not None


def workload(name, args, rounds, work, log, rng):
    spec = WORKLOADS[name]
    d = os.path.join(work, name)
    os.makedirs(d)
    script = spec["script"]
    with open(os.path.join(ROOT, "benchmarks", "workloads", script)) as f:
        original = f.read()
    path = os.path.join(d, script)
    # FLOR_ALL_JOBS: --jobs 2 starts two workers, however short the workload.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               FLOR_DIR=os.path.join(d, ".flor"), PYTHONPATH=d, FLOR_ALL_JOBS="1")
    for k in ("FLOR_MODE", "FLOR_MATERIALIZER", "FLOR_ADAPTIVE", "FLOR_EPSILON"):
        env.pop(k, None)
    with open(path, "w") as f:
        f.write(original)
    rec_s, _ = timed([sys.executable, "-m", "flor", "record", script, *args], d, env)
    log(f"{name}: record {rec_s:.1f} s")
    probed = add_line(original, *GRAD)
    slowed = add_line(probed, spec["outer"][0], SLOW)  # once per epoch
    flor = [sys.executable, "-m", "flor", "replay"]
    out = {k: [] for k in ("t1", "t2", "late", "slow", "kill", "checks", "same_output")}
    t_iter = None
    for r in range(rounds):
        with open(path, "w") as f:
            f.write(probed)
        order = ["t1", "t2", "late"] if r % 2 == 0 else ["late", "t2", "t1"]
        for what in order:
            argv = flor + (["--jobs", "1"] if what == "t1" else ["--jobs", "2"] if what == "t2"
                           else ["--part", "1/2"]) + [script, *args]
            dt, proc = timed(argv, d, env)
            out[what].append(dt)
            if what != "late":
                out["checks"].append("deferred checks passed" in proc.stderr)
            if what == "t2":
                reference = proc.stdout
            log(f"{name} round {r} {what}: {dt:.2f} s")
        n_iter = int(args[1])
        t_iter = median(out["t1"]) / n_iter  # an upper bound of one iteration's time
        with open(os.path.join(d, "flor_bench_slow.py"), "w") as f:
            f.write(f"t = {t_iter:.4f}\n")
        with open(path, "w") as f:
            f.write(slowed)
        dt, proc = timed(flor + ["--jobs", "2", script, *args], d, env)
        out["slow"].append(dt)
        out["checks"].append("deferred checks passed" in proc.stderr)
        log(f"{name} round {r} slowed worker: {dt:.2f} s")
        with open(path, "w") as f:
            f.write(probed)
        at = rng.uniform(0.2, 0.8) * median(out["t2"])
        dt, stdout, err, killed = replay_killing(flor + ["--jobs", "2", script, *args], d, env,
                                                 at, rng)
        out["kill"].append(dt)
        out["checks"].append("deferred checks passed" in err)
        out["same_output"].append(stdout == reference and killed)
        log(f"{name} round {r} killed worker ({'killed' if killed else 'none found'} at "
            f"{at:.1f} s): {dt:.2f} s")
    with open(path, "w") as f:
        f.write(original)
    t1, t2 = median(out["t1"]), median(out["t2"])
    return {"title": spec["title"], "args": args, "record_s": rec_s, "raw": out,
            "jobs1_s": t1, "jobs2_s": t2,
            "efficiency": median([a / (2 * b) for a, b in zip(out["t1"], out["t2"])]),
            "late_s": median(out["late"]), "late_vs_half": median(out["late"]) / (t1 / 2),
            "slow_s": median(out["slow"]), "slow_ratio": median(out["slow"]) / t2,
            "kill_s": median(out["kill"]), "kill_ratio": median(out["kill"]) / t2,
            "checks_passed": all(out["checks"]), "kill_output_same": all(out["same_output"])}


def _final(d):
    """(model bytes, printed lines, state fingerprints) of the run in d."""
    sys.path.insert(0, ROOT)
    from flor.store import Store

    st = Store(os.path.join(d, ".flor"))
    (run_row,) = [r for r in st.runs() if r["kind"] == "record"]
    logs = st.logs(run_row["run_id"])
    lines = [(r["iter"], r["value"]) for r in logs if r["name"].startswith("stdout@")]
    # The state at the end of the iterations the record fingerprinted (which
    # ones follows the time they take, as state@block rows follow the
    # adaptive rule's decisions).
    states = {r["iter"]: r["value"] for r in logs if r["name"] == "state@iteration"}
    with open(os.path.join(d, "final.pt"), "rb") as f:
        model = f.read()
    st.close()
    return run_row["status"], model, lines, states


def _committed(d) -> int:
    """Main-loop iterations the record in d has committed (read-only)."""
    import sqlite3

    db = os.path.join(d, ".flor", "flor.db")
    if not os.path.exists(db):
        return -1
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            row = conn.execute("SELECT iterations FROM runs").fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return -1
    return (row[0] or 0) if row else -1


def _run_info(d):
    sys.path.insert(0, ROOT)
    from flor.store import Store

    st = Store(os.path.join(d, ".flor"))
    run_row = st.runs()[-1]
    st.close()
    return run_row["info"].to_dict(), run_row["finished"] - run_row["started"]


def _status(d):
    sys.path.insert(0, ROOT)
    from flor.store import Store

    st = Store(os.path.join(d, ".flor"))
    runs = st.runs()
    status = st.status(runs[-1]) if runs else None
    st.close()
    return status


def trials(n, epochs, work, log, rng):
    base = os.path.join(work, "trials")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", FLOR_ALL_JOBS="1")
    for k in ("FLOR_MODE", "FLOR_MATERIALIZER", "FLOR_ADAPTIVE", "FLOR_EPSILON"):
        env.pop(k, None)

    def fresh(tag):
        d = os.path.join(base, tag)
        os.makedirs(d)
        shutil.copy(TRIAL_SCRIPT, os.path.join(d, "train.py"))
        return d, dict(env, FLOR_DIR=os.path.join(d, ".flor"))

    d, e = fresh("uninterrupted")
    t0 = time.perf_counter()
    timed([sys.executable, "-m", "flor", "record", "train.py", str(epochs)], d, e)
    whole = time.perf_counter() - t0
    ref = _final(d)
    info, seconds = _run_info(d)
    per_epoch = (seconds - info["startup_s"]) / epochs
    results = []
    for t in range(n):
        d, e = fresh(f"trial{t}")
        # A random epoch, and a random moment within it: once the run has
        # committed `epoch` iterations, up to one epoch's time later.
        epoch, extra = rng.randrange(epochs), rng.uniform(0, per_epoch)
        proc = subprocess.Popen([sys.executable, "-m", "flor", "record", "train.py",
                                 str(epochs)], cwd=d, env=e, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        t0 = time.perf_counter()
        while proc.poll() is None and _committed(d) < epoch:
            time.sleep(0.01)  # a benchmark's poll of the run's progress
        time.sleep(extra)
        at = time.perf_counter() - t0
        killed = proc.poll() is None
        proc.kill()
        proc.wait()
        when, m = "after its end", None
        status = _status(d) if os.path.exists(os.path.join(d, ".flor", "flor.db")) else None
        if killed and status is None:
            when = "before its run existed"  # recorded again, as a user would
            shutil.rmtree(os.path.join(d, ".flor"), ignore_errors=True)
            timed([sys.executable, "-m", "flor", "record", "train.py", str(epochs)], d, e)
        elif killed and status != "finished":
            when = "during the run"
            _, res = timed([sys.executable, "-m", "flor", "record", "--resume", "train.py",
                          str(epochs)], d, e)
            m = re.search(r"resuming run \S+ at iteration (\d+)", res.stderr)
        got = _final(d)
        both = got[3].keys() & ref[3].keys()  # iteration 0 at least
        same = (got[0] == "finished" and got[1:3] == ref[1:3] and bool(both)
                and all(got[3][i] == ref[3][i] for i in both))
        results.append({"killed_at_s": at, "when": when, "resumed_at": int(m[1]) if m
                        else None, "identical": same})
        log(f"trial {t}: killed at {at:.2f} s, {when} -> resumed at "
            f"{m[1] if m else '-'}: {'identical' if same else 'DIFFERENT'}")
        shutil.rmtree(d)
    return {"trials": results, "record_s": whole, "epochs": epochs,
            "during": sum(r["when"] == "during the run" for r in results),
            "before": sum(r["when"] == "before its run existed" for r in results),
            "resumed_from_checkpoint": sum(1 for r in results if r["resumed_at"]),
            "identical": sum(r["identical"] for r in results)}


def render(r) -> str:
    lines = [f"Command: `{r['command']}`  ",
             f"Machine: {r['machine']}  ",
             f"{r['rounds']} interleaved rounds per workload, medians; one torch thread per "
             "process; a statement added to the training loop.", "",
             "| workload | 1 worker | 2 workers | efficiency | late segment alone (vs T1/2) "
             "| worker slowed 4x (vs 2 workers) | worker killed (vs 2 workers) | checks |",
             "|---|---:|---:|---:|---:|---:|---:|:---:|"] if r["workloads"] else [
                 f"Command: `{r['command']}`  ", f"Machine: {r['machine']}  "]
    for name, w in r["workloads"].items():
        lines.append(
            f"| {name} (`{WORKLOADS[name]['script']} {' '.join(w['args'])}`) | "
            f"{w['jobs1_s']:.2f} s | {w['jobs2_s']:.2f} s | {100 * w['efficiency']:.0f}% | "
            f"{w['late_s']:.2f} s ({w['late_vs_half']:.2f}x) | {w['slow_s']:.2f} s "
            f"({w['slow_ratio']:.2f}x) | {w['kill_s']:.2f} s ({w['kill_ratio']:.2f}x, output "
            f"{'identical' if w['kill_output_same'] else 'DIFFERENT'}) | "
            f"{'passed' if w['checks_passed'] else 'FAILED'} |")
    t = r.get("trials")
    lines += ["", f"Kill -9 / `record --resume` trials ({t['epochs']} epochs of "
              f"`tests/scripts/handsfree/digits_epochs.py`, an uninterrupted record "
              f"{t['record_s']:.1f} s, killed at a random epoch, at a random moment of it): "
              f"{len(t['trials'])} trials, {t['during']} killed during the run and resumed, "
              f"{t['resumed_from_checkpoint']} of them from an iteration checkpoint, "
              f"{t['before']} killed before the run existed (recorded again); "
              f"final model (torch.save bytes), printed lines and end-of-iteration state "
              f"fingerprints identical to the "
              f"uninterrupted record's in {t['identical']} of {len(t['trials'])}."] if t else []
    lines += ["", "| goal | met |", "|---|:---:|"]
    for goal, met in r["goals"].items():
        lines.append(f"| {goal} | {'yes' if met else 'NO'} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workloads", default="image,language,finetune")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "elastic"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="flor-elastic-")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        report = {"command": "python benchmarks/elastic.py " + shlex.join(sys.argv[1:]),
                  "machine": f"{cpu_name()}, {os.cpu_count()} cores, Python "
                             f"{platform.python_version()}",
                  "rounds": args.rounds, "workloads": {}}
        for name in filter(None, args.workloads.split(",")):
            wargs = WORKLOADS[name]["quick"] if args.quick else FULL[name]
            report["workloads"][name] = workload(name, wargs, args.rounds, work, log, rng)
        ws = report["workloads"].values()
        goals = {}
        if ws:
            goals = {
                "parallel efficiency >= 90% at 2 workers":
                    all(w["efficiency"] >= 0.9 for w in ws),
                "late segment alone costs restore + segment (<= 1.1x T1/2)":
                    all(w["late_vs_half"] <= 1.1 for w in ws),
                "one worker slowed 4x: <= 1.25x": all(w["slow_ratio"] <= 1.25 for w in ws),
                "one worker killed: completes, output identical, <= 1.5x":
                    all(w["kill_ratio"] <= 1.5 and w["kill_output_same"] for w in ws),
                "deferred checks passed": all(w["checks_passed"] for w in ws),
            }
        if args.trials:
            t = report["trials"] = trials(args.trials, 4 if args.quick else 200, work, log, rng)
            goals["kill -9 + resume identical in >= 50 trials"] = \
                t["identical"] == len(t["trials"]) >= 50
        report["goals"] = goals
        write_report(report, args.out, render)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
