"""Segment boundaries: a worker that starts its segment from an iteration
checkpoint puts back what one iteration hands to the next, and nothing else
(never a name the loop header has just bound), so that its iterations print
what a plain run prints."""
import json
import os

from conftest import edit, flor, plain, read, runs, store, write_script
from loop_shapes import (CALLBACK, HEADER_REBOUND, INFINITE_LOADER, ITERATOR_EACH_EPOCH,
                         ITERATOR_IN_BLOCK, TRAINER)


def _resumed(st):
    replay = runs(st, "replay")[-1]["run_id"]
    return [json.loads(p["info"])["resumed_from"] for p in st.rows("parts", replay, "ORDER BY part")]


def test_a_name_the_header_binds_and_the_body_rebinds_is_not_put_back(tmp_path):
    """`x = x * 2.0` right after the header bound x: a worker that restored
    the previous iteration's x over it computed on the wrong batch, and
    nothing unchanged read x afterwards, so the checks passed."""
    d = str(tmp_path)
    write_script(d, "train.py", HEADER_REBOUND)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(f"{d}/train.py", "x = x * 2.0", 'print("probe", b, round(model(x).sum().item(), 6))')
    rep = flor(d, "replay", "--jobs", "2", "train.py")
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr
    resumed = _resumed(store(d))
    assert resumed[0] is None and resumed[1] is not None  # the second one did restore
    rec = runs(store(d), "record")[0]["run_id"]
    carried = {lp["key"]: lp["carried"] for lp in
               json.loads(read(store(d).run_dir(rec) + "/handsfree.json"))["loops"]}
    names = carried["train.py:8"][0]
    assert {"score", "opt"} <= set(names) and not {"x", "y", "b"} & set(names), carried


def test_a_main_loop_that_runs_several_times_is_not_split(tmp_path):
    """The training loop lives in a library trainer, which calls the
    script back: the loop flor takes for the main loop runs once per epoch.
    A worker would have to find its segment's execution among the others:
    replay runs it whole."""
    d = str(tmp_path)
    write_script(d, "mylib.py", TRAINER)
    write_script(d, "train.py", CALLBACK)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(f"{d}/train.py", "correct += int(", 'print("probe", round(model.bias.sum().item(), 6))')
    rep = flor(d, "replay", "--jobs", "2", "train.py")
    assert "the main loop (train.py:12) ran 3 times in the record: replay neither splits it" \
        in rep.stderr, rep.stderr
    assert "in segments [0, 20)\n" in rep.stderr and _resumed(store(d)) == [None]
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr


def test_a_loop_that_carries_a_data_iterator_is_not_restored_without_it(tmp_path):
    """makemore's loop draws from an infinite multi-worker DataLoader
    iterator kept on an object: no checkpoint holds its position, so the
    record takes no iteration checkpoint and says so, and the second worker
    reaches its segment by running the iterations before it (from a fresh
    iterator it would draw other batches)."""
    d = str(tmp_path)
    write_script(d, "train.py", INFINITE_LOADER)
    rec = flor(d, "record", "--no-adaptive", "train.py")
    assert ("the main loop train.py:38 carries what no checkpoint holds "
            "(batch_loader.data_iter: a _MultiProcessingDataLoaderIter, whose position no "
            "checkpoint holds)") in rec.stderr, rec.stderr
    st = store(d)
    its = [r for r in st.rows("decisions", runs(st, "record")[0]["run_id"])
           if r["block"].endswith("(iteration)")]
    assert its and not any(r["checkpoint"] for r in its)
    edit(f"{d}/train.py", "loss = torch.nn", 'print("probe", step, round(float(x.sum()), 4))')
    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "30"})
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "in segments [0, 30), [30, 60)" in rep.stderr and _resumed(st) == [None, None]


def test_a_block_that_draws_from_an_iterator_holds_its_position(tmp_path):
    """next(train_iter) advances the iterator: it is part of what the block
    changes.  Where replay runs one execution again (its checkpoint is
    gone) after restoring the one before, that execution draws the batches
    the record drew."""
    d = str(tmp_path)
    write_script(d, "train.py", ITERATOR_IN_BLOCK)
    flor(d, "record", "--no-adaptive", "train.py")
    st = store(d)
    ckpt = st.ckpt_dir(runs(st, "record")[0]["run_id"])
    (second,) = [f for f in os.listdir(ckpt) if f.startswith("train.py_9@1-")]
    os.unlink(os.path.join(ckpt, second))
    edit(f"{d}/train.py", 'print("epoch"', 'print("w", round(model.weight.sum().item(), 6))',
         after=False)
    rep = flor(d, "replay", "train.py")
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr


def test_an_iterator_nothing_reads_after_the_block_does_not_stop_its_checkpoint(tmp_path):
    """`it = iter(loader)` at the top of each epoch, drawn from in the
    training loop only: no one reads it after the block, so the block is
    checkpointed (and skipped in replay); the loop's enumerate(...) over
    another loader, drawn from in the body, is what no checkpoint holds."""
    d = str(tmp_path)
    write_script(d, "train.py", ITERATOR_EACH_EPOCH)
    rec = flor(d, "record", "--no-adaptive", "train.py")
    assert "the main loop train.py:10 carries what no checkpoint holds (batches: a " \
        "enumerate" in rec.stderr, rec.stderr
    st = store(d)
    decisions = st.rows("decisions", runs(st, "record")[0]["run_id"])
    assert all(d["checkpoint"] for d in decisions if d["block"] == "train.py:12"), decisions
