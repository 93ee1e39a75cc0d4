"""Segment boundaries: a worker that starts its segment from an iteration
checkpoint puts back what one iteration hands to the next, and nothing else
(never a name the loop header has just bound), so that its iterations print
what a plain run prints."""
import json

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
