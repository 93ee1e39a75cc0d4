"""Models back: flor.state reads a record's iteration checkpoint by the
script's names, and what it returns loads into fresh objects of the
user's, which then train on exactly as the record did.  Real records (real
processes, stores and checkpoint files); the loading runs in a fresh
interpreter, as a user's notebook would."""
import os

import pytest

from conftest import flor, run_py, store, write_script

# A hands-free script: what its main loop carries is known by its names.
SCRIPT = """
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_num_threads(1)
X = torch.randn(64, 5)
Y = X @ torch.arange(5.0).unsqueeze(1)
model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
step = 0
for epoch in range(4):
    for i in range(0, 64, 16):
        loss = ((model(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
    scheduler.step()
    print("epoch", epoch, repr(sum(p.double().sum().item() for p in model.state_dict().values())))
"""

# What the test's fresh interpreter builds: the script's objects, untrained.
FRESH = """
import flor
import torch
import torch.nn as nn

torch.manual_seed(1)  # other weights than the record's: the restore must replace them
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)

def total():
    return repr(sum(p.double().sum().item() for p in model.state_dict().values()))
"""


def printed(proc):
    return dict(line.split(" ", 1)[1].split(" ") for line in proc.stdout.splitlines()
                if line.startswith("epoch "))


def test_a_records_state_comes_back_by_the_scripts_names_and_trains_on_as_recorded(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", SCRIPT)
    rec = flor(d, "record", "--no-adaptive", "--name", "base", "train.py")
    sums = printed(rec)
    env = {"FLOR_DIR": os.path.join(d, ".flor")}
    proc = run_py(FRESH + """
import sys
torch.manual_seed(0)
X = torch.randn(64, 5)
Y = X @ torch.arange(5.0).unsqueeze(1)
print("checkpoints", flor.state_iterations("base"))
ck = flor.state("base", iteration=1)
print("keys", list(ck), ck.iteration, ck.read, ck.loop)
model.load_state_dict(ck["model"])
print("at 1", total())
out = ck.restore(optimizer=optimizer, scheduler=scheduler)
assert out == (optimizer, scheduler)
step = ck["step"]
for epoch in (2, 3):  # what the record did next, from the state it saved
    for i in range(0, 64, 16):
        loss = ((model(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
    scheduler.step()
    print("after", epoch, total(), step)
last = flor.state()  # the latest record's last checkpoint
print("last", last.iteration, last.run == ck.run)
""", env=env, cwd=d)
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["checkpoints"] == "[0, 1, 2, 3]"
    assert out["keys"] == "['optimizer', 'step', 'scheduler', 'model'] 1 signed train.py:12"
    assert out["at"] == f"1 {sums['1']}"
    # The restored optimizer (Adam's moments), scheduler and BatchNorm
    # statistics continue the record exactly: the same weights, bit for bit.
    afters = [line.split(" ")[1:] for line in proc.stdout.splitlines() if line.startswith("after")]
    assert afters == [["2", sums["2"], "12"], ["3", sums["3"], "16"]]
    assert out["last"] == "3 True"
    assert "state_iterations:    0 1 2 3 (4; flor.state reads them)" in \
        flor(d, "show", "base").stdout.splitlines()


def test_the_manual_apis_state_comes_back_by_position(tmp_path):
    d = str(tmp_path)
    write_script(d, "manual.py", """
        import flor
        import torch

        torch.manual_seed(0)
        w = torch.zeros(3)
        model = torch.nn.Linear(3, 1)
        for epoch in flor.generator(range(3), state=(model, w)):
            if flor.SkipBlock.step_into("inner"):
                for _ in range(2):
                    w += 0.5
                    with torch.no_grad():
                        model.weight += 1
            model, w = flor.SkipBlock.end(model, w)
            print("epoch", epoch, w.sum().item())
        """)
    flor(d, "record", "--no-adaptive", "manual.py")
    proc = run_py("""
        import flor, torch
        ck = flor.state(iteration=1)
        print(list(ck), ck[1].tolist())
        model, w = torch.nn.Linear(3, 1), torch.zeros(3)
        before = model.weight.clone()
        assert ck.restore(model, w) == (model, w)
        print(w.tolist(), torch.equal(model.weight, ck[0]["weight"]))
        """, env={"FLOR_DIR": os.path.join(d, ".flor")}, cwd=d)
    assert proc.stdout.splitlines() == ["[0, 1] [2.0, 2.0, 2.0]", "[2.0, 2.0, 2.0] True"]


def test_what_cannot_be_read_back_is_named_with_what_can(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", SCRIPT)
    rec = flor(d, "record", "train.py", "--epsilon", "1e-9")  # the rule takes none
    flor(d, "record", "--no-adaptive", "--name", "every", "train.py")
    st = store(d)
    first = st.runs()[0]["run_id"]
    env = {"FLOR_DIR": os.path.join(d, ".flor")}
    proc = run_py(f"""
        import flor
        def said(f, *a, **k):
            try:
                f(*a, **k)
            except Exception as e:
                print(type(e).__name__, str(e).split(" (")[0])
        said(flor.state, {first!r})
        said(flor.state, "every", iteration=7)
        said(flor.state, "every", iteration="1")
        said(flor.state, "every", iteration=True)
        said(flor.state, 3)
        said(flor.state, "")
        said(flor.state, "nosuchrun")
        said(lambda: flor.state("every")["loss"])
        said(lambda: flor.state("every").restore(1, 2, 3, 4, 5))
        """, env=env, cwd=d)
    assert rec.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines[0] == f"FlorError run {first} has no iteration checkpoint of its main loop: " \
        "the adaptive rule took none"
    assert lines[1].startswith("FlorError run ") and lines[1].endswith(
        "has no checkpoint of iteration 7 of its main loop; the nearest it checkpointed is 3")
    assert lines[2] == "TypeError iteration must be an int, not str"
    assert lines[3] == "TypeError iteration must be an int, not bool"
    assert lines[4] == lines[5] == "TypeError run must name a record"  # (said up to its " (")
    assert lines[6].startswith("FlorError no record 'nosuchrun' in ")
    assert lines[7].startswith("KeyError \"'loss': the main loop of run ") and \
        lines[7].endswith("carried ['optimizer', 'step', 'scheduler', 'model']\"")
    assert lines[8].startswith("TypeError 5 objects given, and run ")

    flor(d, "replay", "train.py")  # a replay's id names its record
    replay = [r for r in store(d).runs() if r["kind"] == "replay"][0]
    proc = run_py(f"""
        import flor
        try:
            flor.state({replay['run_id']!r})
        except flor.errors.FlorError as e:
            print(e)
        """, env=env, cwd=d)
    assert proc.stdout.strip() == (f"run {replay['run_id']} is a replay; the state it starts "
                                   f"from is its record's: flor.state({replay['parent']!r})")


def test_a_scripts_module_level_objects_come_back_by_their_names(tmp_path):
    """The PyTorch examples' shape: the model, optimizer and scheduler are
    module variables that main()'s loop changes through train(); a numpy
    integer (flor.dataframe's iteration column) picks an iteration."""
    d = str(tmp_path)
    write_script(d, "ex.py", """
        import torch
        import torch.nn as nn

        torch.manual_seed(0)
        X = torch.randn(32, 4)
        Y = X.sum(1, keepdim=True)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)


        def train(epoch):
            for i in range(0, 32, 8):
                loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            return loss.item()


        def main():
            for epoch in range(3):
                loss = train(epoch)
                scheduler.step()
                print("bias", repr(model.bias.item()))


        if __name__ == "__main__":
            main()
        """)
    biases = flor(d, "record", "--no-adaptive", "ex.py").stdout.split()[1::2]
    proc = run_py("""
        import flor, numpy, torch
        ck = flor.state("latest", numpy.int64(1))
        print(sorted(ck), ck.iteration, repr(ck["model"]["bias"].item()))
        model = torch.nn.Linear(4, 1)
        ck.restore(model=model)
        print(repr(model.bias.item()))
        """, env={"FLOR_DIR": os.path.join(d, ".flor")}, cwd=d)
    assert proc.stdout.splitlines() == [f"['model', 'optimizer', 'scheduler'] 1 {biases[1]}",
                                        biases[1]]


@pytest.mark.unit
def test_keys_are_the_names_in_a_signature_and_types_mean_positions():
    from flor.recorded import _TYPE, _keys

    assert _keys(["global model", "step", "self.opt", "W, b: parameters of an optimizer",
                  "parameters: of one", "parameters: of another"]) == \
        ["model", "step", "self.opt", "W, b", "parameters", "parameters#2"]
    for label in ("torch.nn.modules.linear.Linear", "builtins.int", "__main__.Net",
                  "collections.OrderedDict", "numpy.ndarray"):
        assert _TYPE.fullmatch(label), label
    for label in ("model", "self.model", "trainer.opt", "global model", "W, b: parameters"):
        assert not _TYPE.fullmatch(label), label
