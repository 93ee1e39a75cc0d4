"""Segment boundaries: a worker that starts its segment from an iteration
checkpoint puts back what one iteration hands to the next, and nothing else
(never a name the loop header has just bound), so that its iterations print
what a plain run prints."""
import json
import os

from conftest import edit, flor, plain, read, runs, store, values, write_script
from loop_shapes import (CALLBACK, GENERATOR_MAIN_LOOP, HEADER_REBOUND, INFINITE_LOADER,
                         ITERATOR_EACH_EPOCH, ITERATOR_IN_BLOCK, LIST_OF_BATCHES,
                         SLICED_GENERATOR, TRAINER)


def _resumed(st):
    replay = runs(st, "replay")[-1]["run_id"]
    return [p["info"].resumed_from for p in st.parts(replay)]


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
               json.loads(read(store(d).layout.run_dir(rec) + "/handsfree.json"))["loops"]}
    names = carried["train.py:8"][0]
    assert {"score", "opt"} <= set(names) and not {"x", "y", "b"} & set(names), carried


TWO_PARAM_GROUPS = """
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
# nanoGPT's configure_optimizers: both groups share the default betas tuple
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
X, Y = torch.randn(64, 8), torch.randn(64, 1)
step = 0
while True:
    for g in optimizer.param_groups:
        g["lr"] = 1e-2 / (1 + step)
    loss = torch.nn.functional.mse_loss(model(X), Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    print("step", step, round(loss.item(), 6))
    step += 1
    if step >= 8:
        break
"""


def test_an_optimizer_whose_param_groups_share_a_tuple_is_verified_after_a_restore(tmp_path):
    """Two param groups (with and without weight decay) share AdamW's
    default betas tuple; a restore makes one tuple per group.  The restored
    optimizer was digested differently from the record's, so every worker
    that started from an iteration checkpoint ran its segment again from the
    start (right values, no speed-up)."""
    d = str(tmp_path)
    write_script(d, "train.py", TWO_PARAM_GROUPS)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(f"{d}/train.py", "loss.backward()",
         'print("gnorm", round(sum(p.grad.norm() ** 2 for p in model.parameters()).item(), 6))')
    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "4"})
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "ran again from its start" not in rep.stderr, rep.stderr
    resumed = _resumed(store(d))
    assert resumed[0] is None and resumed[1] is not None  # the second one did restore


def test_a_main_loop_that_runs_several_times_is_not_split(tmp_path, monkeypatch):
    """The training loop lives in a library trainer, which calls the
    script back: the loop flor takes for the main loop runs once per epoch.
    A worker would have to find its segment's execution among the others:
    replay runs it whole."""
    # The helper module stands for one flor does not analyse (an installed
    # library's): the project is the script alone.
    monkeypatch.setenv("FLOR_PROJECT_ROOT", "none")
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
    ckpt = st.layout.ckpt_dir(runs(st, "record")[0]["run_id"])
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


COUNTING_MODULE = '''
import torch
import flor

class Tally:
    def __init__(self):
        self.n = 0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)
        self.tally = Tally()  # an object: no checkpoint of the module holds it

    def forward(self, x):
        if self.training:
            self.tally.n += 1
        return self.fc(x) * (1 + 0.01 * self.tally.n)

torch.set_num_threads(1)
torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
X, Y = torch.randn(32, 4), torch.randn(32, 1)
for epoch in flor.generator(range(6), state=(net, opt)):
    for i in range(0, 32, 8):
        loss = ((net(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("epoch", epoch, net.tally.n, round(loss.item(), 6))
'''


def test_a_restore_that_misses_part_of_the_state_is_found_and_the_segment_runs_again(tmp_path):
    """The module counts its updates in an object its state dict does not
    hold, so the iteration checkpoint of state=(net, opt) restores the
    weights and loses the count.  The worker compares what it put back with
    the digest the record took, refuses the checkpoint, and its segment
    runs again from the start; the checks say so."""
    d = str(tmp_path)
    write_script(d, "train.py", COUNTING_MODULE)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(f"{d}/train.py", "opt.step()", 'print("w", round(net.fc.weight.sum().item(), 6))')
    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "3"})
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert ("segment 1 ran again from its start, without its iteration checkpoint: "
            in rep.stderr and "differs from what the record had at the end of iteration 2: "
            "state[0] (a Net)" in rep.stderr), rep.stderr
    assert _resumed(store(d)) == [None, None]



def test_the_likely_cause_names_the_segment_that_started_from_a_checkpoint(tmp_path, monkeypatch):
    """The loop counts its epochs in another module's global, which flor
    cannot see and no checkpoint holds: the segment that starts from an
    iteration checkpoint prints other counts from its first iteration on,
    and the likely cause says that this is where the values start to
    differ, and what the restore put back."""
    # The helper module stands for one flor does not analyse (an installed
    # library's): the project is the script alone.
    monkeypatch.setenv("FLOR_PROJECT_ROOT", "none")
    d = str(tmp_path)
    write_script(d, "tally.py", "count = 0\n\n\ndef bump():\n    global count\n"
                                "    count += 1\n")
    write_script(d, "train.py", COUNTING_MODULE.replace("import flor\n", "import tally\n")
                 .replace("flor.generator(range(6), state=(net, opt))", "range(6)")
                 .replace("    for i in", "    tally.bump()\n    for i in")
                 .replace("net.tally.n,", "tally.count,").replace("self.tally.n += 1", "pass"))
    flor(d, "record", "--no-adaptive", "train.py")
    edit(f"{d}/train.py", "opt.step()", 'print("w", round(net.fc.weight.sum().item(), 6))')
    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "3"})
    assert "deferred checks FAILED" in rep.stderr, rep.stderr
    assert ("likely cause: the first iteration whose values differ, 3, is in segment 1, which "
            "started from the iteration checkpoint of iteration 2 (earlier iterations are "
            "equal): the restore put back what the loop carries (opt, net: a module whose "
            "parameters an optimizer holds) as the record had it") in rep.stderr, rep.stderr
    assert "no block was restored before it" not in rep.stderr


def test_a_block_that_loops_over_an_iterator_kept_across_epochs_is_not_skipped(tmp_path):
    """`for x, y in itertools.islice(gen, 3)` and `for x, y in held_out:
    break` advance iterators the next epoch reads again: no checkpoint
    holds them, so neither these blocks nor the main loop are checkpointed,
    and a replay draws what the record drew.  A list of batches is
    iterated afresh by each epoch: its blocks are checkpointed."""
    d = str(tmp_path)
    write_script(d, "train.py", SLICED_GENERATOR)
    rec = flor(d, "record", "--no-adaptive", "train.py")
    assert ("it changes what no checkpoint holds (gen: a generator it loops over, whose "
            "position no checkpoint holds)") in rec.stderr, rec.stderr
    assert "held_out: a _SingleProcessDataLoaderIter it loops over" in rec.stderr, rec.stderr
    assert "the main loop train.py:19 carries what no checkpoint holds" in rec.stderr
    edit(f"{d}/train.py", "opt.zero_grad()", 'print("probe", round(x.sum().item(), 5))',
         after=False)
    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "2"})
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr

    d = str(tmp_path / "list")
    os.makedirs(d)
    write_script(d, "train.py", LIST_OF_BATCHES)
    rec = flor(d, "record", "--no-adaptive", "train.py")
    assert "no checkpoint holds" not in rec.stderr, rec.stderr
    assert "5 checkpoints" in rec.stderr and "5 iteration checkpoints" in rec.stderr, rec.stderr


def test_what_a_generator_runs_while_an_item_is_drawn_belongs_to_that_iteration(tmp_path):
    """A main loop over a generator that prints while it draws an item and
    after its last one: a replay printed the lines drawn for an iteration
    under the iteration before it (the record's), so its checks failed;
    and the last worker never drew the loop to its end, so the line
    printed after the last item was missing.  The random state a loop
    starts with is taken before its first item is drawn, in record as in
    replay."""
    d = str(tmp_path)
    write_script(d, "train.py", GENERATOR_MAIN_LOOP)
    flor(d, "record", "--no-adaptive", "train.py")
    st = store(d)
    rec = runs(st, "record")[0]
    assert rec["info"].main_ended is True
    edit(f"{d}/train.py", "opt.step()", 'print("probe", round(loss.item(), 6))', after=False)
    edit(f"{d}/train.py", "opt.zero_grad()", "loss = ((model(x) - y) ** 2).mean()")
    expected = plain(d, "train.py").stdout
    assert "every epoch drawn" in expected
    for jobs, starts in ((1, "0"), (2, "3")):
        rep = flor(d, "replay", "--jobs", str(jobs), "train.py", env={"FLOR_SEGMENTS": starts})
        assert rep.stdout == expected, (starts, rep.stderr)
        assert "deferred checks passed" in rep.stderr, rep.stderr
    replay = runs(st, "replay")[0]["run_id"]
    # torch's: the script seeds it, not Python's or numpy's generator
    recorded = [v["torch"] for _, _, v in values(st, rec["run_id"], "state@random")]
    assert recorded and [v["torch"] for _, _, v in values(st, replay, "state@random")] == recorded
