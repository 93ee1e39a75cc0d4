#!/bin/bash
# What a lent GPU machine runs (the device tool runs it in a copy of this
# tree, where python3 holds torch with CUDA): build flor there, run the CUDA
# tests, then each step named (default: record).  Files go to $OUT.
#
#   record   benchmarks/gpu_record.py, $ROUNDS interleaved rounds (default 1)
#   copy     benchmarks/gpu.py, 1 and 4 GiB, 2 rounds, no dcp.async_save
#   costs    plain against record against record --epsilon 1e-9 (no
#            checkpoints), 2 interleaved rounds, each record timed by
#            benchmarks/record_costs.py; $WORKLOAD (a benchmarks/workloads
#            script, default gpt_accum) with $ARGS
#   profile  one record under cProfile, and the plain run's time
#
# NO_TESTS=1 leaves the tests out (the code ran them on this lease already).
#   bash benchmarks/gpu_lease.sh record costs
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE  # the image sets it; the plain runs are cached alike
OUT=${OUT:-/tmp/flor-gpu-out}; mkdir -p "$OUT"
GPT="--max-iters 40 --accum 4 --batch-size 32 --block-size 256 --n-layer 8 --n-embd 512 --eval-interval 20 --log-interval 20 --device cuda"
nvidia-smi -L 2>/dev/null; python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'
python3 setup.py -q build_ext --inplace 2>&1 | tail -3 || exit 1
[ -n "$NO_TESTS" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/test_fingerprint.py 2>&1 | tee "$OUT/tests.log" | tail -15
[ $# -eq 0 ] && set -- record
root=$PWD
for what in "$@"; do
  d=$(mktemp -d); cp "benchmarks/workloads/${WORKLOAD:-gpt_accum}.py" "$d/train.py"
  a=${ARGS:-$GPT}
  case $what in
  record) timeout 420 python3 benchmarks/gpu_record.py --rounds "${ROUNDS:-1}" --out "$OUT/gpu_record" 2>&1 | tail -30 ;;
  copy) timeout 200 python3 benchmarks/gpu.py --gib 1 4 --rounds 2 --no-dcp --out "$OUT/gpu" 2>&1 | tail -30 ;;
  costs)
    (cd "$d" && export FLOR_DIR=$d/.flor OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
     t() { local s=$EPOCHREALTIME; "$@" > /dev/null 2>"$d/err" || { cat "$d/err"; return 1; }; awk "BEGIN{printf \"%.2f\", $EPOCHREALTIME - $s}"; }
     python3 -m flor record train.py $a >/dev/null 2>&1  # calibration, caches
     for r in 1 2; do
       echo "round $r plain $(FLOR_MODE=off t python3 train.py $a) s"
       echo "round $r record $(t python3 $root/benchmarks/record_costs.py train.py $a) s"; grep -v "^flor: block" "$d/err" | tail -19
       echo "round $r record-eps0 $(t python3 $root/benchmarks/record_costs.py --epsilon 1e-9 train.py $a) s"; tail -15 "$d/err"
     done) 2>&1 | tee "$OUT/costs.log" ;;
  profile)
    (cd "$d" && echo "plain $(FLOR_MODE=off /usr/bin/time -f %e python3 train.py $a 2>&1 >/dev/null | tail -1) s"
     python3 -m cProfile -o "$OUT/record.prof" -m flor record train.py $a 2>&1 | tail -3)
    python3 -c "import pstats,sys; s=pstats.Stats(sys.argv[1]); s.sort_stats('cumtime').print_stats('flor', 40); s.sort_stats('tottime').print_stats(20)" "$OUT/record.prof" > "$OUT/record_profile.txt"
    head -c 6000 "$OUT/record_profile.txt" ;;
  esac
done
