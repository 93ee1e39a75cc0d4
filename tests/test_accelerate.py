"""Accelerate in the user's own training loop, with the real library.

The Accelerator is a handle (flor/handles.py): checkpoints keep its own
counters and restore what it wraps under the script's names, so every
restored object is verified.  A probe printed with accelerator.print is a
hindsight statement.  A step loop whose accumulate() steps the optimizer
every fourth iteration carries its gradients from one iteration to the
next, and a worker that starts between two optimizer steps restores them.
Every replay prints what a plain run of the edited script prints, and its
deferred checks pass."""
import os
import shutil

import pytest

from conftest import ROOT, flor, plain, runs, store

pytest.importorskip("accelerate")

SCRIPTS = os.path.join(ROOT, "tests", "scripts", "accelerate")
# The training function in the shape of Accelerate's own examples: the
# workload benchmarks/real_scripts.py measures, small here.
WORKLOAD = os.path.join(ROOT, "benchmarks", "workloads", "accelerate_digits.py")


def _copy(d, name, source=None):
    shutil.copy(source or os.path.join(SCRIPTS, name), os.path.join(d, name))
    with open(os.path.join(d, name)) as f:
        return f.read()


def _edit(d, name, original, anchor, text):
    assert anchor in original
    with open(os.path.join(d, name), "w") as f:
        f.write(original.replace(anchor, text, 1))
    return plain(d, name).stdout


def _replay(d, name, *argv, env=None):
    rep = flor(d, "replay", *argv, name, env=env)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "could not verify" not in rep.stderr and "without verifying" not in rep.stderr, \
        rep.stderr
    return rep


def test_an_accelerate_training_function_replays_exactly(tmp_path):
    d = str(tmp_path)
    original = _copy(d, "epochs.py", WORKLOAD)
    rec = flor(d, "record", "--no-adaptive", "epochs.py")
    assert "could not write" not in rec.stderr and "cannot be checkpointed" not in rec.stderr, \
        rec.stderr
    assert runs(store(d), "record")[0]["iterations"] == 4

    # An epoch-level probe with Accelerate's own print: every epoch's
    # training and evaluation are restored.
    want = _edit(d, "epochs.py", original, "        accelerator.print(f\"epoch",
                 "        accelerator.print(\"wnorm\", round(sum(p.norm().item() for p in "
                 "model.parameters()), 6))\n        accelerator.print(f\"epoch")
    rep = _replay(d, "epochs.py", "--strict")
    assert rep.stdout == want and "wnorm" in want
    assert "no block changed: every block is skipped" in rep.stderr, rep.stderr

    # A probe in the batch loop, on two workers: the second starts from an
    # iteration checkpoint that puts back the Accelerator's counters and
    # the prepared model, optimizer and scheduler.
    want = _edit(d, "epochs.py", original, "                accelerator.backward(loss)\n",
                 "                accelerator.backward(loss)\n"
                 "                if step % 20 == 0:\n"
                 "                    print(\"gn\", step, round(sum(p.grad.norm().item() for p in "
                 "model.parameters()), 6))\n")
    rep = _replay(d, "epochs.py", "--jobs", "2", env={"FLOR_ALL_JOBS": "1"})
    assert rep.stdout == want and "gn 20" in want
    assert "segments [0, 2), [2, 4)" in rep.stderr, rep.stderr


def test_gradients_accumulated_across_iterations_are_restored(tmp_path):
    d = str(tmp_path)
    original = _copy(d, "steps.py")
    rec = flor(d, "record", "--no-adaptive", "steps.py")
    assert "could not write" not in rec.stderr, rec.stderr
    assert runs(store(d), "record")[0]["iterations"] == 30
    want = _edit(d, "steps.py", original, "        optimizer.step()\n",
                 "        if it % 3 == 1:\n"
                 "            print(\"gn\", it, accelerator.sync_gradients, round(sum("
                 "p.grad.norm().item() for p in model.parameters()), 6))\n"
                 "        optimizer.step()\n")
    # Segments that start between two optimizer steps (after iterations 9
    # and 22, with 2 and 3 backward passes accumulated).
    rep = _replay(d, "steps.py", "--jobs", "3",
                  env={"FLOR_ALL_JOBS": "1", "FLOR_SEGMENTS": "0,10,23"})
    assert rep.stdout == want, (rep.stdout, want)
    assert "segments [0, 10), [10, 23), [23, 30)" in rep.stderr, rep.stderr
