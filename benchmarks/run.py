"""The evaluation: record overhead, adaptivity and replay speedups on three
workloads (benchmarks/workloads/), each a plain training script that does
not import flor and is recorded hands-free.

Record configurations, run side by side: in each round every configuration
runs once, in a shuffled order, and each keeps the median (and range) of
its rounds:

  plain         python SCRIPT
  expert        python SCRIPT --save-dir D   (torch.save of model and
                optimizer every epoch, by the script itself)
  flor          python -m flor record SCRIPT (adaptive; thread materializer)
  flor-every    python -m flor record --no-adaptive SCRIPT (every epoch)
  flor-fork     flor, FLOR_MATERIALIZER=fork
  flor-inline   flor, FLOR_MATERIALIZER=inline

Every flor run gets a fresh run store holding only this machine's
bandwidth calibration, measured once before the first round.

Replay, from the first round's `flor` record, in rounds of its own:

  epoch-loop probe   a print added to the epoch loop; --jobs 1.  Ideal
                     speedup = plain / (restore + outer loop), where restore
                     is what the replay's blocks spent restoring and outer
                     loop is the record's time minus its blocks' compute
  inner-loop probe   a print added to the training loop; --jobs 1 and
                     --jobs 2 back to back; efficiency = T1 / (2 T2), ideal
                     T2 = T1 / 2

Flor's own main-thread time is what the record accounts itself (the
`flor_seconds` of the run: time inside flor's calls, including snapshot
copies and restores).  Times are wall-clock seconds of whole commands.

    python benchmarks/run.py --quick          # smoke sizes, 2 rounds, at most 5 minutes
    python benchmarks/run.py                  # the full evaluation

Writes OUT.json, OUT.md and OUT-overhead.png, OUT-replay.png (OUT:
bench-results/evaluation[-quick], or --out).  With --update-benchmarks the
markdown replaces the evaluation section of docs/benchmarks.md.
"""
import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from harness import (add_line, machine_line, median, open_store,  # benchmarks/harness.py
                     write_report)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS_DIR = os.path.join(ROOT, "benchmarks", "workloads")
GRAD = ('loss.backward()',
        'print(f"  grad_norm {sum(p.grad.norm() ** 2 for p in model.parameters() '
        'if p.grad is not None).item() ** 0.5:.6f}")')


def _outer(anchor):
    return (anchor, 'print(f"  weight_norm {sum(p.norm() ** 2 for p in model.parameters())'
                    '.item() ** 0.5:.6f}")')


WORKLOADS = {
    "image": {
        "script": "image_cnn.py", "title": "image classification (CNN, digits 32x32)",
        "full": ["--epochs", "24"], "quick": ["--epochs", "2", "--limit", "400", "--width", "8"],
        "inner": GRAD, "outer": _outer('print(f"epoch {epoch} train_loss'),
    },
    "language": {
        "script": "lm_lstm.py", "title": "language modelling (char LSTM, stdlib sources)",
        "full": ["--epochs", "12"], "quick": ["--epochs", "2", "--batches", "6", "--hidden", "64"],
        "inner": GRAD, "outer": _outer('print(f"epoch {epoch} train_loss'),
    },
    "finetune": {
        "script": "finetune.py", "title": "fine-tuning (large frozen backbone, small trainable head)",
        "full": ["--epochs", "20"],
        "quick": ["--epochs", "3", "--batches", "2", "--width", "1024", "--depth", "2"],
        "inner": GRAD, "outer": _outer('print(f"epoch {epoch} train_loss'),
    },
}
CONFIGS = ["plain", "expert", "flor", "flor-every", "flor-fork", "flor-inline"]
FLOR_CONFIGS = {"flor": ([], {}), "flor-every": (["--no-adaptive"], {}),
                "flor-fork": ([], {"FLOR_MATERIALIZER": "fork"}),
                "flor-inline": ([], {"FLOR_MATERIALIZER": "inline"})}


class Workload:
    def __init__(self, name, spec, quick, work):
        self.name, self.spec = name, spec
        self.args = spec["quick" if quick else "full"]
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir)
        self.script = os.path.join(self.dir, spec["script"])
        with open(os.path.join(WORKLOADS_DIR, spec["script"])) as f:
            self.original = f.read()
        self.write(self.original)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for k in ("FLOR_MODE", "FLOR_DIR", "FLOR_MATERIALIZER", "FLOR_ADAPTIVE",
                  "FLOR_EPSILON"):
            self.env.pop(k, None)
        self.calibration = None

    def write(self, source):
        with open(self.script, "w") as f:
            f.write(source)

    def run(self, argv, env=None, check=True):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=self.dir, env=dict(self.env, **(env or {})),
                              capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if check and proc.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                     f"{proc.stderr[-4000:]}")
        return dt, proc

    def fresh_store(self, tag):
        root = tempfile.mkdtemp(prefix=f"store-{tag}-", dir=self.dir)
        if self.calibration:
            shutil.copy(self.calibration, os.path.join(root, "calibration.json"))
        return root

    def config(self, cfg):
        """Run one record configuration; returns a result dict."""
        script = os.path.basename(self.script)
        if cfg == "plain":
            dt, _ = self.run([sys.executable, script, *self.args])
            return {"seconds": dt}
        if cfg == "expert":
            d = tempfile.mkdtemp(prefix="expert-", dir=self.dir)
            try:
                dt, _ = self.run([sys.executable, script, *self.args, "--save-dir", d])
                files = os.listdir(d)
                nbytes = sum(os.path.getsize(os.path.join(d, f)) for f in files)
            finally:
                shutil.rmtree(d)
            return {"seconds": dt, "checkpoints": len(files), "bytes": nbytes}
        opts, env = FLOR_CONFIGS[cfg]
        root = self.fresh_store(cfg)
        dt, proc = self.run([sys.executable, "-m", "flor", "record", *opts, script, *self.args],
                            env=dict(env, FLOR_DIR=root))
        st = open_store(root)
        rec = st.runs()[-1]
        info = rec["info"].to_dict()
        ckpts = [d for d in st.rows("decisions", rec["run_id"]) if d["checkpoint"]]
        ckpt_dir = st.layout.ckpt_dir(rec["run_id"])
        nbytes = sum(os.path.getsize(os.path.join(ckpt_dir, d["file"])) for d in ckpts
                     if d["file"] and os.path.exists(os.path.join(ckpt_dir, d["file"])))
        compute = sum(x["compute_s"] for x in st.rows("blocks", rec["run_id"]))
        out = {"seconds": dt, "flor_seconds": info.get("flor_seconds"),
               "run_seconds": rec["finished"] - rec["started"], "checkpoints": len(ckpts),
               "bytes": nbytes, "block_compute_s": compute, "store": root}
        st.close()
        return out


def record_rounds(w, rounds, rng, log):
    results = {c: [] for c in CONFIGS}
    for r in range(rounds):
        order = CONFIGS[:]
        rng.shuffle(order)
        for cfg in order:
            res = w.config(cfg)
            if cfg != "flor" or r > 0:
                shutil.rmtree(res.pop("store", ""), ignore_errors=True)
            results[cfg].append(res)
            log(f"{w.name} round {r} {cfg}: {res['seconds']:.2f} s")
    return results


def replay_rounds(w, base, rounds, log):
    script = os.path.basename(w.script)
    env = {"FLOR_DIR": base}
    out = {"epoch_s": [], "restore_s": [], "epoch_checks": [], "inner1_s": [], "inner2_s": [],
           "inner_checks": []}

    def replay(jobs):
        dt, proc = w.run([sys.executable, "-m", "flor", "replay", "--jobs", str(jobs), script,
                          *w.args], env=env)
        passed = re.search(r"^flor: deferred checks passed", proc.stderr, re.M) is not None
        if not passed:
            log(f"{w.name}: deferred checks did not pass:\n{proc.stderr[-3000:]}")
        return dt, passed

    st = open_store(base)
    for r in range(rounds):
        w.write(add_line(w.original, *w.spec["outer"]))
        dt, ok = replay(1)
        rep = st.runs()[-1]
        out["epoch_s"].append(dt)
        out["epoch_checks"].append(ok)
        out["restore_s"].append(sum(x["restore_s"] for x in st.rows("blocks", rep["run_id"])))
        log(f"{w.name} round {r} epoch-loop probe: {dt:.2f} s")
        w.write(add_line(w.original, *w.spec["inner"]))
        for jobs in ((1, 2) if r % 2 == 0 else (2, 1)):
            dt, ok = replay(jobs)
            out[f"inner{jobs}_s"].append(dt)
            out["inner_checks"].append(ok)
            log(f"{w.name} round {r} inner-loop probe --jobs {jobs}: {dt:.2f} s")
    w.write(w.original)
    st.close()
    return out


def summarize(name, spec, rec, rep, epsilon):
    plain = median([x["seconds"] for x in rec["plain"]])
    cfg = {}
    for c in CONFIGS:
        secs = [x["seconds"] for x in rec[c]]
        row = {"median_s": median(secs), "min_s": min(secs), "max_s": max(secs),
               "overhead": median(secs) / plain - 1}
        if c != "plain":
            row["checkpoints"] = median([x["checkpoints"] for x in rec[c]])
            row["bytes"] = median([x["bytes"] for x in rec[c]])
        if c.startswith("flor"):
            row["flor_fraction"] = median([x["flor_seconds"] / x["run_seconds"]
                                           for x in rec[c]])
        cfg[c] = row
    flor_runs = rec["flor"]
    outer_loop = median([x["run_seconds"] - x["block_compute_s"] for x in flor_runs])
    restore = median(rep["restore_s"])
    ideal = plain / (restore + outer_loop)
    speedup = plain / median(rep["epoch_s"])
    t1, t2 = median(rep["inner1_s"]), median(rep["inner2_s"])
    efficiency = median([a / (2 * b) for a, b in zip(rep["inner1_s"], rep["inner2_s"])])
    bound = 0.015 if name in ("image", "language") else epsilon
    goals = {
        f"record overhead with adaptivity <= {100 * bound:.2f}%": cfg["flor"]["overhead"] <= bound,
        "flor record overhead <= expert torch.save overhead":
            cfg["flor"]["overhead"] <= cfg["expert"]["overhead"],
        "partial replay >= 0.8 x ideal": speedup / ideal >= 0.8,
        "parallel replay efficiency >= 85% at 2 workers": efficiency >= 0.85,
        "deferred checks passed": all(rep["epoch_checks"] + rep["inner_checks"]),
    }
    return {"title": spec["title"], "args": None, "plain_s": plain, "configs": cfg,
            "replay": {"full_rerun_s": plain, "epoch_probe_s": median(rep["epoch_s"]),
                       "restore_s": restore, "outer_loop_s": outer_loop,
                       "ideal_speedup": ideal, "epoch_speedup": speedup,
                       "fraction_of_ideal": speedup / ideal,
                       "inner_jobs1_s": t1, "inner_jobs2_s": t2, "ideal_jobs2_s": t1 / 2,
                       "efficiency": efficiency,
                       "checks_passed": all(rep["epoch_checks"] + rep["inner_checks"])},
            "goals": goals, "raw": {"record": rec, "replay": rep}}


def render(report) -> str:
    lines = [f"Command: `{report['command']}`  ",
             f"Machine: {report['machine']}  ",
             f"{report['rounds']} interleaved rounds per configuration (shuffled order), "
             f"medians with the range over rounds; replays in {report['replay_rounds']} rounds; "
             "one torch thread per process.", ""]
    for name, w in report["workloads"].items():
        c = w["configs"]
        lines += [f"**{w['title']}** (`{WORKLOADS[name]['script']} "
                  f"{' '.join(w['args'])}`; plain run {w['plain_s']:.1f} s)", "",
                  "| configuration | time (range) | overhead | flor main thread | "
                  "checkpoints | bytes |", "|---|---:|---:|---:|---:|---:|"]
        for cfg in CONFIGS:
            row = c[cfg]
            fr = f"{100 * row['flor_fraction']:.2f}%" if "flor_fraction" in row else ""
            ck = f"{row['checkpoints']:.0f}" if "checkpoints" in row else ""
            by = f"{row['bytes'] / 2**20:.1f} MiB" if "bytes" in row else ""
            lines.append(f"| {cfg} | {row['median_s']:.2f} s ({row['min_s']:.2f}-"
                         f"{row['max_s']:.2f}) | {100 * row['overhead']:+.1f}% | {fr} | {ck} | "
                         f"{by} |")
        r = w["replay"]
        lines += ["", "| replay | time | speedup | ideal | of ideal |", "|---|---:|---:|---:|---:|",
                  f"| full re-run | {r['full_rerun_s']:.2f} s | 1.0x | | |",
                  f"| epoch-loop probe, 1 worker | {r['epoch_probe_s']:.2f} s | "
                  f"{r['epoch_speedup']:.1f}x | {r['ideal_speedup']:.1f}x = plain / "
                  f"({r['restore_s']:.2f} s restore + {r['outer_loop_s']:.2f} s outer loop) | "
                  f"{100 * r['fraction_of_ideal']:.0f}% |",
                  f"| inner-loop probe, 1 worker | {r['inner_jobs1_s']:.2f} s | "
                  f"{r['full_rerun_s'] / r['inner_jobs1_s']:.1f}x | | |",
                  f"| inner-loop probe, 2 workers | {r['inner_jobs2_s']:.2f} s | "
                  f"{r['full_rerun_s'] / r['inner_jobs2_s']:.1f}x | {r['ideal_jobs2_s']:.2f} s "
                  f"(1 worker / 2) | efficiency {100 * r['efficiency']:.0f}% |",
                  "", "| goal | met |", "|---|:---:|",
                  *(f"| {k} | {'yes' if v else 'NO'} |" for k, v in w["goals"].items()), ""]
    return "\n".join(lines)


def plot(report, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        c = report["workloads"][name]["configs"]
        cfgs = [x for x in CONFIGS if x != "plain"]
        vals = [100 * c[x]["overhead"] for x in cfgs]
        errs = [[100 * (c[x]["median_s"] - c[x]["min_s"]) / c["plain"]["median_s"] for x in cfgs],
                [100 * (c[x]["max_s"] - c[x]["median_s"]) / c["plain"]["median_s"] for x in cfgs]]
        ax.bar(cfgs, vals, yerr=errs, color=["#999"] + ["#36c"] * (len(cfgs) - 1))
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(name)
        ax.set_ylabel("record overhead, % of plain")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out + "-overhead.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        r = report["workloads"][name]["replay"]
        labels = ["full re-run", "epoch probe", "inner, 1 w", "inner, 2 w"]
        actual = [r["full_rerun_s"], r["epoch_probe_s"], r["inner_jobs1_s"], r["inner_jobs2_s"]]
        ideal = [r["full_rerun_s"], r["restore_s"] + r["outer_loop_s"], r["inner_jobs1_s"],
                 r["ideal_jobs2_s"]]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], actual, width=0.4, label="measured", color="#36c")
        ax.bar([i + 0.2 for i in x], ideal, width=0.4, label="ideal", color="#bbb")
        ax.set_xticks(list(x), labels, rotation=30)
        ax.set_ylabel("seconds")
        ax.set_title(name)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out + "-replay.png", dpi=110)
    plt.close(fig)


def update_benchmarks(md, out):
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(path) as f:
        text = f.read()
    begin, end = "<!-- evaluation:begin -->", "<!-- evaluation:end -->"
    # The plots go into the site's own files (docs/img), where MkDocs finds them.
    name = os.path.basename(out)
    os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
    for plot in ("overhead", "replay"):
        shutil.copyfile(f"{out}-{plot}.png", os.path.join(ROOT, "docs", "img",
                                                          f"{name}-{plot}.png"))
    block = (f"{begin}\n{md}\n![record overhead](img/{name}-overhead.png)\n\n"
             f"![replay against ideal](img/{name}-replay.png)\n{end}")
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n## Evaluation: three workloads\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke sizes (at most 5 minutes)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of record configurations (3; 2 with --quick)")
    ap.add_argument("--replay-rounds", type=int, default=None)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--update-benchmarks", action="store_true",
                    help="put the tables and plots into docs/benchmarks.md")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 3)
    replay_rounds_n = args.replay_rounds or (1 if args.quick else args.rounds)
    out = args.out or os.path.join(ROOT, "bench-results",
                                   "evaluation-quick" if args.quick else "evaluation")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rng = random.Random(args.seed)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    work = tempfile.mkdtemp(prefix="flor-eval-")
    report = {"command": "python benchmarks/run.py " + " ".join(sys.argv[1:]),
              "machine": f"{machine_line()}, GPU: none",
              "rounds": args.rounds, "replay_rounds": replay_rounds_n, "quick": args.quick,
              "workloads": {}}
    sys.path.insert(0, ROOT)
    from flor.runtime.recording import DEFAULT_EPSILON

    try:
        for name in args.only.split(","):
            spec = WORKLOADS[name]
            w = Workload(name, spec, args.quick, work)
            # Warm-up: page cache, and this machine's bandwidth calibration.
            if not args.quick:
                w.config("plain")
            warm = w.fresh_store("warm")
            w.run([sys.executable, "-m", "flor", "record", os.path.basename(w.script), *w.args],
                  env={"FLOR_DIR": warm})
            w.calibration = os.path.join(warm, "calibration.json")
            rec = record_rounds(w, args.rounds, rng, log)
            base = rec["flor"][0].pop("store")
            rep = replay_rounds(w, base, replay_rounds_n, log)
            for runs in rec.values():
                for x in runs:
                    x.pop("store", None)
            s = summarize(name, spec, rec, rep, DEFAULT_EPSILON)
            s["args"] = w.args
            report["workloads"][name] = s
            log(f"{name}: flor overhead {100 * s['configs']['flor']['overhead']:+.1f}%, "
                f"epoch probe {s['replay']['epoch_speedup']:.1f}x, "
                f"efficiency {100 * s['replay']['efficiency']:.0f}%")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = time.time() - t_start
    write_report(report, out, render)
    plot(report, out)
    if args.update_benchmarks:
        update_benchmarks(render(report), out)
    log(f"done in {report['seconds']:.0f} s; wrote {out}.json, .md, -overhead.png, -replay.png")


if __name__ == "__main__":
    main()
