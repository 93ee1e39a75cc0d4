"""Hindsight over many past runs: `flor replay --runs` applies the statements
added to the script to every chosen record, each with its own arguments and
its own version of the script (the statements carried onto it by matching
the code around them), and a record they cannot be carried onto is skipped
with the reason."""
import os
import re

import pytest

from flor.program.transplant import base_of, carry
from flor.replay.many import choose

from conftest import flor as flor_cli, plain, read, runs, store, values, write_script

# Four versions of one training script, as a project's history has them: a
# variable renamed (and the training function, for one version), a line
# moved, an argument added.
V1 = """
import argparse

import torch
import torch.nn as nn


def batches(x, y, size):
    for i in range(0, len(x), size):
        yield x[i:i + size], y[i:i + size]


def train(model, opt, x, y, epochs):
    for epoch in range(epochs):
        running = 0.0
        for xb, yb in batches(x, y, 16):
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
        print(f"epoch {epoch} loss {running:.5f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    train(model, opt, x, y, args.epochs)


if __name__ == "__main__":
    main()
""".lstrip()
V2 = V1.replace("running", "total_loss").replace("train(", "fit(")  # and a function
V3 = V2.replace("fit(", "train(").replace("            loss = nn.functional.mse_loss(model(xb), yb)\n"
                "            opt.zero_grad()\n",
                "            opt.zero_grad()\n"
                "            loss = nn.functional.mse_loss(model(xb), yb)\n")
V4 = V3.replace('    p.add_argument("--epochs", type=int, default=3)\n',
                '    p.add_argument("--epochs", type=int, default=3)\n'
                '    p.add_argument("--momentum", type=float, default=0.0)\n').replace(
    "lr=args.lr)", "lr=args.lr, momentum=args.momentum)")
# An older version whose step is written otherwise: nothing to carry onto.
V0 = re.sub(r"\bopt\b", "optimizer", V1).replace("running += loss.item()", "running += float(loss)")
PROBE = "print('w', round(model.weight.norm().item(), 6))"


def with_probe(text):
    """The version with the statement added by hand, after the step."""
    for step in ("            opt.step()\n", "            optimizer.step()\n"):
        if step in text:
            return text.replace(step, step + "            " + PROBE + "\n")
    raise AssertionError("no step")


@pytest.mark.unit
def test_added_lines_are_carried_by_the_code_around_them():
    edited = with_probe(V4)
    for older in (V1, V2, V3):  # renamed, moved, one argument fewer
        got = carry(V4, edited, older, "train.py")
        assert got.why is None and got.lines == 1
        assert got.text == with_probe(older)
    # Both lines around it changed: not carried, and why.
    got = carry(V4, edited, V0, "train.py")
    assert got.text is None and "line 'opt.step()' above it is not" in got.why
    assert "at line 20 of train.py" in got.why and PROBE in got.why
    # The line above it is in another function too, first: it goes in the
    # same function as in the edited script.
    twice = V1.replace("def train(", "def pretrain(model, opt, x, y, epochs):\n" +
                       V1[V1.index("    for epoch"):V1.index("def main")] + "def train(")
    assert twice.count("opt.step()") == 2
    got = carry(V1, with_probe(V1), twice)
    assert got.text.index(PROBE) > got.text.index("def train(") > got.text.index("opt.step()")
    # A function renamed: its one such line still places it.
    renamed = V1.replace("def train(", "def fit(").replace("    train(model", "    fit(model")
    assert carry(V1, with_probe(V1), renamed).text == with_probe(renamed)
    # A line added beside a changed one is added; the changed one stays.
    edited_more = with_probe(V4).replace("loss {total_loss:.5f}", "loss {total_loss:.4f}") \
        .replace('        print(f"epoch', '        print("after", epoch)\n        print(f"epoch')
    got = carry(V4, edited_more, V3)
    assert got.lines == 2 and 'print("after", epoch)' in got.text and ":.5f" in got.text
    assert got.at == {20: 20, 22: 22}  # its lines there -> in the edited script
    # Carried, but the result does not parse: not carried.
    tabbed = V1.replace("            running += loss.item()", "\trunning += loss.item()")
    got = carry(V1, with_probe(V1).replace("opt.step()\n", "opt.step()\n    if True:\n"), tabbed)
    assert got.text is None and "does not parse" in got.why
    # Nothing added: the version as it is.
    assert carry(V4, V4, V1).text == V1
    # Its line is not in its function there, but in another function, or
    # in the other branch: that is not where it goes.
    two = ("def train(xs):\n    s = 0\n    for x in xs:\n        s += x.item()\n    return s\n\n"
           "def evaluate(xs):\n    s = 0\n    for x in xs:\n        s += x.item()\n    return s\n")
    edited = two.replace("s += x.item()\n", "s += x.item()\n        print(s)\n", 1)
    older = two.replace("s += x.item()\n", "s += float(x)\n", 1)
    got = carry(two, edited, older).text
    assert got.index("print(s)") < got.index("def evaluate")  # (before train's return)
    branches = ("def step(i, x):\n    if i % 2:\n        y = x * 2\n        z = 1\n    else:\n"
                "        y = x * 2\n        z = 2\n    return y, z\n")
    edited = branches.replace("y = x * 2\n", "y = x * 2\n        print(y)\n", 1)
    older = branches.replace("        y = x * 2\n        z = 1\n", "        y = x * 3\n        z = 3\n")
    got = carry(branches, edited, older)
    assert got.text is None and "not in this version" in got.why
    # A print added before a line the edit changes, and like it: the line
    # most like the old one is the change, the print is added.
    base = "def f(xs):\n    t = 0\n    for x in xs:\n        t += x.item()\n    return t\n"
    edited = base.replace("        t += x.item()\n",
                          "        print(x.item())\n        t += x.detach().item()\n")
    assert carry(base, edited, base.replace("t = 0", "t = 0.0")).text == \
        base.replace("t = 0", "t = 0.0").replace("        t += x.item()\n",
                                                 "        print(x.item())\n        t += x.item()\n")
    # Lines added beside a line rewritten past likeness: not told apart.
    edited = base.replace("        t += x.item()\n",
                          "        print('t', t + x.item())\n        t = t + float(x)\n")
    got = carry(base, edited, base.replace("t = 0", "t = 0.0"))
    assert got.text is None and "cannot tell which lines are added" in got.why
    # A line its function has twice (a warm-up loop's step) is an anchor
    # only where the line on the other side confirms it.
    warm = ("def fit(m, opt, data):\n    for _ in range(1):\n        for x in data:\n"
            "            opt.step()\n"
            "    for e in range(3):\n        for x in data:\n            opt.step()\n"
            "        print(e)\n")
    one = "def fit(m, opt, data):\n    for e in range(3):\n        for x in data:\n" \
          "            opt.step()\n        print('epoch', e)\n"
    edited = one.replace("opt.step()\n", "opt.step()\n            print('w')\n")
    got = carry(one, edited, warm)
    assert got.text is None and "not in this version" in got.why
    # Lines the version has there already are not added again.
    again = V1.replace("            opt.step()\n", "            opt.step()\n            " + PROBE + "\n")
    assert carry(V1, with_probe(V1), again) == (again, None, 0, {})
    # Lines that close the block above go where that block ends there.
    epoch_end = V1.replace('        print(f"epoch', "        with torch.no_grad():\n"
                           "            print('w', model.weight.norm().item())\n"
                           '        print(f"epoch')
    sched = V1.replace('        print(f"epoch', '        sched.step()\n        print(f"epoch')
    got = carry(V1.replace('        print(f"epoch {epoch} loss {running:.5f}")\n', ""),
                epoch_end.replace('        print(f"epoch {epoch} loss {running:.5f}")\n', ""),
                sched.replace('        print(f"epoch {epoch} loss {running:.5f}")\n', ""))
    assert got.text.index("sched.step()") < got.text.index("with torch.no_grad()")
    # An added line that assigns what the changed line did: not told apart.
    edited = base.replace("        t += x.item()\n",
                          "        u = x.item()\n        t += x.item() * 2\n        print(u)\n")
    assert "cannot tell" in carry(base, edited, base.replace("t = 0", "t = 0.0")).why
    # The version edited is the one the script differs least from: a newer
    # version with one line more is not it.
    assert base_of(with_probe(V4), {"a": V1, "b": V4, "c": V3}) == "b"
    assert base_of(with_probe(V2), {"a": V1, "b": V4, "c": V2}) == "c"
    extra = V2.replace("            opt.step()\n", "            opt.step()\n            check()\n")
    assert base_of(with_probe(V2), {"newer": extra, "older": V2}) == "older"
    # The newest version the edit only adds to, even where it recreates an
    # older one line for line.
    assert base_of(extra, {"newer": V2, "older": extra}) == "newer"


def test_one_statement_over_records_of_four_versions(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("FLOR_DIR", os.path.join(d, ".flor"))
    monkeypatch.chdir(d)
    path = os.path.join(d, "train.py")
    versions = [(V0, "0.01"), (V1, "0.02"), (V2, "0.03"), (V3, "0.04"), (V4, "0.05")]
    for text, lr in versions:
        write_script(d, "train.py", text)
        flor_cli(d, "record", "--no-adaptive", "train.py", "--lr", lr)
    st = store(d)
    records = [r["run_id"] for r in runs(st, "record")]
    write_script(d, "train.py", with_probe(V4))

    rep = flor_cli(d, "replay", "--runs", "all", "train.py")
    assert f"run {records[0]} is skipped: the code around the statement added at line 20" \
        in rep.stderr
    assert "4 of 5 records replayed, 1 skipped" in rep.stderr
    assert rep.stderr.count("deferred checks passed") == 4, rep.stderr
    replays = runs(st, "replay")
    assert [r["parent"] for r in replays] == records[1:]

    # Each record replayed its own version with the statement, and its own
    # arguments: its values are what a plain run of that prints.
    names = {r["name"] for rp in replays for r in st.logs(rp["run_id"])
             if r["loc"] and ":new:" in r["loc"]}
    (name,) = names  # one name over the four versions (`fit` in one of them)
    assert re.fullmatch(r"stdout@train\.py:train~[0-9a-f]{8}", name)
    for (text, lr), rp in zip(versions[1:], replays):
        assert rp["argv"][1:] == ["--lr", lr]
        write_script(d, "plain.py", with_probe(text))
        want = [l for l in plain(d, "plain.py", "--lr", lr).stdout.splitlines()
                if l.startswith("w ")]
        assert len(want) == 12
        assert [v for _, _, v in values(st, rp["run_id"], name)] == want
        with open(os.path.join(st.layout.run_dir(rp["run_id"]), "source.py")) as f:
            assert f.read() == with_probe(text)  # what it ran, kept

    # One frame: each run's values beside its own arguments.
    import flor

    df = flor.dataframe(f"{name}/w", runs=[r["run_id"] for r in replays])
    firsts = df.groupby("run", sort=False).head(1)
    assert list(firsts["lr"]) == [0.02, 0.03, 0.04, 0.05]
    assert firsts["momentum"].isna().tolist() == [True, True, True, False]
    assert len(set(firsts[f"{name}/w"])) == 4

    # Which records: ids (a unique start will do) or a filter of parameters.
    assert [r["run_id"] for r in choose(st, path, f"{records[3]},{records[1][:-2]}")[0]] == \
        [records[3], records[1]]
    assert [r["run_id"] for r in choose(st, path, "lr < 0.035 and lr > 0.015")[0]] == \
        records[1:3]
    bad = flor_cli(d, "replay", "--runs", "lr <", "train.py", check=False)
    assert bad.returncode == 2 and "neither run ids or names" in bad.stderr
    bad = flor_cli(d, "replay", "--runs", "all", "train.py", "--lr", "1", check=False)
    assert bad.returncode == 2 and "give no ARGS" in bad.stderr
    assert read(path) == with_probe(V4)  # the user's script as they left it
