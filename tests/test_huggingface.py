"""Hugging Face Trainer scripts, recorded and replayed with the real
transformers: each epoch of Trainer.train is an iteration of flor's main
loop and its batches a block.  An epoch-level probe (in a callback's
on_epoch_end) restores every epoch's batches; a probe in a Trainer
subclass's compute_loss runs them again, split among two workers, the
second starting from an iteration checkpoint.  Every replay prints what a
plain run of the edited script prints (the Trainer's speed metrics, which
come from the clock, masked), and its deferred checks pass."""
import os
import re
import shutil

import pytest

from conftest import ROOT, flor, plain, read, runs, store

pytest.importorskip("transformers")

WORKLOAD = os.path.join(ROOT, "benchmarks", "workloads", "hf_digits.py")
ARGS = ["--epochs", "3", "--hidden", "32"]
SPEED = re.compile(r"('\w+_(?:runtime|per_second)': )'?[0-9.e+-]+'?")

EPOCH_PROBE = ('        print(f"epoch {state.epoch:.0f}: {len(self.losses)} losses logged")\n',
               '        print(f"epoch {state.epoch:.0f}: {len(self.losses)} losses logged")\n'
               "        wnorm = sum(p.norm() ** 2 for p in kwargs['model'].parameters()) ** 0.5\n"
               '        print(f"  wnorm {wnorm:.6f}")\n')
# A probe that runs the model in training mode: its dropout draws random
# numbers, so a plain run of the edited script trains the next epochs on
# others than the record did.
DRAWING_PROBE = (EPOCH_PROBE[0],
                 EPOCH_PROBE[0] + "        x = torch.arange(65)[None] % 18\n"
                 "        print('  probe', kwargs['model'](x).logits.sum().item())\n")
INNER_PROBE = ("        loss = F.cross_entropy(",
               "        if self.state.global_step % 5 == 0:\n"
               '            print(f"  step {self.state.global_step} loss {loss.item():.6f}")\n')


def _masked(text):
    return SPEED.sub(r"\1<clock>", text)


def _probe(path, original, probe):
    anchor, text = probe
    assert anchor in original
    if text.startswith(" " * 8 + "if "):  # after the anchor's line
        lines = original.splitlines(keepends=True)
        i = next(i for i, line in enumerate(lines) if anchor in line)
        edited = "".join(lines[:i + 1] + [text] + lines[i + 1:])
    else:
        edited = original.replace(anchor, text, 1)
    with open(path, "w") as f:
        f.write(edited)


def _replays(d, name, probe, original, *argv, checks="passed"):
    path = os.path.join(d, name)
    _probe(path, original, probe)
    want = plain(d, name, *ARGS).stdout
    rep = flor(d, "replay", *argv, name, *ARGS, check=checks == "passed")
    assert _masked(rep.stdout) == _masked(want), (rep.stdout, want)
    assert f"deferred checks {checks}" in rep.stderr, rep.stderr
    assert "differ only in fields that read the clock" in rep.stderr, rep.stderr
    st = store(d)
    return st, runs(st, "replay")[-1], rep.stderr


def _states(st, replay_id):
    return {b["state"] for b in st.rows("blockruns", replay_id)}


def test_trainer_epochs_are_the_main_loop(tmp_path):
    d = str(tmp_path)
    name = "hf_digits.py"
    shutil.copy(WORKLOAD, os.path.join(d, name))
    original = read(os.path.join(d, name))
    rec = flor(d, "record", "--no-adaptive", name, *ARGS)
    assert _masked(rec.stdout) == _masked(plain(d, name, *ARGS).stdout)
    assert "3 iterations of the main loop, 3 checkpoints" in rec.stderr, rec.stderr

    # The epoch-level probe, accepted as a hindsight statement: no epoch's
    # batches run again.
    st, replay, err = _replays(d, name, EPOCH_PROBE, original, "--strict")
    assert _states(st, replay["run_id"]) == {"skip"}, err
    assert "every block is skipped" in err

    # The probe in compute_loss: the epochs run again, on two workers, the
    # second from the first one's verified iteration checkpoint.
    st, replay, err = _replays(d, name, INNER_PROBE, original, "--jobs", "2")
    assert _states(st, replay["run_id"]) == {"step_into"}, err
    assert "ran again from its start" not in err and "without verifying" not in err, err
    parts = st.parts(replay["run_id"])
    assert [p["info"].resumed_from is not None for p in parts] == [False, True], parts
    # The workers share the Trainer's output directory (save_total_limit=2):
    # each one's rotation deletes only what it saved (a checkpoint directory
    # of one worker deleted by the other's rotation, while it was being
    # written, failed that worker's segment), so every epoch's is there.
    out = os.path.join(d, "hf-digits")
    assert sorted(os.listdir(out)) == ["checkpoint-22", "checkpoint-44", "checkpoint-66"], os.listdir(out)

    # The probe that draws random numbers: the epochs after the first run
    # again, as a plain run of the edited script trains them, and the checks
    # say that they differ from the record.
    st, replay, err = _replays(d, name, DRAWING_PROBE, original, "--strict", checks="FAILED")
    assert "random state at the start of epoch 1" in err, err
    assert _states(st, replay["run_id"]) == {"skip", "step_into"}, err
