"""Segment boundaries: a worker that starts its segment from an iteration
checkpoint puts back what one iteration hands to the next, and nothing else
(never a name the loop header has just bound), so that its iterations print
what a plain run prints."""
import json
import os

from conftest import edit, flor, plain, read, runs, store, write_script

HEADER_REBOUND = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(12)]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    score = 0
    for b, (x, y) in enumerate(data):
        x = x * 2.0
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        correct = int((model(x).argmax(-1) == y).sum())
        score += correct
    print("score", score)
"""


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


TRAINER = """
    class Trainer:
        def __init__(self, callbacks):
            self.callbacks = callbacks

        def fit(self, model, epochs):
            for epoch in range(epochs):
                for cb in self.callbacks:
                    cb.on_epoch(self, model, epoch)
"""

CALLBACK = """
    import torch
    from mylib import Trainer
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(16, 4), torch.randint(0, 2, (16,))) for _ in range(20)]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)


    def train_epoch(model, opt, data):
        correct = 0
        for x, y in data:
            for _ in range(2):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            correct += int((model(x).argmax(-1) == y).sum())
        return correct


    class Printer:
        def on_epoch(self, trainer, model, epoch):
            print("epoch", epoch, "correct", train_epoch(model, opt, data))


    Trainer([Printer()]).fit(model, 3)
"""


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


INFINITE_LOADER = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class InfiniteDataLoader:
        def __init__(self, dataset, **kwargs):
            sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                     num_samples=int(1e10))
            self.train_loader = DataLoader(dataset, sampler=sampler, **kwargs)
            self.data_iter = iter(self.train_loader)

        def next(self):
            try:
                batch = next(self.data_iter)
            except StopIteration:
                self.data_iter = iter(self.train_loader)
                batch = next(self.data_iter)
            return batch


    torch.manual_seed(0)
    torch.set_num_threads(1)
    X = torch.randn(256, 8)
    Y = (X.sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch_loader = InfiniteDataLoader(TensorDataset(X, Y), batch_size=16, num_workers=2)


    def evaluate(model):
        total = 0.0
        for x, y in DataLoader(TensorDataset(X, Y), batch_size=64):
            total += torch.nn.functional.cross_entropy(model(x), y).item()
        return round(total, 4)


    step = 0
    while True:
        x, y = batch_loader.next()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step} | loss {loss.item():.4f}")
        if step % 20 == 0:
            val = evaluate(model)
            print("eval", val)
        step += 1
        if step >= 60:
            break
"""


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


ITERATOR_IN_BLOCK = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(100)]
    train_iter = iter(data)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(4):
        for step in range(10):
            x, y = next(train_iter)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        print("epoch", epoch, round(loss.item(), 6))
"""


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
