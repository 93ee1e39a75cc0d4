"""A hindsight statement's name: its printed lines are named after its
function and text, so that the name holds across edits that move it and
across replays of records whose sources differ; the name by its line in
the edited file still works."""
import ast
import os
import re

import pytest

import flor
from flor.statements import printed_names

from conftest import flor as flor_cli, read, runs, store, values, write_script

SCRIPT = """
import argparse

import torch


class Trainer:
    def __init__(self, lr):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.x, self.y = torch.randn(32, 4), torch.randn(32, 1)

    def train_epoch(self):
        for i in range(4):
            xb, yb = self.x[i * 8:(i + 1) * 8], self.y[i * 8:(i + 1) * 8]
            loss = torch.nn.functional.mse_loss(self.model(xb), yb)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return loss.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    trainer = Trainer(args.lr)
    for epoch in range(3):
        loss = trainer.train_epoch()
        print(f"epoch {epoch} loss {loss:.4f}")


main()
"""
PROBE = 'print("w norm", round(self.model.weight.norm().item(), 6))'


def _insert(path, anchor, lines):
    src = read(path).splitlines(keepends=True)
    i = next(i for i, l in enumerate(src) if anchor in l)
    indent = src[i][: len(src[i]) - len(src[i].lstrip())]
    src[i + 1:i + 1] = [indent + line + "\n" for line in lines]
    with open(path, "w") as f:
        f.write("".join(src))


def _line(path, text):
    return next(n for n, l in enumerate(read(path).splitlines(), 1) if text in l)


@pytest.mark.unit
def test_names_follow_function_and_text_not_lines():
    def names(src):
        return printed_names(ast.parse(src), "t.py")

    a = names("def f():\n    x = 1\n    print('a', x)\n\nprint('a', 1)\n")
    b = names("# moved\n\ndef f():\n    x = 1\n\n    print( 'a',x )  # spaced\n\nprint('a', 1)\n")
    assert a[3] == b[6] and a[5] == b[8]  # moved and respaced: the same names
    assert re.fullmatch(r"stdout@t\.py:f~[0-9a-f]{8}", a[3]) and re.fullmatch(
        r"stdout@t\.py:~[0-9a-f]{8}", a[5])
    assert a[3] != names("def g():\n    print('a', x)\n")[2]  # another function
    assert a[3] != names("def f():\n    print('b', x)\n")[2]  # another text
    # The same statement twice in one function: told apart by their order.
    twice = names("class T:\n    def f(self):\n        print(1)\n        y = 2\n        print(1)\n")
    assert twice[3] != twice[5] and twice[3].startswith("stdout@t.py:T.f~")
    # Every line of a statement that spans several has its name.
    long = names("def f():\n    print(\n        1,\n    )\n")
    assert long[2] == long[3] == long[4]
    # Statements that share a line are named together: a printed line's
    # place cannot tell which of them printed it.
    shared = names("def f():\n    print('w', 1); flush()\n    print('b', 1); flush()\n")
    assert shared[2] != shared[3] != names("def f():\n    print('w', 1)\n")[2]
    # The same name on every Python version flor supports (ast.dump's text
    # differs between them): a golden value.
    assert names("def train():\n    for e in range(3):\n"
                 "        print('w norm', model.weight.norm().item())\n")[3] == \
        "stdout@t.py:train~462f97ee"


def test_a_moved_statement_keeps_its_name_across_replays_and_records(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("FLOR_DIR", os.path.join(d, ".flor"))
    monkeypatch.chdir(d)
    path = write_script(d, "train.py", SCRIPT)
    flor_cli(d, "record", "--no-adaptive", "train.py")
    flor_cli(d, "record", "--no-adaptive", "train.py", "--lr", "0.05")
    st = store(d)
    rec1, rec2 = (r["run_id"] for r in runs(st, "record"))

    # Replay 1 (of the second record): the probe in the batch loop.
    _insert(path, "self.opt.step()", [PROBE])
    first_line = _line(path, PROBE)
    flor_cli(d, "replay", "train.py", "--lr", "0.05")
    # Replay 2 (of the first record): two lines added above the probe,
    # which is spaced differently.
    text = read(path).replace(PROBE, PROBE.replace(", 6)", ",6)")).replace(
        "        for i in range(4):\n", "        # the batches:\n        # four of eight\n"
                                      "        for i in range(4):\n")
    with open(path, "w") as f:
        f.write(text)
    second_line = _line(path, "w norm")
    assert second_line == first_line + 2
    flor_cli(d, "replay", "train.py", "--run", rec1)
    rep1, rep2 = (r["run_id"] for r in runs(st, "replay"))

    names = {r["name"] for rep in (rep1, rep2) for r in st.logs(rep)
             if r["loc"] in (f"train.py:new:{first_line}", f"train.py:new:{second_line}")}
    (name,) = names  # one name for the statement in both replays
    assert re.fullmatch(r"stdout@train\.py:Trainer\.train_epoch~[0-9a-f]{8}", name)

    # Both replays' values under it, in one frame, by run.
    df = flor.dataframe(f"{name}/w_norm", runs=[rep1, rep2])
    assert sorted(set(df["run"])) == sorted([rep1, rep2])
    for rep, old in ((rep1, first_line), (rep2, second_line)):
        lines = [v for _, _, v in values(st, rep, name)]
        assert len(lines) == 12 and all(v.startswith("w norm ") for v in lines)
        assert list(df[df["run"] == rep][f"{name}/w_norm"]) == [float(v.split()[-1])
                                                               for v in lines]
        # The old name, by its line in that replay's edited file, still works.
        assert values(st, rep, f"stdout@train.py:new:{old}") == values(st, rep, name)
    # Two records' different runs: their values differ (lr 0.05 and 0.1).
    assert list(df[df["run"] == rep1][f"{name}/w_norm"]) != \
        list(df[df["run"] == rep2][f"{name}/w_norm"])
    # flor.names() lists it by its new name, with where it is and its text.
    listed = flor.names(runs=[rep2])
    row = listed[listed["name"] == name].iloc[0]
    assert row["where"] == f"train.py:new:{second_line}" and "w norm" in row["source"]
