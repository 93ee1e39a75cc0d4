"""Record and replay end to end, across real processes.

The example (examples/train_digits.py) trains a CNN on scikit-learn's digits
with dropout, a shuffling DataLoader, StepLR and ReduceLROnPlateau stepped in
the epoch loop; it is recorded once and copied into each test's directory."""
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys

import pytest

from flor.replay.checks import compare_logs
from flor.runtime.writes import FALLBACK_WRITE_BPS

from conftest import (ROOT, block_stats, edit, flor, plain, read, runs, store, values,
                      write_script)

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
ARGS = ["--epochs", "4", "--limit", "300", "--width", "4"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A recorded run of the example, made once for the module."""
    d = str(tmp_path_factory.mktemp("recorded"))
    shutil.copy(EXAMPLE, os.path.join(d, "train.py"))
    # Adaptivity off: a checkpoint every epoch whatever this machine's timing
    # (the rule is tested in test_rule.py and by test_sparse_checkpoints...).
    proc = flor(d, "record", "--no-adaptive", "train.py", *ARGS)
    return d, proc


@pytest.fixture
def workdir(recorded, tmp_path):
    src, _ = recorded
    d = str(tmp_path / "work")
    # The database through SQLite's backup API: a file copy would race with
    # connections of this process (and their -wal/-shm files) closing.
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("flor.db*"))
    with sqlite3.connect(os.path.join(src, ".flor", "flor.db")) as a, \
            sqlite3.connect(os.path.join(d, ".flor", "flor.db")) as b:
        a.backup(b)
    a.close()
    b.close()
    return d


def test_record_stores_the_run(recorded):
    d, proc = recorded
    st = store(d)
    (rec,) = runs(st, "record")
    assert rec["status"] == "finished" and rec["iterations"] == 4
    assert rec["argv"] == ["train.py", *ARGS]
    assert st.layout.module_sources(rec["run_id"])[None] == read(EXAMPLE)
    assert {"python", "flor", "torch", "numpy"} <= set(rec["versions"])
    decisions = st.rows("decisions", rec["run_id"])
    assert [d["top_iter"] for d in decisions] == [0, 1, 2, 3]
    for d_ in decisions:
        assert d_["checkpoint"] and d_["reason"].startswith("checkpoint: adaptivity off")
        assert d_["nbytes"] > 0 and d_["bandwidth"] > 0 and d_["materialize_s"] > 0
    ckpts = os.listdir(st.layout.ckpt_dir(rec["run_id"]))
    assert len(ckpts) == 4 and all(c.endswith(".flor") for c in ckpts)
    # Without adaptivity nothing is calibrated: until the run has timed two
    # of its own writes, the decisions carry the assumed slow disk.
    assert not os.path.exists(os.path.join(d, ".flor", "calibration.json"))
    assert [d_["bandwidth"] for d_ in decisions[:2]] == [FALLBACK_WRITE_BPS] * 2
    assert not [f for f in os.listdir(os.path.join(d, ".flor")) if f.startswith("calibrate.")]
    assert "epoch 3:" in proc.stdout  # the tee: the user still sees the output
    assert [v for _, _, v in values(st, rec["run_id"], "val_acc")]


def test_unchanged_replay_skips_every_block_and_reproduces_the_run(workdir, recorded):
    rec_out = recorded[1].stdout
    proc = flor(workdir, "replay", "train.py", *ARGS)
    assert proc.stdout == rec_out
    assert ("deferred checks passed: 8 logged values, 6 printed lines and 4 state "
            "fingerprints") in proc.stderr  # the model and optimizer at each epoch's end
    st = store(workdir)
    (rep,) = runs(st, "replay")
    assert block_stats(st, rep["run_id"], "train") == {"n": 0, "skips": 4, "steps": 0,
                                                       "restores": 4}


def test_parallel_replay_equals_serial_replay(workdir):
    edit(os.path.join(workdir, "train.py"), "loss.backward()",
         'flor.log("grad_norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))')
    one = flor(workdir, "replay", "train.py", *ARGS)
    two = flor(workdir, "replay", "--jobs", "2", "train.py", *ARGS)
    assert one.stdout == two.stdout
    # Two contiguous segments covering the 4 epochs; where they meet depends
    # on the epoch times the record measured (test_partition.py tests the
    # balancing with given costs).
    segs = re.search(r"in segments \[0, (\d)\), \[(\d), 4\)\n", two.stderr)
    assert segs and segs.group(1) == segs.group(2), two.stderr
    st = store(workdir)
    r1, r2 = (r["run_id"] for r in runs(st, "replay"))
    for name in ("grad_norm", "val_acc", "val_loss"):
        assert values(st, r1, name) == values(st, r2, name), name
    assert len(values(st, r2, "grad_norm")) == 4 * 5  # 4 epochs x 5 batches (270 images)
    for r in (r1, r2):
        assert compare_logs(st, runs(st, "record")[0]["run_id"], r).passed


def test_hindsight_values_equal_a_run_that_had_the_statement(workdir, tmp_path):
    line = 'flor.log("grad_norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))'
    edit(os.path.join(workdir, "train.py"), "loss.backward()", line)
    flor(workdir, "replay", "train.py", *ARGS, "--jobs", "2")  # trailing flor option
    st = store(workdir)
    replayed = values(st, runs(st, "replay")[0]["run_id"], "grad_norm")
    # A fresh run of the edited script, in its own store.
    fresh = str(tmp_path / "fresh")
    os.makedirs(fresh)
    shutil.copy(os.path.join(workdir, "train.py"), os.path.join(fresh, "train.py"))
    flor(fresh, "record", "--no-adaptive", "train.py", *ARGS)
    fst = store(fresh)
    assert replayed == values(fst, runs(fst, "record")[0]["run_id"], "grad_norm")


def test_epoch_loop_probe_runs_no_training(workdir):
    edit(os.path.join(workdir, "train.py"), 'flor.log("val_acc", val_acc)',
         'flor.log("weight_norm", sum(p.norm() for p in model.parameters()))')
    proc = flor(workdir, "replay", "train.py", *ARGS)
    assert "no block changed: every block is skipped" in proc.stderr
    st = store(workdir)
    rep = runs(st, "replay")[0]["run_id"]
    assert block_stats(st, rep, "train")["steps"] == 0
    assert len(values(st, rep, "weight_norm")) == 4


def test_partial_replay_loads_no_training_data(tmp_path):
    d = str(tmp_path)
    for f in ("counted.py", "counting.py"):
        shutil.copy(os.path.join(SCRIPTS, f), d)
    count = str(tmp_path / "count")
    flor(d, "record", "--no-adaptive", "counted.py", env={"COUNT_FILE": count})
    loaded = [int(read(os.path.join(d, f))) for f in os.listdir(d) if f.startswith("count.")]
    assert loaded == [3 * 64]
    for f in os.listdir(d):
        if f.startswith("count."):
            os.unlink(os.path.join(d, f))
    edit(os.path.join(d, "counted.py"), 'flor.log("w"', 'print("probe", epoch)')
    proc = flor(d, "replay", "--jobs", "2", "counted.py", env={"COUNT_FILE": count})
    assert "probe 2" in proc.stdout
    loaded = [int(read(os.path.join(d, f))) for f in os.listdir(d) if f.startswith("count.")]
    # (all blocks skipped: a second worker would pseudoresume as much as it saves)
    assert loaded and set(loaded) == {0}, "replay ran inner-loop iterations it should skip"


def test_script_run_directly_records(tmp_path):
    d = str(tmp_path)
    shutil.copy(EXAMPLE, os.path.join(d, "train.py"))
    env = dict(os.environ, FLOR_DIR=os.path.join(d, ".flor"))
    env.pop("FLOR_MODE", None)
    proc = subprocess.run([sys.executable, "train.py", *ARGS], cwd=d, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (rec,) = runs(store(d), "record")
    assert rec["iterations"] == 4 and rec["status"] == "finished"


def test_the_scripts_exit_message_and_status_come_through(tmp_path):
    """sys.exit("...") prints its message and exits 1 under flor, as it does
    under python; an exception prints its traceback."""
    d = str(tmp_path)
    write_script(d, "quit.py", """
        import sys
        import flor
        for epoch in flor.generator(range(2)):
            pass
        if "--fail" in sys.argv:
            raise ValueError("bad value in quit.py")
        if "--quit" in sys.argv:
            sys.exit("quit.py needs a dataset: install it first")
    """)
    flor(d, "record", "quit.py")
    for cmd in (["replay", "--args-differ-ok", "quit.py", "--quit"],
                ["record", "quit.py", "--quit"]):
        proc = flor(d, *cmd, check=False)
        assert proc.returncode == 1, proc.stderr
        assert "quit.py needs a dataset: install it first" in proc.stderr
    proc = flor(d, "record", "quit.py", "--fail", check=False)
    assert proc.returncode == 1
    assert "ValueError: bad value in quit.py" in proc.stderr
    # the traceback python prints: the script's frames, none of flor's above them
    tb = proc.stderr.split("Traceback (most recent call last):\n", 1)[1].splitlines()
    assert tb[0].startswith('  File "') and 'quit.py", line 6' in tb[0], proc.stderr
    os.rename(os.path.join(d, "quit.py"), os.path.join(d, "runpy_quit.py"))  # not runpy's
    proc = flor(d, "record", "runpy_quit.py", "--fail", check=False)
    tb = proc.stderr.split("Traceback (most recent call last):\n", 1)[1].splitlines()
    assert 'runpy_quit.py", line 6' in tb[0], proc.stderr


def test_replay_without_a_record_is_a_clear_error(tmp_path):
    d = str(tmp_path)
    shutil.copy(EXAMPLE, os.path.join(d, "train.py"))
    proc = flor(d, "replay", "train.py", check=False)
    assert proc.returncode == 2
    assert "no recorded run of train.py" in proc.stderr
    assert "flor record train.py" in proc.stderr and "FLOR_DIR" in proc.stderr
    assert not os.path.exists(os.path.join(d, ".flor"))  # a failed lookup creates no store
    proc = flor(d, "replay", "missing.py", check=False)
    assert proc.returncode == 2 and "no such script: missing.py" in proc.stderr
    proc = flor(d, "replay", "--run", "nope", "train.py", check=False)
    assert proc.returncode == 2 and "no recorded run" in proc.stderr


def test_damaged_and_missing_checkpoints_are_reexecuted(workdir, recorded):
    st = store(workdir)
    rec = runs(st, "record")[0]["run_id"]
    files = sorted(os.listdir(st.layout.ckpt_dir(rec)), key=lambda f: f.split("@")[1])
    damaged = os.path.join(st.layout.ckpt_dir(rec), files[1])
    with open(damaged, "r+b") as f:
        f.seek(os.path.getsize(damaged) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.unlink(os.path.join(st.layout.ckpt_dir(rec), files[2]))
    proc = flor(workdir, "replay", "train.py", *ARGS)
    assert f"{files[1]}: damaged data" in proc.stderr
    assert f"checkpoint {files[2]} is missing" in proc.stderr
    assert proc.stderr.count("re-executing block 'train'") == 2
    assert proc.stdout == recorded[1].stdout
    assert "deferred checks passed" in proc.stderr
    rep = runs(st, "replay")[0]["run_id"]
    assert block_stats(st, rep, "train")["steps"] == 2


def test_parts_then_merge_equal_local_parallel_replay(workdir):
    edit(os.path.join(workdir, "train.py"), "loss.backward()", 'flor.log("loss", loss)')
    local = flor(workdir, "replay", "--jobs", "2", "train.py", *ARGS)
    p0 = flor(workdir, "replay", "--part", "0/2", "train.py", *ARGS)
    assert "flor merge" in p0.stderr
    early = flor(workdir, "merge", check=False)
    assert early.returncode == 2 and "parts [1] of 2 have not run" in early.stderr
    flor(workdir, "replay", "--part", "1/2", "train.py", *ARGS)
    merged = flor(workdir, "merge")
    assert merged.stdout == local.stdout
    assert "deferred checks passed" in merged.stderr


def test_changed_end_call_reexecutes_the_block(workdir):
    path = os.path.join(workdir, "train.py")
    src = read(path).replace("model, optimizer = flor.SkipBlock.end(model, optimizer)",
                             "model, optimizer, _ = flor.SkipBlock.end(model, optimizer, 0)")
    with open(path, "w") as f:
        f.write(src)
    proc = flor(workdir, "replay", "train.py", *ARGS)
    assert "end() changed for: train" in proc.stderr
    st = store(workdir)
    assert block_stats(st, runs(st, "replay")[0]["run_id"], "train")["steps"] == 4
    assert "deferred checks passed" in proc.stderr


def test_runs_lists_record_and_replays(workdir):
    flor(workdir, "replay", "train.py", *ARGS)
    out = flor(workdir, "runs").stdout
    assert "record" in out and "replay" in out and "finished" in out


def test_dataframe(workdir):
    code = ("import flor, sys; df = flor.dataframe('val_acc', 'val_loss'); "
            "print(list(df.columns), len(df))")
    env = dict(os.environ, FLOR_DIR=os.path.join(workdir, ".flor"))
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The arguments argparse parsed, defaults included (the script's config)
    assert out.stdout.strip() == ("['run', 'kind', 'epochs', 'batch_size', 'lr', 'width', "
                                  "'limit', 'seed', 'threads', 'iteration', 'val_acc', "
                                  "'val_loss'] 4")


# --- scripts with nested and unnamed blocks, and a while loop -------------

def _script(tmp_path, name):
    d = str(tmp_path)
    shutil.copy(os.path.join(SCRIPTS, name), d)
    return d


def test_nested_blocks_and_random_state(tmp_path):
    d = _script(tmp_path, "nested.py")
    rec = flor(d, "record", "--no-adaptive", "nested.py")
    rep = flor(d, "replay", "--jobs", "2", "nested.py")
    assert rep.stdout == rec.stdout
    assert "deferred checks passed: 15 logged values" in rep.stderr
    st = store(d)
    r = runs(st, "replay")[0]["run_id"]
    assert block_stats(st, r, "outer")["steps"] == 0
    assert block_stats(st, r, "inner")["skips"] + block_stats(st, r, "inner")["steps"] == 0


def test_generators_passed_to_end_are_restored_in_place(tmp_path):
    # numpy's RandomState and MT19937 read the array of their state in their
    # own __setstate__: the checkpoint's copy of them must still be made
    d = _script(tmp_path, "generators.py")
    rec = flor(d, "record", "--no-adaptive", "generators.py")
    assert rec.stdout == plain(d, "generators.py").stdout
    assert "could not" not in rec.stderr and "cannot be checkpointed" not in rec.stderr
    rep = flor(d, "replay", "generators.py")
    assert rep.stdout == rec.stdout and "deferred checks passed" in rep.stderr
    st = store(d)
    r = runs(st, "replay")[0]["run_id"]
    assert block_stats(st, r, "draws")["skips"] == 4


def test_unnamed_block_keeps_its_identity_when_lines_move(tmp_path):
    d = _script(tmp_path, "nested.py")
    rec = flor(d, "record", "--no-adaptive", "nested.py")
    edit(os.path.join(d, "nested.py"), "import random", "import os  # a new line above everything",
         after=False)
    rep = flor(d, "replay", "nested.py")
    assert rep.stdout == rec.stdout and "deferred checks passed" in rep.stderr
    assert "no block changed" in rep.stderr


def test_probing_a_nested_unnamed_block(tmp_path):
    d = _script(tmp_path, "nested.py")
    flor(d, "record", "--no-adaptive", "nested.py")
    edit(os.path.join(d, "nested.py"), 'stats["calls"] += 1', 'flor.log("hist", len(history))')
    rep = flor(d, "replay", "--jobs", "2", "nested.py")
    assert "deferred checks passed" in rep.stderr
    st = store(d)
    r = runs(st, "replay")[0]["run_id"]
    assert block_stats(st, r, "outer")["steps"] == 5
    assert block_stats(st, r, "inner")["skips"] == 5  # restored, not re-run
    fresh = str(tmp_path / "fresh")
    os.makedirs(fresh)
    shutil.copy(os.path.join(d, "nested.py"), fresh)
    flor(fresh, "record", "--no-adaptive", "nested.py")
    fst = store(fresh)
    assert values(st, r, "hist") == values(fst, runs(fst, "record")[0]["run_id"], "hist")


def test_while_loop_form(tmp_path):
    d = _script(tmp_path, "whileloop.py")
    rec = flor(d, "record", "--no-adaptive", "whileloop.py")
    st = store(d)
    n = runs(st, "record")[0]["iterations"]
    assert rec.stdout == f"steps {n} " + rec.stdout.split()[-1] + "\n"
    rep = flor(d, "replay", "--jobs", "2", "whileloop.py")
    assert rep.stdout == rec.stdout and "deferred checks passed" in rep.stderr


def test_sparse_checkpoints_still_replay_faithfully(workdir, tmp_path):
    """With a tiny overhead budget the rule takes no checkpoint; replay then
    re-executes every block and still reproduces the run."""
    d = str(tmp_path / "sparse")
    os.makedirs(d)
    shutil.copy(EXAMPLE, os.path.join(d, "train.py"))
    rec = flor(d, "record", "--epsilon", "1e-9", "train.py", *ARGS)
    st = store(d)
    r = runs(st, "record")[0]
    assert r["epsilon"] == 1e-9
    assert not any(x["checkpoint"] for x in st.rows("decisions", r["run_id"]))
    # The record says which block went without checkpoints, why, and the way out.
    (block,) = {x["block"] for x in st.rows("decisions", r["run_id"])}
    note = re.search(rf"flor: block {re.escape(block)} ran 4 times and was never checkpointed,"
                     r" so replay re-executes it \(the rule at its last execution: no checkpoint:"
                     r" M/C = .* >= n/\(k\+1\) \* eps = 4/1 \* .*\);"
                     r" `python -m flor record --no-adaptive` checkpoints every execution",
                     rec.stderr)
    assert note, rec.stderr
    rep = flor(d, "replay", "--jobs", "2", "train.py", *ARGS)
    assert "segments [0, 4)" in rep.stderr  # no checkpoint to start a second segment from
    assert rep.stdout == rec.stdout and "deferred checks passed" in rep.stderr


def test_only_outermost_blocks_never_checkpointed_get_a_note():
    from flor.runtime.entry import never_checkpointed

    def row(block, ctx, checkpoint, reason):
        return {"block": block, "ctx": json.dumps(ctx), "n": 3, "checkpoint": checkpoint,
                "reason": reason}
    main = ["L", "train.py:40", 0]
    rows = [row("train", [main + [0]], 0, "no checkpoint: first"),
            row("train", [main + [1]], 1, "checkpoint"),
            row("eval", [main + [0]], 0, "no checkpoint: first"),
            row("inner", [main + [0], ["B", "train", 0, 0]], 0, "no checkpoint: nested"),
            row("eval", [main + [1]], 0, "no checkpoint: last")]
    notes = list(never_checkpointed(rows))
    assert len(notes) == 1, notes
    assert notes[0].startswith("block eval ran 3 times and was never checkpointed")
    assert "(the rule at its last execution: no checkpoint: last)" in notes[0]


def test_only_the_main_loop_of_the_run_is_named_as_never_checkpointed():
    """A top-level loop run after the main loop (an evaluation's, in a
    function the script calls once more at its end) is no main loop."""
    from flor.runtime.entry import never_checkpointed

    def row(block, ctx):
        return {"block": block, "ctx": json.dumps(ctx), "n": 2, "checkpoint": 0,
                "reason": "no checkpoint: M/C"}
    rows = [row("train.py:45 (iteration)", [["L", "train.py:45", 0, 9]]),
            row("train.py:39 (iteration)", [["L", "train.py:39", 0, 1]])]
    notes = list(never_checkpointed(rows, "train.py:45"))
    assert len(notes) == 1 and notes[0].startswith("the main loop train.py:45 was never"), notes
    assert list(never_checkpointed(rows[1:], "train.py:45")) == []


def test_a_name_used_twice_is_refused(tmp_path):
    d = str(tmp_path)
    with open(os.path.join(d, "twice.py"), "w") as f:
        f.write("import flor\n"
                "for i in flor.generator(range(2)):\n"
                "    if flor.SkipBlock.step_into('b'):\n        pass\n"
                "    flor.SkipBlock.end()\n"
                "    if flor.SkipBlock.step_into('b'):\n        pass\n"
                "    flor.SkipBlock.end()\n")
    proc = flor(d, "record", "twice.py", check=False)
    assert proc.returncode == 1
    assert "SkipBlock name 'b' is used at twice.py:3 and at twice.py:6" in proc.stderr


def test_blocks_that_hold_only_numbers_record_to_the_end(tmp_path):
    """A block whose checkpoints hold no tensor or array bytes: once two are
    written the run's own bandwidth is unknown, and the rule keeps using the
    calibration instead of failing the training run."""
    d = str(tmp_path)
    write_script(d, "floats.py", """
        w, b = 0.0, 0.0
        for epoch in range(6):
            for step in range(50):
                x = step / 50
                err = w * x + b - (2 * x - 1)
                w -= 0.1 * err * x
                b -= 0.1 * err
            print(f"epoch {epoch} w {w:.6f} b {b:.6f}")
    """)
    rec = flor(d, "record", "--no-adaptive", "floats.py")
    assert "6 iterations of the main loop, 6 checkpoints" in rec.stderr, rec.stderr
    flor(d, "record", "floats.py")  # adaptive: asks for the bandwidth at every end()
    st = store(d)
    assert [r["status"] for r in runs(st, "record")] == ["finished", "finished"]


def test_replay_workers_run_with_the_record_s_thread_count(tmp_path):
    """Workers get the record's torch thread count, and no more of them than
    the cores allow at that count; --threads says otherwise."""
    d = str(tmp_path)
    write_script(d, "threads.py", """
        import torch
        w = torch.zeros(4)
        for epoch in range(4):
            for step in range(3):
                w += torch.ones(4) * step
            print(epoch, w.sum().item(), torch.get_num_threads())
    """)
    cores = len(os.sched_getaffinity(0))
    flor(d, "record", "--no-adaptive", "threads.py", env={"OMP_NUM_THREADS": str(cores)})
    edit(os.path.join(d, "threads.py"), "w += torch.ones", "print(step)")  # work for 2
    rep = flor(d, "replay", "--jobs", "2", "threads.py", drop=("OMP_NUM_THREADS",))
    st = store(d)
    parts = st.parts(runs(st, "replay")[-1]["run_id"])
    assert {p["info"].threads for p in parts} == {cores}
    if cores >= 2:
        assert len(parts) == 1, rep.stderr
        assert (f"--jobs 2 asks for 2 workers of {cores} torch threads each (the record's), "
                f"and {cores} cores are available: replaying with 1 worker") in rep.stderr
    told = flor(d, "replay", "--jobs", "2", "--threads", "1", "threads.py",
                drop=("OMP_NUM_THREADS",))
    parts = st.parts(runs(st, "replay")[-1]["run_id"])
    assert {p["info"].threads for p in parts} == {1}
    assert len(parts) == min(2, cores) and "asks for" not in told.stderr


def test_a_script_that_sets_its_own_thread_count_is_planned_with_it(tmp_path):
    """A script's own torch.set_num_threads wins over OMP_NUM_THREADS in
    every worker, so the planner counts the cores at the script's count."""
    d = str(tmp_path)
    write_script(d, "own_threads.py", """
        import torch
        torch.set_num_threads(2)
        w = torch.zeros(4)
        for epoch in range(4):
            for step in range(3):
                w += torch.ones(4) * step
            print(epoch, w.sum().item(), torch.get_num_threads())
    """)
    env = {"OMP_NUM_THREADS": "1", "FLOR_REPLAY_CORES": "2", "FLOR_ALL_JOBS": "1"}
    flor(d, "record", "--no-adaptive", "own_threads.py", env=env)
    edit(os.path.join(d, "own_threads.py"), "w += torch.ones", "print(step)")
    rep = flor(d, "replay", "--jobs", "2", "own_threads.py", env=env)
    st = store(d)
    parts = st.parts(runs(st, "replay")[-1]["run_id"])
    assert [p["info"].threads for p in parts] == [2], rep.stderr
    assert ("the script sets its own torch thread count (2 in the record, where "
            "OMP_NUM_THREADS asked for 1): each worker runs 2 threads, not 1") in rep.stderr
    assert ("--jobs 2 asks for 2 workers of 2 torch threads each (the script's own), and 2 "
            "cores are available: replaying with 1 worker\n") in rep.stderr


def test_a_count_torch_caps_or_one_set_after_the_main_loop_is_not_the_script_s_own(tmp_path):
    """OMP_NUM_THREADS above the CPU count makes torch take the CPU count,
    and a count the script sets after its main loop is not the one the loop
    ran: neither makes the planner override --threads."""
    d = str(tmp_path)
    write_script(d, "after.py", """
        import torch
        w = torch.zeros(4)
        for epoch in range(4):
            for step in range(3):
                w += torch.ones(4) * step
            print(epoch, w.sum().item())
        torch.set_num_threads(1)
    """)
    cpus = os.cpu_count()
    flor(d, "record", "--no-adaptive", "after.py", env={"OMP_NUM_THREADS": str(cpus + 2)})
    st = store(d)
    info = runs(st, "record")[-1]["info"]
    assert (info.threads, info.threads_asked) == (cpus, cpus)
    edit(os.path.join(d, "after.py"), "w += torch.ones", "print(step)")
    env = {"FLOR_REPLAY_CORES": "2", "FLOR_ALL_JOBS": "1"}
    rep = flor(d, "replay", "--jobs", "2", "--threads", "1", "after.py", env=env)
    parts = st.parts(runs(st, "replay")[-1]["run_id"])
    assert [p["info"].threads for p in parts] == [1, 1], rep.stderr
    assert "sets its own" not in rep.stderr


def test_one_replay_worker_sees_every_gpu(tmp_path):
    """A script that uses several GPUs replays with --jobs 1 as it runs:
    its one worker is not restricted to the first of them."""
    d = str(tmp_path)
    write_script(d, "gpus.py", """
        import os
        w = 0
        for epoch in range(3):
            for step in range(2):
                w += step
            print(epoch, w, os.environ.get("CUDA_VISIBLE_DEVICES"))
    """)
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    flor(d, "record", "--no-adaptive", "gpus.py", env=env)
    edit(os.path.join(d, "gpus.py"), "w += step", "print(step)")
    rep = flor(d, "replay", "--jobs", "1", "gpus.py", env=env)
    assert "2 3 0,1" in rep.stdout.splitlines()
    assert rep.stdout == plain(d, "gpus.py", env=env).stdout


def test_a_replay_without_the_seam_starts_the_workers_the_planner_chose(tmp_path):
    """Without FLOR_ALL_JOBS the planner decides how many of --jobs 2 pay
    (tests/test_partition.py tests the rule on given times): whichever it
    chose, the replay runs that many segments and prints what a plain run
    prints."""
    d = str(tmp_path)
    write_script(d, "train.py", """
        w = 0.0
        for epoch in range(6):
            for step in range(4):
                w += 0.25 * step
            print(epoch, w)
    """)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(os.path.join(d, "train.py"), "w += 0.25 * step", "print('w', w)")
    rep = flor(d, "replay", "--jobs", "2", "train.py", drop=("FLOR_ALL_JOBS",))
    (segments,) = re.findall(r"iterations in segments (.*)", rep.stderr)
    if "replaying on 1 worker of the 2 --jobs allows" in rep.stderr:
        assert segments == "[0, 6)", rep.stderr
    else:
        assert segments.count("[") >= 2, rep.stderr
    assert rep.stdout == plain(d, "train.py").stdout


def test_a_worker_that_dies_without_finishing_is_reported_with_its_last_stderr(tmp_path):
    """A replay worker that leaves without flor's end (os._exit, a fatal
    signal) still shows the last lines its script wrote to stderr."""
    d = str(tmp_path)
    write_script(d, "train.py", (
        "import os, sys\n"
        "w = 0.0\n"
        "for epoch in range(8):\n"
        "    for step in range(5):\n"
        "        w += 0.1\n"
        "    print('warn at', epoch, file=sys.stderr)\n"
        "    if os.environ.get('FLOR_REPLAY_WORKER') is not None and epoch == 4:\n"
        "        os._exit(3)\n"
        "    print(epoch, round(w, 3))\n"))
    flor(d, "record", "train.py")
    edit(os.path.join(d, "train.py"), "w += 0.1", "print('w', round(w, 3))")
    rep = flor(d, "replay", "train.py", check=False)
    assert rep.returncode == 3, rep.stderr
    tail = rep.stderr.split("--- the script's stderr", 1)[1]
    # (what iteration 4 wrote before the exit is not stored: it never ended)
    assert all(f"warn at {e}" in tail for e in range(4)), rep.stderr
