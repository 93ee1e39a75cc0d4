"""Hands-free mode over the project's own modules: a script whose training
loop lives in a trainer class of the project's library (mylib/trainer.py,
above the script's directory, found as `python` finds it: PYTHONPATH).  The
trainer's epoch loop is the main loop and its calls of train_epoch blocks;
probes added to the library are detected; a line the library prints from
the clock is no failure; a changed callback the trainer calls through a
list runs in every replayed epoch.  Each replay prints what a plain run of
the edited project prints."""
import json
import os
import re
import shutil

import pytest

from conftest import ROOT, edit, flor, plain, read, runs, store

PROJECT = os.path.join(ROOT, "tests", "scripts", "project")
CLOCK = re.compile(r"(took|in|total time) [0-9.]+ m?s")


def _project(d):
    shutil.copytree(PROJECT, d, dirs_exist_ok=True)
    return os.path.join(d, "examples"), {"PYTHONPATH": d}


def _replays(cwd, env, *argv):
    """A replay of the edited project: its output, against a plain run's
    (the durations the callback prints masked), and its stderr."""
    want = plain(cwd, "train.py", env=env).stdout
    rep = flor(cwd, "replay", *argv, "train.py", env=env)
    assert CLOCK.sub("", rep.stdout) == CLOCK.sub("", want), (rep.stdout, want)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    st = store(cwd)
    return st, runs(st, "replay")[-1]["run_id"], rep.stderr


def _states(st, replay_id):
    return {b["block"]: b["state"] for b in st.rows("blockruns", replay_id)}


@pytest.fixture
def recorded(tmp_path):
    d = str(tmp_path)
    cwd, env = _project(d)
    rec = flor(cwd, "record", "--no-adaptive", "train.py", env=env)
    assert CLOCK.sub("", rec.stdout) == CLOCK.sub("", plain(cwd, "train.py", env=env).stdout)
    assert "6 iterations of the main loop" in rec.stderr, rec.stderr
    st = store(cwd)
    run_id = runs(st, "record")[-1]["run_id"]
    modules = st.layout.handsfree_modules(run_id)
    assert [loop["key"] for loop in modules["../mylib/trainer.py"]["loops"]] == [
        "../mylib/trainer.py:22", "../mylib/trainer.py:39"]
    assert st.layout.module_sources(run_id)["../mylib/trainer.py"] == read(
        os.path.join(d, "mylib", "trainer.py"))
    return d, cwd, env


def test_the_main_loop_and_its_blocks_in_the_projects_library(recorded):
    d, cwd, env = recorded
    lib = os.path.join(d, "mylib", "trainer.py")
    # An epoch-level probe in the library: every epoch's training restored.
    edit(lib, 'print(f"epoch {epoch} loss',
         'print("  w", round(self.model[0].weight.sum().item(), 4))')
    st, replay, err = _replays(cwd, env)
    assert "hindsight statement at ../mylib/trainer.py:47" in err, err
    assert "printed lines differ only in fields that read the clock" in err, err
    states = _states(st, replay)
    assert states["../mylib/trainer.py:41"] == "skip", states
    # The replay keeps the module's edited source: the added statement's name.
    assert st.layout.module_sources(replay)["../mylib/trainer.py"] == read(lib)

    # A probe in train_epoch: its blocks run, on two workers, the second
    # from an iteration checkpoint.
    shutil.copy(os.path.join(PROJECT, "mylib", "trainer.py"), lib)
    edit(lib, "total += loss.item()", 'print(f"  batch {i} {loss.item():.6f}") if i == 0 else None')
    st, replay, err = _replays(cwd, env, "--jobs", "2")
    assert "stepping into changed blocks: ../mylib/trainer.py:41" in err, err
    assert _states(st, replay)["../mylib/trainer.py:41"] == "step_into"
    parts = st.parts(replay)
    assert [p["info"].resumed_from is not None for p in parts] == [False, True], parts


def test_a_changed_callback_the_library_calls_runs_in_every_epoch(recorded):
    d, cwd, env = recorded
    edit(os.path.join(cwd, "train.py"), 'print(f"  epoch {trainer.epoch} took',
         'print("  w", round(trainer.model[0].weight.sum().item(), 4))')
    st, replay, err = _replays(cwd, env)
    assert "handed to other code as values (callbacks): report" in err, err
    # (the callback prints trainer.epoch_time, which the library computes
    # from the clock)
    assert "printed lines differ only in fields that read the clock" in err, err
    assert set(_states(st, replay).values()) == {"step_into"}


def test_what_a_callback_changes_in_the_trainer_is_restored(recorded):
    """The library calls the script's callback as a value (cb(self)); what
    it sets on the trainer comes back with the restored epochs."""
    d, cwd, env = recorded
    edit(os.path.join(d, "mylib", "trainer.py"), 'print(f"epoch {epoch} loss',
         'print("  reports so far", getattr(self, "reports", 0))', after=False)
    st, replay, err = _replays(cwd, env)
    assert set(_states(st, replay).values()) == {"skip"}, err


def test_a_change_in_the_library_that_is_not_a_hindsight_statement_is_refused(recorded):
    d, cwd, env = recorded
    edit(os.path.join(d, "mylib", "trainer.py"), "self.opt.step()", "self.opt.step()")
    rep = flor(cwd, "replay", "--strict", "train.py", env=env, check=False)
    assert rep.returncode == 2, rep.stderr
    assert "../mylib/trainer.py:28: changes state (calls self.opt.step())" in rep.stderr, \
        rep.stderr


def test_the_analysis_follows_calls_into_the_projects_modules(tmp_path):
    """The reference-script shape: the script's epoch loop calls
    train_one_epoch and evaluate of the project's engine module; they are
    its blocks, with what they change in their arguments (the model, the
    optimizer) as their side effects."""
    d = str(tmp_path)
    cwd, env = _project(d)
    name = "reference.py"
    rec = flor(cwd, "record", "--no-adaptive", name, env=env)
    assert CLOCK.sub("", rec.stdout) == CLOCK.sub("", plain(cwd, name, env=env).stdout)
    st = store(cwd)
    run_id = runs(st, "record")[-1]["run_id"]
    summary = json.loads(read(os.path.join(st.layout.run_dir(run_id), "handsfree.json")))
    blocks = {b["key"]: b for b in summary["blocks"]}
    assert set(blocks) == {"reference.py:28", "reference.py:30"}, blocks
    assert set(blocks["reference.py:28"]["names"]) == {"loss", "model", "optimizer"}

    # An epoch-level probe in the script: both blocks restored.
    edit(os.path.join(cwd, name), 'print(f"epoch {epoch} loss',
         'print("  w", round(model[0].weight.norm().item(), 4))')
    want = plain(cwd, name, env=env).stdout
    rep = flor(cwd, "replay", name, env=env)
    assert CLOCK.sub("", rep.stdout) == CLOCK.sub("", want)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    replay = runs(st, "replay")[-1]["run_id"]
    assert set(_states(st, replay).values()) == {"skip"}

    # A probe in the engine: the training block runs, the evaluation's is
    # restored.
    shutil.copy(os.path.join(PROJECT, "examples", name), os.path.join(cwd, name))
    edit(os.path.join(d, "mylib", "engine.py"), "meter.update(loss.item()",
         'print("  g", round(model[0].weight.grad.norm().item(), 4)) if i == 3 else None')
    want = plain(cwd, name, env=env).stdout
    rep = flor(cwd, "replay", name, env=env)
    assert CLOCK.sub("", rep.stdout) == CLOCK.sub("", want)
    assert "deferred checks passed" in rep.stderr, rep.stderr
    replay = runs(st, "replay")[-1]["run_id"]
    assert _states(st, replay) == {"reference.py:28": "step_into", "reference.py:30": "skip"}
