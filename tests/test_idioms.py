"""Real training-script idioms, recorded hands-free and replayed with a
hindsight statement in the epoch loop (every training block restored) and
one in the inner loop (its block re-executed on two workers).

The scripts are benchmarks/workloads' evaluation scripts at small sizes,
written the way popular projects write them (pytorch/examples' MNIST and
word language model, a nanoGPT-style trainer, a class-based trainer, a
print-heavy loop).  Every replay must print exactly what a plain run of
the edited script prints, and its deferred checks must pass."""
import json
import os
import re
import shutil

import pytest

from conftest import ROOT, edit, flor, plain, read, runs, store

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")

# script: (args, (inner anchor, statement), (epoch anchor, statement))
CASES = {
    "gpt_accum.py": (
        ["--max-iters", "5", "--accum", "2", "--eval-interval", "3", "--eval-iters", "2",
         "--n-embd", "32", "--batch-size", "8", "--block-size", "32"],
        ("loss.backward()", 'print(f"  micro {micro_step} loss {loss.item():.6f}")'),
        ("optimizer.zero_grad(set_to_none=True)",
         'print(f"  wnorm {sum(p.norm() ** 2 for p in model.parameters()).item() ** 0.5:.6f}")')),
    "mnist_helpers.py": (
        ["--epochs", "3", "--limit", "300", "--log-interval", "2", "--width", "8"],
        ("loss.backward()", 'print(f"  grad {model.conv1.weight.grad.norm().item():.6f}")'),
        ("scheduler.step()", 'print(f"  wnorm {model.fc2.weight.norm().item():.6f}")')),
    "print_heavy.py": (
        ["--epochs", "3", "--steps", "200"],
        ("total += err * err", 'print(f"  err {err:.6f}")'),
        ("lr *= 0.9", 'print(f"  w {w:.6f} b {b:.6f}")')),
    "trainer_class.py": (
        ["--epochs", "3", "--width", "8", "--limit", "400"],
        ("loss.backward()", 'print(f"  loss {loss.item():.6f}")'),
        ('self.history["val_acc"].append(val_acc)',
         'print(f"  wnorm {self.model.head.weight.norm().item():.6f}")')),
    "word_lm.py": (
        ["--epochs", "3", "--words", "8000", "--log-interval", "10", "--nhid", "32",
         "--emsize", "32"],
        ("loss.backward()", 'print(f"  loss {loss.item():.6f}")'),
        ("val_loss = evaluate(val_data)",
         'print(f"  wnorm {model.decoder.weight.norm().item():.6f}")')),
}


# Fields that read the clock differ from run to run (the deferred checks
# report them as such); stdout is compared without them.
CLOCK = re.compile(r"(time [0-9.]+ms|ms/batch +[0-9.]+|time: +[0-9.]+s)")


def _same(a, b):
    return CLOCK.sub("<clock>", a) == CLOCK.sub("<clock>", b)


def _states(st, replay_id):
    return {b["state"] for b in st.rows("blockruns", replay_id)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_epoch_and_inner_loop_probes_replay_exactly(tmp_path, name):
    args, (inner_at, inner), (epoch_at, epoch_stmt) = CASES[name]
    d = str(tmp_path)
    path = os.path.join(d, name)
    shutil.copy(os.path.join(WORKLOADS, name), path)
    original = read(path)
    rec = flor(d, "record", "--no-adaptive", name, *args)
    assert _same(rec.stdout, plain(d, name, *args).stdout)
    st = store(d)

    # The epoch loop: every training block is restored, and what it printed
    # in record is printed again, in place.
    edit(path, epoch_at, epoch_stmt)
    want = plain(d, name, *args).stdout
    rep = flor(d, "replay", name, *args)
    assert _same(rep.stdout, want), (rep.stdout, want)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "skip" in _states(st, runs(st, "replay")[-1]["run_id"])

    # The inner loop: its block runs again, on two workers.
    with open(path, "w") as f:
        f.write(original)
    edit(path, inner_at, inner)
    want = plain(d, name, *args).stdout
    rep = flor(d, "replay", "--jobs", "2", name, *args)
    assert _same(rep.stdout, want), (rep.stdout, want)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "step_into" in _states(st, runs(st, "replay")[-1]["run_id"])
