"""Hindsight logging, end to end: record a training run, add the log statements
you forgot, and replay them instead of training again.

1. Record examples/train_digits.py (a CNN on scikit-learn's bundled digits):
   `python -m flor record train.py --epochs 20`.
2. Add hindsight statements to the script, as a user would:
   a. in the inner training loop, the gradient norm of every batch;
   b. in the epoch loop, the norm of every layer's weights.
3. Replay each with `python -m flor replay`: (a) must re-run the training
   loop, so it runs on two workers; (b) skips training entirely.
4. Print the recovered values, replay time against the recorded training
   time, and whether the deferred checks passed.

Everything happens in a temporary directory; run it with `make demo`.
"""
import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

INNER = ("loss.backward()",
         'flor.log("grad_norm", sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5)')
OUTER = ('flor.log("val_acc", val_acc)',
         'flor.log("weight_norm", {n: p.norm() for n, p in model.named_parameters() '
         'if n.endswith("weight")})')


def add_line(source, anchor, line):
    out = []
    for text in source.splitlines(keepends=True):
        out.append(text)
        if anchor in text:
            indent = text[: len(text) - len(text.lstrip())]
            out.append(indent + line + "\n")
    return "".join(out)


def flor(workdir, *args):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flor", *args], cwd=workdir,
                          capture_output=True, text=True,
                          env=dict(os.environ, FLOR_DIR=os.path.join(workdir, ".flor")))
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"`python -m flor {' '.join(args)}` failed:\n{proc.stdout}\n{proc.stderr}")
    return proc, seconds


def show(title, proc):
    print(f"\n== {title}")
    for line in proc.stderr.splitlines():
        if line.startswith("flor:"):
            print("  " + line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="flor-demo-")
    script = os.path.join(work, "train.py")
    shutil.copy(os.path.join(HERE, "train_digits.py"), script)
    run_args = ["--epochs", str(args.epochs)]
    try:
        print(f"working in {work}")
        rec, rec_s = flor(work, "record", "train.py", *run_args)
        print("\n== 1. record: python -m flor record train.py " + " ".join(run_args))
        print("  " + rec.stdout.strip().splitlines()[-1])
        print("  " + rec.stderr.strip().splitlines()[-1])

        with open(script) as f:
            original = f.read()
        results = []
        for label, (anchor, line), jobs in (("a. inner loop", INNER, "2"),
                                            ("b. epoch loop", OUTER, "1")):
            edited = add_line(original, anchor, line)
            with open(script, "w") as f:
                f.write(edited)
            print(f"\n== 2{label[0]}. hindsight statement in the {label[3:]}:")
            for d in difflib.unified_diff(original.splitlines(), edited.splitlines(),
                                          "train.py (recorded)", "train.py (edited)", n=1,
                                          lineterm=""):
                print("  " + d)
            proc, secs = flor(work, "replay", "--jobs", jobs, "train.py", *run_args)
            show(f"3{label[0]}. replay: python -m flor replay --jobs {jobs} train.py "
                 + " ".join(run_args), proc)
            print(f"  replay took {secs:.1f} s; recording took {rec_s:.1f} s "
                  f"({rec_s / secs:.1f}x faster than training again)")
            passed = re.search(r"^flor: deferred checks passed", proc.stderr, re.M) is not None
            results.append((f"{label} probe, {jobs} worker{'s' if jobs != '1' else ''}", secs,
                            passed))
        with open(script, "w") as f:
            f.write(original)

        print("\n== 4. recovered values (flor.dataframe)")
        code = (
            "import flor, pandas as pd\n"
            "pd.set_option('display.width', 120)\n"
            "runs = flor.store.Store().runs()\n"
            "inner, outer = runs[-2]['run_id'], runs[-1]['run_id']\n"
            "g = flor.dataframe('grad_norm', run=inner)\n"
            "per_epoch = g.groupby('iteration')['grad_norm'].agg(['count', 'mean', 'max'])\n"
            "print('gradient norm per batch, summarised per epoch:')\n"
            "print(per_epoch.round(4).to_string())\n"
            "w = flor.dataframe('weight_norm', 'val_acc', run=outer)\n"
            "layers = pd.DataFrame(w['weight_norm'].tolist(), index=w['iteration'])\n"
            "layers['val_acc'] = w['val_acc'].values\n"
            "print('\\nweight norm per layer, and validation accuracy, per epoch:')\n"
            "print(layers.round(3).to_string())\n"
        )
        out = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True,
                             text=True, env=dict(os.environ, FLOR_DIR=os.path.join(work, ".flor")))
        if out.returncode != 0:
            sys.exit(out.stderr)
        print(out.stdout)
        print("== summary")
        print(f"  recording {args.epochs} epochs took {rec_s:.1f} s")
        for label, secs, passed in results:
            print(f"  {label}: replay took {secs:.1f} s ({rec_s / secs:.1f}x faster); "
                  f"deferred checks {'passed' if passed else 'FAILED'}")
        if not all(passed for _, _, passed in results):
            sys.exit(1)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
