#!/bin/bash
# Diagnostic (not a benchmark): where two replay workers spend their time.
# Records the image workload once, replays an inner-loop probe with --jobs 1
# and --jobs 2, and prints flor's own accounting per worker from the store.
#     bash benchmarks/profile_parallel.sh
set -e
export ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
W=/tmp/prof && rm -rf $W && mkdir -p $W && cd $W
cp "$ROOT"/benchmarks/workloads/image_cnn.py train.py
PY="$PYTHON"
export FLOR_DIR=$W/.flor OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
$PY -m flor record train.py --epochs 24 > /dev/null 2>&1
$PY - <<'P'
import re
s = open("train.py").read()
s = s.replace("            loss.backward()\n", "            loss.backward()\n            print(f\"  grad_norm {sum(p.grad.norm() ** 2 for p in model.parameters()).item() ** 0.5:.6f}\")\n", 1)
open("train.py", "w").write(s)
P
for j in 1 2; do /usr/bin/time -f "jobs $j: %e s" $PY -m flor replay --jobs $j train.py --epochs 24 2>&1 >/dev/null | grep -E "jobs|segments|passed"; done
$PY - <<'P'
import json, os, sys
sys.path.insert(0, os.environ["ROOT"])
from flor.store import Store
st = Store(os.environ["FLOR_DIR"])
rec = [r for r in st.runs() if r["kind"] == "record"][0]
print("record run", round(rec["finished"] - rec["started"], 2), "s; checkpoints",
      sum(d["checkpoint"] for d in st.rows("decisions", rec["run_id"])))
for r in [r for r in st.runs() if r["kind"] == "replay"]:
    info = json.loads(r["info"])
    print("replay", r["run_id"], "segments", info.get("segments"))
    for p in st.rows("parts", r["run_id"]):
        print("  part", p["part"], "seconds", round(p["seconds"], 2))
    for l in st.rows("loops", r["run_id"]):
        if l["depth"] == 0:
            print("  part", l["part"], "main loop", l["iterations"], "iterations", round(l["seconds"], 2), "s")
    for b in st.rows("blocks", r["run_id"]):
        print("  part", b["part"], b["block"], "runs", b["n"], "restores", b["restores"], "restore_s", round(b["restore_s"], 2), "compute_s", round(b["compute_s"], 2))
P
