"""Diagnostic (not a benchmark): how well the store's bandwidth calibration
predicts the bandwidth of a record's own checkpoints, which the adaptive rule
uses in its place once two have been written.

In each round, in a fresh store:
  record    `flor record --no-adaptive` of the fine-tuning workload for
            EPOCHS epochs: the calibration it measures at its first decision
            (one 32 MiB checkpoint written, then deleted) and the bandwidth
            of its own checkpoints as the rule saw it at its last decision;
  keep      a fresh process writes that workload's model (thread
            materializer, no training alongside) WRITES times, keeping every
            file, as a record does;
  delete    the same, deleting each file once written, as the calibration
            does.
keep and delete alternate which goes first (an even number of rounds
balances them).  Medians over the rounds.  The writer rows time what flor
times for a run's own checkpoints (the materializer's write_seconds:
pickling and writing through fsync and rename); the calibration also times
allocating its 32 MiB and the snapshot copy.

    python benchmarks/profile_calibration.py [--rounds 4] [--epochs 8] [--writes 6]

Writes benchmarks/results/profile-calibration.json and .md (or --out).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, machine, open_store, write_report  # noqa: E402
from run import WORKLOADS, WORKLOADS_DIR, Workload  # noqa: E402

MIB = 1 << 20

WRITER = r"""
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from finetune import Classifier
from flor.materializer import Materializer
torch.manual_seed(0)
model = Classifier(4096, 5)
directory, writes, delete = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "delete"
m = Materializer(directory, mode="thread")
seconds = []
nbytes = []
for i in range(writes):
    before = m.stats()
    m.submit(f"w{i}", {"model": model})
    m.flush()
    after = m.stats()
    seconds.append(after["write_seconds"] - before["write_seconds"])
    nbytes.append(after["bytes_written"] - before["bytes_written"])
    if delete:
        os.unlink(m.path_for(f"w{i}"))
m.close()
print("WRITES " + json.dumps({"nbytes": nbytes, "seconds": seconds}))
"""


def record_round(w, epochs):
    root = w.fresh_store("record")
    args = list(w.args)
    args[args.index("--epochs") + 1] = str(epochs)
    w.run([sys.executable, "-m", "flor", "record", "--no-adaptive", w.script, *args],
          env={"FLOR_DIR": root})
    with open(os.path.join(root, "calibration.json")) as f:
        (cal,) = json.load(f).values()
    st = open_store(root)
    rec = st.runs()[-1]
    decisions = st.rows("decisions", rec["run_id"], "ORDER BY rowid")
    st.close()
    shutil.rmtree(root)
    if decisions[-1]["bandwidth"] == cal["write_bytes_per_s"]:
        sys.exit(f"the record wrote fewer than two checkpoints before its last decision; "
                 f"give it more than {epochs} epochs (--epochs)")
    return {"calibration_mib_s": cal["write_bytes_per_s"] / MIB,
            "own_mib_s": decisions[-1]["bandwidth"] / MIB,
            "checkpoint_mib": decisions[-1]["nbytes"] / MIB}


def writer_round(w, writes, how):
    d = tempfile.mkdtemp(prefix=f"writes-{how}-", dir=w.dir)
    _, proc = w.run([sys.executable, "-c", WRITER, WORKLOADS_DIR, d, str(writes), how])
    shutil.rmtree(d)
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("WRITES ")]
    r = json.loads(line[7:])
    return r["nbytes"][0] / MIB, [n / s / MIB for n, s in zip(r["nbytes"], r["seconds"])]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--writes", type=int, default=6)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                 "profile-calibration"))
    a = p.parse_args()
    w = Workload("finetune", WORKLOADS["finetune"], False,
                 tempfile.mkdtemp(prefix="flor-profile-"))
    rounds = []
    try:
        for r in range(a.rounds):
            row = record_round(w, a.epochs)
            for how in (("keep", "delete") if r % 2 == 0 else ("delete", "keep")):
                row["model_mib"], row[how + "_mib_s"] = writer_round(w, a.writes, how)
            rounds.append(row)
            print(f"round {r}: {json.dumps(row)}", file=sys.stderr)
    finally:
        shutil.rmtree(os.path.dirname(w.dir), ignore_errors=True)

    def med(xs):
        return statistics.median(xs)

    def span(xs):
        return f"{med(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"

    cal = [x["calibration_mib_s"] for x in rounds]
    own = [x["own_mib_s"] for x in rounds]
    keep_first = [x["keep_mib_s"][0] for x in rounds]
    keep_rest = [v for x in rounds for v in x["keep_mib_s"][1:]]
    del_first = [x["delete_mib_s"][0] for x in rounds]
    del_rest = [v for x in rounds for v in x["delete_mib_s"][1:]]
    mib, model = rounds[0]["checkpoint_mib"], rounds[0]["model_mib"]
    table = [
        ("calibration, in the record (one 32 MiB write, then deleted; allocation and "
         "snapshot copy timed with it)", span(cal)),
        (f"the record's own checkpoints ({mib:.1f} MiB each, training alongside): the "
         f"running figure at its last decision, epoch {a.epochs}", span(own)),
        (f"model ({model:.1f} MiB) alone, files kept: first write", span(keep_first)),
        ("model alone, files kept: later writes", span(keep_rest)),
        ("model alone, each file deleted: first write", span(del_first)),
        ("model alone, each file deleted: later writes", span(del_rest)),
    ]
    report = {
        "command": " ".join(["python benchmarks/profile_calibration.py", *sys.argv[1:]]),
        "machine": machine(), "args": {"rounds": a.rounds, "epochs": a.epochs,
                                       "writes": a.writes},
        "rounds": rounds,
        "summary": {"calibration_mib_s": med(cal), "own_mib_s": med(own),
                    "calibration_over_own": med([c / o for c, o in zip(cal, own)]),
                    "keep_first_mib_s": med(keep_first), "keep_later_mib_s": med(keep_rest),
                    "delete_first_mib_s": med(del_first), "delete_later_mib_s": med(del_rest)},
    }
    def render(report):
        m = report["machine"]
        return "\n".join([
            f"Command: `{report['command']}`  ",
            f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}  ",
            f"Write bandwidth of the fine-tuning workload's checkpoints, MiB/s: median "
            f"(range) over {a.rounds} rounds (a diagnostic, not a benchmark)", "",
            "| writes | MiB/s |", "|---|---:|",
            *[f"| {name} | {v} |" for name, v in table],
            "", "Calibration / the record's own bandwidth, per round: "
            + ", ".join(f"{c / o:.2f}" for c, o in zip(cal, own)), ""])

    write_report(report, a.out, render)


if __name__ == "__main__":
    main()
