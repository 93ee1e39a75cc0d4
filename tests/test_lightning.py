"""PyTorch Lightning scripts, recorded and replayed with the real library:
each epoch of Trainer.fit is an iteration of flor's main loop and its
training a block.  An epoch-level probe (in on_train_epoch_end) restores
every epoch's training; a probe in training_step runs it again, split
among two workers, the second starting from an iteration checkpoint
through Lightning's own resume.  Every replay prints exactly what a plain
run of the edited script prints, and its deferred checks pass."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, flor, plain, read, runs, store, write_script

pytest.importorskip("lightning")

WORKLOAD = os.path.join(ROOT, "benchmarks", "workloads", "lightning_digits.py")
ARGS = ["--epochs", "4", "--width", "32", "--patience", "2"]

EPOCH_PROBE = ("        self.step_losses.clear()\n",
               "        self.step_losses.clear()\n"
               "        wnorm = sum(p.norm() ** 2 for p in self.parameters()) ** 0.5\n"
               '        print(f"  wnorm {wnorm:.6f} lr {self.lr_schedulers().get_last_lr()[0]}")\n')
INNER_PROBE = ("        self.step_losses.append(loss.detach())\n",
               "        self.step_losses.append(loss.detach())\n"
               "        if batch_idx % 10 == 0:\n"
               '            print(f"  step {self.global_step} loss {loss.item():.6f}")\n')


def _probe(path, original, probe):
    anchor, text = probe
    assert anchor in original
    with open(path, "w") as f:
        f.write(original.replace(anchor, text, 1))


def _states(st, replay_id):
    return {b["state"] for b in st.rows("blockruns", replay_id)}


def _segments(stderr):
    return re.search(r"iterations in segments (.*)", stderr).group(1)


def _replays(d, name, probe, original, *argv, args=ARGS, env=None):
    """Replay `name` with `probe` added: (the store, the replay's run row,
    its stderr), after checking its output against a plain run of the
    edited script."""
    path = os.path.join(d, name)
    _probe(path, original, probe)
    want = plain(d, name, *args).stdout
    rep = flor(d, "replay", *argv, name, *args, env=env)
    assert rep.stdout == want, (rep.stdout, want)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    st = store(d)
    return st, runs(st, "replay")[-1], rep.stderr


def test_handsfree_lightning_epochs_are_the_main_loop(tmp_path):
    d = str(tmp_path)
    name = "lightning_digits.py"
    shutil.copy(WORKLOAD, os.path.join(d, name))
    original = read(os.path.join(d, name))
    rec = flor(d, "record", "--no-adaptive", name, *ARGS)
    assert rec.stdout == plain(d, name, *ARGS).stdout
    assert "4 iterations of the main loop" in rec.stderr, rec.stderr

    # The epoch-level probe: no epoch's training runs again.
    st, replay, err = _replays(d, name, EPOCH_PROBE, original)
    assert _states(st, replay["run_id"]) == {"skip"}, err
    assert "every block is skipped" in err

    # The probe in training_step: the epochs run again, on two workers. The
    # split is fixed through the planner's seam: its own choice follows the
    # measured epoch times.
    st, replay, err = _replays(d, name, INNER_PROBE, original, "--jobs", "2",
                               env={"FLOR_SEGMENTS": "2"})
    assert _states(st, replay["run_id"]) == {"step_into"}, err
    assert _segments(err) == "[0, 2), [2, 4)", err
    parts = st.parts(replay["run_id"])
    assert [p["info"].resumed_from is not None for p in parts] == [False, True], parts


def test_pytorch_lightning_package_and_a_fit_by_max_steps(tmp_path):
    """The same Trainer imported as pytorch_lightning (its own callback
    class and entry point), ending at max_steps inside its fourth epoch.
    Lightning's resume of such a fit runs one more batch of the epoch it
    resumes after: the record takes no iteration checkpoint, and the second
    worker gets to its epochs through the first ones' restored blocks."""
    pytest.importorskip("pytorch_lightning")
    d = str(tmp_path)
    name = "pl_digits.py"
    text = read(WORKLOAD).replace("import lightning as L\n", "import pytorch_lightning as L\n")
    text = text.replace("from lightning.pytorch.callbacks", "from pytorch_lightning.callbacks")
    write_script(d, name, text)
    args = ["--epochs", "10", "--max-steps", "150", "--width", "32", "--patience", "5"]
    rec = flor(d, "record", "--no-adaptive", name, *args)
    assert rec.stdout == plain(d, name, *args).stdout
    assert "4 iterations of the main loop" in rec.stderr, rec.stderr
    st, replay, err = _replays(d, name, INNER_PROBE, text, "--jobs", "2", args=args)
    assert _states(st, replay["run_id"]) == {"step_into", "pseudoresume"}, err
    parts = st.parts(replay["run_id"])
    assert [p["info"].resumed_from for p in parts] == [None, None], parts


COUNTERS = """
import logging
import types

STATS = {"batches": 0}
BY_PARITY = {"even": 0, "odd": 0}
CFG = types.SimpleNamespace(examples=0, sub=types.SimpleNamespace(n=0))
BANK = torch.zeros(10)  # also the module's buffer
log = logging.getLogger("counting")  # a library's object: no state, not copyable
log.addHandler(logging.NullHandler())


class Seen:
    steps = 0

    @classmethod
    def bump(cls):
        cls.steps += 1


"""
COUNTING = ("        self.step_losses.append(loss.detach())\n",
            "        self.step_losses.append(loss.detach())\n"
            "        Seen.bump()\n"
            "        CFG.examples += len(y)\n"
            "        CFG.sub.n += 1\n"
            "        s = STATS\n"
            "        s[\"batches\"] += 1\n"
            "        p = BY_PARITY\n"
            "        p[\"even\" if batch_idx % 2 == 0 else \"odd\"] += 1\n"
            "        BANK[y] += 1\n"
            "        log.debug(\"step %d\", batch_idx)\n")
BUFFER = ("        self.validations = 0", "        self.register_buffer(\"bank\", BANK)\n")
COUNTERS_PROBE = ("        self.step_losses.clear()\n",
                  "        self.step_losses.clear()\n"
                  "        print(f\"  seen {Seen.steps} {CFG.examples} {CFG.sub.n} \"\n"
                  "              f\"{STATS['batches']} {BY_PARITY} {BANK.sum()} \"\n"
                  "              f\"{self.bank.sum()}\")\n")


def test_the_scripts_globals_that_training_step_changes_are_restored(tmp_path):
    """A class attribute (through a classmethod), a namespace's attribute
    and its namespace's, dicts changed through an alias (by a constant key
    and by a variable one) and a tensor that is also the module's buffer,
    in training_step: the epochs restored instead of run (the second
    worker's from an iteration checkpoint) put them back.  A logger there
    is no state, and checkpoints are taken."""
    d = str(tmp_path)
    name = "counting.py"
    text = read(WORKLOAD).replace("\nclass DigitsData", COUNTERS + "class DigitsData", 1)
    anchor, counting = COUNTING
    assert anchor in text
    text = text.replace(anchor, counting, 1)
    text = text.replace(BUFFER[0], BUFFER[1] + BUFFER[0], 1)
    write_script(d, name, text)
    rec = flor(d, "record", "--no-adaptive", name, *ARGS)
    assert rec.stdout == plain(d, name, *ARGS).stdout
    assert "4 iterations of the main loop, 4 checkpoints" in rec.stderr, rec.stderr
    st, replay, err = _replays(d, name, COUNTERS_PROBE, text, "--jobs", "2",
                               env={"FLOR_SEGMENTS": "2"})
    assert _states(st, replay["run_id"]) == {"skip"}, err
    parts = st.parts(replay["run_id"])
    assert [p["info"].resumed_from is not None for p in parts] == [False, True], parts


def test_the_scripts_own_callback_records_under_python(tmp_path):
    """callbacks=[flor.lightning.Flor()]: `python train.py` records (the
    manual API), and the replay restores every epoch's training."""
    d = str(tmp_path)
    name = "own_callback.py"
    text = read(WORKLOAD).replace("import torch\n", "import torch\n\nimport flor.lightning\n", 1)
    text = text.replace('ModelCheckpoint(monitor="val_acc", mode="max")]',
                        'ModelCheckpoint(monitor="val_acc", mode="max"), '
                        "flor.lightning.Flor()]")
    write_script(d, name, text)
    env = dict(os.environ, FLOR_DIR=os.path.join(d, ".flor"), FLOR_ADAPTIVE="0")
    env.pop("FLOR_MODE", None)
    proc = subprocess.run([sys.executable, name, *ARGS], cwd=d, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain(d, name, *ARGS).stdout
    st, replay, err = _replays(d, name, EPOCH_PROBE, text)
    assert _states(st, replay["run_id"]) == {"skip"}, err
