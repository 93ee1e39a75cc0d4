"""What a replayed script writes besides its output (flor/runtime/effects.py,
flor/runtime/files.py), end to end with real processes: TensorBoard events,
logging records and files are written once per replay however many workers
pseudoresume over one another's iterations, the values of SummaryWriter
and logging are stored like flor.log's, and the script's progress bars are
never dumped after a replay (flor/replay/progress.py draws replay's own)."""
import ast
import glob
import gzip
import io
import json
import os
import re
import shutil

import pytest

from conftest import ROOT, edit, flor, plain, read, runs, store, values, write_script
from flor import _core
from flor.program.probe import is_log_like
from flor.replay.progress import Progress

DATA = """
spec = importlib.util.find_spec("sklearn")
with gzip.open(os.path.join(spec.submodule_search_locations[0], "datasets", "data",
                            "digits.csv.gz"), "rt") as f:
    table = np.loadtxt(f, delimiter=",", dtype=np.float32)[:512]
X, y = torch.from_numpy(table[:, :64]) / 16.0, torch.from_numpy(table[:, 64]).long()
"""

# After flor's session ends (in record and in each replay worker) nothing of
# it is left patched: the script's own atexit check says so on stderr.
PATCHES_GONE = """
def _patched():
    import builtins, io, logging
    from torch.utils.tensorboard.writer import FileWriter, SummaryWriter
    import tqdm
    left = [f for f in (builtins.open, io.open, logging.Logger.callHandlers,
                        FileWriter.add_event, SummaryWriter.add_scalar, tqdm.tqdm.__init__)
            if hasattr(f, "__wrapped__") or "flor" in (getattr(f, "__module__", "") or "")]
    left += [f for f in sys.meta_path if type(f).__module__.startswith("flor")]
    if left:
        print("still patched:", left, file=sys.stderr)


atexit.register(_patched)
"""

TRAIN = """
import atexit
import gzip
import importlib.util
import logging
import os
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import flor
%s
logging.basicConfig(level=logging.INFO, format="%%(asctime)s %%(name)s %%(message)s",
                    handlers=[logging.StreamHandler(sys.stdout),
                              logging.FileHandler("train.log", "w")])
log = logging.getLogger("train")
torch.manual_seed(0)
torch.set_num_threads(1)
%s
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
writer = SummaryWriter("tb")
notes = open("notes.txt", "w")
for epoch in flor.generator(range(6)):
    if flor.SkipBlock.step_into("train"):
        for i in range(0, len(y), 64):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[i:i + 64]), y[i:i + 64])
            loss.backward()
            opt.step()
    model, opt = flor.SkipBlock.end(model, opt)
    acc = (model(X).argmax(1) == y).float().mean().item()
    writer.add_scalar("val/acc", acc, epoch)
    log.info(f"epoch {epoch} acc {acc:.4f}")
    print(f"epoch {epoch} acc {acc:.4f}")
writer.close()
notes.close()
""" % (PATCHES_GONE, DATA)

HINDSIGHT = '''\
w = model[0].weight.norm().item()
writer.add_scalar("hindsight/wnorm", w, epoch)
logging.getLogger("train").info(f"wnorm {epoch} {w:.6f}")
notes.write(f"wnorm {epoch} {w:.6f}\\n")
with open("appended.txt", "a") as f:
    f.write(f"wnorm {epoch} {w:.6f}\\n")'''


def _scalars(logdir):
    """{tag: [(step, value)]} of the event files in `logdir`, as TensorBoard reads them."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(logdir)
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _epochs(lines, word):
    """The epochs of the lines `word EPOCH ...`, in the order found."""
    return [int(m.group(1)) for l in lines for m in [re.search(rf"\b{word} (\d+)", l)] if m]


def test_side_effects_of_a_replay_happen_once_and_its_values_are_stored(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("sklearn")
    d = str(tmp_path)
    path = write_script(d, "train.py", TRAIN)
    # Every block checkpointed, whatever the rule would decide here: the
    # replay's later segments are reached through them (pseudoresume).
    rec = flor(d, "record", "--no-adaptive", "train.py")
    assert "still patched" not in rec.stderr, rec.stderr
    st = store(d)
    rec_id = runs(st, "record")[0]["run_id"]
    recorded_acc = [v for _, _, v in values(st, rec_id, "tb:val/acc")]
    assert len(recorded_acc) == 6 and all(isinstance(v, float) for v in recorded_acc)
    assert [v for _, _, v in values(st, rec_id, "log:train")] == \
        [f"epoch {e} acc {a:.4f}" for e, a in enumerate(recorded_acc)]
    # The handler's lines on stdout (with the time) are not printed values.
    assert re.search(r"train epoch 0 acc", rec.stdout)
    assert not [r for r in st.logs(rec_id) if "train epoch" in r["value"]]
    for name in ("tb", "train.log", "notes.txt"):  # what the record wrote, kept apart
        os.rename(os.path.join(d, name), os.path.join(d, name + ".record"))

    # In the training block (so that it is stepped into) and after it, in
    # the epoch loop; the epochs are split between two workers.
    edit(path, "opt.step()", 'writer.add_scalar("hindsight/loss", loss.item(), 8 * epoch + i // 64)')
    for line in reversed(HINDSIGHT.splitlines()):
        edit(path, 'print(f"epoch {epoch}', line.strip() if not line.startswith("    ")
             else "    " + line.strip())
    src = read(path)
    assert 'with open("appended.txt", "a") as f:\n        f.write(' in src, src

    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "3"})
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "still patched" not in rep.stderr, rep.stderr
    assert "in segments [0, 3), [3, 6)" in rep.stderr, rep.stderr
    rep_id = runs(st, "replay")[-1]["run_id"]
    # The second worker pseudoresumed over the first one's epochs.
    assert any(r["state"] == "pseudoresume" for r in st.rows("blockruns", rep_id))

    # TensorBoard: each epoch's value once, the recorded statement's too.
    # (Each worker writes an event file of its own: sorted by step.)
    tb = {tag: sorted(events) for tag, events in _scalars(os.path.join(d, "tb")).items()}
    assert [s for s, _ in tb["hindsight/wnorm"]] == list(range(6))
    assert [s for s, _ in tb["val/acc"]] == list(range(6))
    assert [s for s, _ in tb["hindsight/loss"]] == list(range(48))
    assert _scalars(os.path.join(d, "tb.record")).keys() == {"val/acc"}

    # Files: the log file the script truncates ("w") and its handler appends
    # to, the notes file opened before the loop ("w"), a file appended to.
    log_lines = read(os.path.join(d, "train.log")).splitlines()
    assert sorted(_epochs(log_lines, "wnorm")) == list(range(6)), log_lines
    assert sorted(_epochs(log_lines, "epoch")) == list(range(6)), log_lines
    for name in ("notes.txt", "appended.txt"):
        assert sorted(_epochs(read(os.path.join(d, name)).splitlines(), "wnorm")) == \
            list(range(6)), (name, read(os.path.join(d, name)), rep.stderr)
    # The replay's stdout (the workers' stdout, in iteration order): each once.
    assert _epochs(rep.stdout.splitlines(), "wnorm") == list(range(6)), rep.stdout

    # flor.db: the hindsight values, at the statements' new lines.
    wnorm = values(st, rep_id, "tb:hindsight/wnorm")
    assert [json.loads(i)[0] for i, _, _ in wnorm] == list(range(6))
    assert [v for _, _, v in wnorm] == pytest.approx([v for _, v in tb["hindsight/wnorm"]],
                                                     rel=1e-6)
    lines = [v for _, _, v in values(st, rep_id, "log:train")]
    assert [l for l in lines if l.startswith("wnorm")] == \
        [f"wnorm {e} {w:.6f}" for e, w in enumerate(v for _, _, v in wnorm)]
    assert [l for l in lines if l.startswith("epoch")] == \
        [f"epoch {e} acc {a:.4f}" for e, a in enumerate(recorded_acc)]
    assert len(values(st, rep_id, "tb:hindsight/loss")) == 48
    locs = {r["name"]: r["loc"] for r in st.logs(rep_id) if r["name"].startswith(("tb:", "log:"))}
    assert ":new:" in locs["tb:hindsight/wnorm"] and ":new:" not in locs["tb:val/acc"]


BARS = """
import gzip
import importlib.util
import os
import sys

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

torch.manual_seed(0)
torch.set_num_threads(1)
%s
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
notes = open("notes.txt", "w")
for epoch in tqdm(range(4), desc="epochs", file=sys.stdout):
    for i in tqdm(range(0, len(y), 64), desc="batches", leave=False):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X[i:i + 64]), y[i:i + 64])
        loss.backward()
        opt.step()
    acc = (model(X).argmax(1) == y).float().mean().item()
    print(f"epoch {epoch} acc {acc:.4f}")
""" % DATA

# What a tqdm bar draws: a percentage and the bar's edge ("  50%|#####"),
# each frame after a carriage return.
FRAME = re.compile(r"\d+%\||\r")


def test_progress_bars_pass_through_and_are_never_dumped(tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("sklearn")
    d = str(tmp_path)
    path = write_script(d, "train.py", BARS)  # hands-free: no flor in it
    rec = flor(d, "record", "train.py")
    # Live as in a plain run: the batch bars on stderr, the epoch bar on stdout.
    assert re.search(r"batches: +\d+%\|", rec.stderr) and re.search(r"epochs: +\d+%\|", rec.stdout)
    st = store(d)
    rec_id = runs(st, "record")[0]["run_id"]
    printed = [v for r in st.logs(rec_id) if r["name"].startswith("stdout@")
               for v in [json.loads(r["value"])]]
    assert printed == re.findall(r"epoch \d acc [\d.]+", rec.stdout)

    edit(path, "opt.step()", 'print(f"  loss {loss.item():.4f}")')
    edit(path, 'print(f"epoch {epoch}', 'notes.write(f"{epoch} {acc:.4f}\\n")')
    rep = flor(d, "replay", "--jobs", "2", "train.py", env={"FLOR_SEGMENTS": "2"})
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "WARNING" not in rep.stderr, rep.stderr  # notes.write(...) is a hindsight statement
    assert "in segments [0, 2), [2, 4)" in rep.stderr, rep.stderr
    # Stdout is what the script prints, without a frame of its bars; stderr
    # holds no frame either, and replay's own progress is one final line.
    assert rep.stdout == plain(d, "train.py", env={"TQDM_DISABLE": "1"}).stdout
    assert not FRAME.search(rep.stdout) and not FRAME.search(rep.stderr), rep.stderr
    assert "batches" not in rep.stderr and "epochs" not in rep.stdout + rep.stderr
    assert re.findall(r"(?m)^replay: .*", rep.stderr) == \
        [re.search(r"(?m)^replay: 4/4 iterations, 2 workers, [\d.]+ s.*", rep.stderr).group(0)]
    rep_id = runs(st, "replay")[-1]["run_id"]
    assert not any(FRAME.search(r["text"]) for r in st.rows("output", rep_id))
    assert sorted(read(os.path.join(d, "notes.txt")).splitlines()) == \
        sorted(l.split()[1] + " " + l.split()[3] for l in rep.stdout.splitlines()
               if l.startswith("epoch "))


def test_flor_imports_neither_tensorboard_nor_tqdm(tmp_path):
    d = str(tmp_path)
    write_script(d, "tiny.py", """
        import sys
        import flor

        for i in flor.generator(range(2)):
            flor.log("i", i)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("tqdm", "tensorboard")))
    """)
    rec = flor(d, "record", "tiny.py")
    assert rec.stdout == "[]\n", rec.stdout + rec.stderr


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _progress(stream, **kw):
    p = Progress(4, 2, stream=stream, **kw)
    for _ in range(4):
        p.step()
    p.close()
    p.close()  # the last line once
    return stream.getvalue()


@pytest.mark.unit
def test_replay_progress_outside_a_terminal_is_one_final_line():
    out = _progress(io.StringIO())
    assert re.fullmatch(r"replay: 4/4 iterations, 2 workers, [\d.]+ s( \([\d.]+ it/s\))?\n",
                        out), out


@pytest.mark.unit
def test_replay_progress_on_a_terminal():
    pytest.importorskip("tqdm")
    out = _progress(_Terminal())
    assert out.endswith("\n") and out.count("\n") == 1, out  # redrawn in place, then left
    last = out.rstrip("\n").split("\r")[-1]
    assert "replay: 100%" in last and "4/4" in last and "2 workers" in last, last
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, +[\d.?]+ ?(it/s|s/it)", last), last  # elapsed<ETA, rate
    plain_out = _progress(_Terminal(), use_tqdm=False)
    assert plain_out.endswith("\n") and plain_out.count("\n") == 1
    assert "\rreplay [" in plain_out and "4/4 iterations, 2 workers" in plain_out


@pytest.mark.unit
def test_stdout_written_under_a_barrier_belongs_to_no_statement():
    """What a logging handler writes to stdout (under the patched
    Logger.callHandlers, a barrier) is output, not a printed line of the
    statement that logged."""
    def handler(write):
        write("2026-01-01 12:00:00 train epoch 0\n")

    j = _core.Journal(lambda code: None if code is handler.__code__ else True)
    j.info = ("info",)
    real = io.StringIO()
    out = _core.Tee(j, real, 0, True).write
    out("printed\n")
    handler(out)
    segs = j.take()
    assert [(s[2] is not None, s[5]) for s in segs] == \
        [(True, "printed\n"), (False, "2026-01-01 12:00:00 train epoch 0\n")]
    assert real.getvalue() == "printed\n2026-01-01 12:00:00 train epoch 0\n"


@pytest.mark.parametrize("stmt, hindsight", [
    ("notes.write(f'{epoch} {acc}\\n')", True), ("open('a.txt', 'a').write(str(x))", True),
    ("out.writelines(lines)", True), ("csv_out.writerow([epoch, acc])", True),
    ("write(x)", False), ("buf.write(w.mul_(2))", False),
])
@pytest.mark.unit
def test_writes_to_a_file_are_hindsight_statements(stmt, hindsight):
    assert is_log_like(ast.parse(stmt).body[0]) is hindsight


FILES = """
import json
import torch
import flor

torch.set_num_threads(1)


def save_config(cfg):
    with open("config.json", "w") as f:
        json.dump(cfg, f)


save_config({"lr": 0.1})
save_config({"lr": 0.1, "epochs": 4})  # the set-up writes one file twice
cfg = json.load(open("config.json"))
log = open("epochs.txt", "w")
w = torch.zeros(3)
for epoch in flor.generator(range(4)):
    if flor.SkipBlock.step_into("train"):
        for _ in range(3):
            w += 1
    w = flor.SkipBlock.end(w)
    flor.log("wsum", w.sum().item())
    print("epoch", epoch, file=log, flush=True)
log.close()
print(cfg, open("config.json").read())
"""


@pytest.mark.parametrize("how", ["one segment", "jobs 2", "part 1 before part 0"])
def test_files_the_set_up_writes_are_as_a_plain_run_leaves_them(tmp_path, how):
    d = str(tmp_path)
    write_script(d, "files.py", FILES)
    flor(d, "record", "--no-adaptive", "files.py")
    with open(os.path.join(d, "epochs.txt"), "a") as f:
        f.write("left by an earlier run\n")
    if how == "one segment":
        out = flor(d, "replay", "files.py").stdout
    else:
        edit(os.path.join(d, "files.py"), "w += 1", 'print("probe", w.sum().item())')
        two = {"FLOR_SEGMENTS": "2"}  # a second worker pseudoresumes
        if how == "jobs 2":
            proc = flor(d, "replay", "--jobs", "2", "files.py", env=two)
            out = proc.stdout
            assert "in segments [0, 2), [2, 4)" in proc.stderr
        else:
            flor(d, "replay", "--part", "1/2", "files.py", env=two)
            flor(d, "replay", "--part", "0/2", "files.py", env=two)
            out = flor(d, "merge").stdout
    assert "{'lr': 0.1, 'epochs': 4} {\"lr\": 0.1, \"epochs\": 4}" in out
    with open(os.path.join(d, "epochs.txt")) as f:
        assert sorted(f.read().splitlines()) == [f"epoch {i}" for i in range(4)]


LEFT_OPEN = """
import atexit
import gzip
import torch
import flor

torch.set_num_threads(1)


def total(w):  # (a function: every global is in a reference cycle with it)
    return w.sum().item()


class Notes:
    def __init__(self, path):
        self.file = open(path, "w")
        self.write = self.file.write
        self.me = self  # a reference cycle: only a garbage collection frees it


notes = Notes("notes.txt")
atexit.register(lambda: notes.write("bye\\n"))  # written as the script exits
packed = gzip.open("notes.gz", "wt")  # a library's file: its trailer is written as it closes
w = torch.zeros(3)
for epoch in flor.generator(range(4)):
    if flor.SkipBlock.step_into("train"):
        for _ in range(3):
            w += 1
    w = flor.SkipBlock.end(w)
    flor.log("wsum", total(w))
    notes.write(f"epoch {epoch} {total(w)}\\n")
    packed.write(f"epoch {epoch} {total(w)}\\n")
"""


@pytest.mark.parametrize("jobs,starts,segments", [("1", "0", "[0, 4)"),
                                                   ("2", "2", "[0, 2), [2, 4)")])
def test_a_file_the_script_leaves_open_is_written_as_in_a_plain_run(tmp_path, jobs, starts,
                                                                    segments):
    # Never closed, in reference cycles: a plain run's last garbage
    # collections flush and close them; so must a replay worker's exit.
    d = str(tmp_path)
    write_script(d, "notes.py", LEFT_OPEN)
    plain(d, "notes.py")
    expected = read(os.path.join(d, "notes.txt")).splitlines()
    epochs = [f"epoch {i} {3.0 * (i + 1) * 3}" for i in range(4)]
    assert expected == epochs + ["bye"]
    with gzip.open(os.path.join(d, "notes.gz"), "rt") as f:
        assert f.read().splitlines() == epochs
    flor(d, "record", "--no-adaptive", "notes.py")
    os.unlink(os.path.join(d, "notes.txt"))
    os.unlink(os.path.join(d, "notes.gz"))
    proc = flor(d, "replay", "--jobs", jobs, "notes.py", env={"FLOR_SEGMENTS": starts})
    assert "deferred checks passed" in proc.stderr, proc.stderr
    assert f"4 iterations in segments {segments}\n" in proc.stderr, proc.stderr
    lines = read(os.path.join(d, "notes.txt")).splitlines()
    if jobs == "2":  # each part runs the exit handlers its set-up registered (one per part)
        assert lines.count("bye") == 2
        lines.remove("bye")
    assert sorted(lines) == sorted(expected)
    if jobs == "1":  # (gzip opens its file itself: two workers' set-ups each truncate it)
        with gzip.open(os.path.join(d, "notes.gz"), "rt") as f:
            assert f.read().splitlines() == epochs


# What the script sees of the functions replay guards (open, os.replace...):
# a script that reads their names or docstrings prints the same under flor.
INTROSPECTS = """
import inspect
import io
import os
import pickle
import torch

torch.set_num_threads(1)


def show(f):
    print(f.__name__, f.__qualname__, f.__module__, f.__doc__.splitlines()[0])


show(open)
show(io.open)
show(os.replace)
show(os.rename)
show(os.remove)
show(os.unlink)
print(inspect.signature(open), pickle.loads(pickle.dumps(os.replace)) is os.replace)
w = torch.zeros(3)
for epoch in range(4):
    for _ in range(3):
        w += 1
    print("epoch", epoch, w.sum().item())
"""


def test_a_replay_shows_the_script_open_and_os_as_they_are(tmp_path):
    d = str(tmp_path)
    write_script(d, "introspects.py", INTROSPECTS)
    expected = plain(d, "introspects.py").stdout
    assert "open open io Open file and return a stream." in expected
    assert "replace replace posix Rename" in expected
    assert flor(d, "record", "--no-adaptive", "introspects.py").stdout == expected
    edit(os.path.join(d, "introspects.py"), "w += 1", 'print("probe", w.sum().item())')
    expected = plain(d, "introspects.py").stdout
    two = {"FLOR_SEGMENTS": "2"}  # the second worker suppresses its set-up: os is patched
    proc = flor(d, "replay", "--jobs", "2", "introspects.py", env=two)
    assert "segments [0, 2), [2, 4)" in proc.stderr
    assert proc.stdout == expected


# Two workers of a replay write and read files side by side, in the order
# load can give (FIFOs opened by the replay only force it): the second part's
# set-up reads back its config while the first part is half-way through
# writing it, and the second part's first line comes before the first part
# opens the file, its next line after the first part's first.
INTERLEAVED = """
import json
import os
import signal
import torch
import flor

torch.set_num_threads(1)
sync = os.environ.get("SYNC_DIR")
worker = os.environ.get("FLOR_REPLAY_WORKER")


def meet(name, flags):
    signal.alarm(60)  # (a test that fails does not hang)
    os.close(os.open(os.path.join(sync, name), flags))
    signal.alarm(0)


with open("config.json", "w") as f:
    f.write('{"lr": 0.1, ')
    f.flush()
    if sync and worker == "0":
        meet("half_written", os.O_WRONLY)
        meet("read_back", os.O_RDONLY)
    f.write('"epochs": 4}')
if sync and worker == "1":
    meet("half_written", os.O_RDONLY)
cfg = json.load(open("config.json"))
if sync and worker == "1":
    meet("read_back", os.O_WRONLY)
if sync and worker == "0":
    meet("second_wrote", os.O_RDONLY)
log = open("epochs.txt", "w")
w = torch.zeros(3)
lines = 0  # written by this worker (not in the iterations it pseudoresumes)
for epoch in flor.generator(range(cfg["epochs"])):
    ran = False
    if flor.SkipBlock.step_into("train"):
        ran = True
        for _ in range(3):
            w += 1
    w = flor.SkipBlock.end(w)
    if sync and worker == "1" and lines == 1:
        meet("first_wrote", os.O_RDONLY)
    print("epoch", epoch, file=log, flush=True)
    lines += ran
    if sync and ran and lines == 1:
        meet("second_wrote" if worker == "1" else "first_wrote", os.O_WRONLY)
if sync and worker == "1" and lines == 1:
    meet("first_wrote", os.O_RDONLY)
log.close()
"""

_MEETINGS = ("half_written", "read_back", "second_wrote", "first_wrote")


def test_workers_writing_and_reading_files_side_by_side_lose_nothing(tmp_path):
    d = str(tmp_path)
    write_script(d, "interleaved.py", INTERLEAVED)
    flor(d, "record", "--no-adaptive", "interleaved.py")
    with open(os.path.join(d, "epochs.txt"), "a") as f:
        f.write("left by an earlier run\n")
    edit(os.path.join(d, "interleaved.py"), "w += 1", 'print("probe", w.sum().item())')
    sync = tmp_path / "sync"
    sync.mkdir()
    for name in _MEETINGS:
        os.mkfifo(sync / name)
    try:
        proc = flor(d, "replay", "--jobs", "2", "interleaved.py",
                    env={"SYNC_DIR": str(sync), "FLOR_SEGMENTS": "2"})
    finally:  # a worker still waiting at a FIFO (the test failed) goes on
        for name in _MEETINGS:
            os.close(os.open(sync / name, os.O_RDWR | os.O_NONBLOCK))
    assert "in segments [0, 2), [2, 4)\n" in proc.stderr
    assert "running it again" not in proc.stderr  # (no worker ran again)
    with open(os.path.join(d, "epochs.txt")) as f:
        lines = f.read().splitlines()
    assert lines[:2] == ["epoch 2", "epoch 0"]
    assert sorted(lines) == [f"epoch {i}" for i in range(4)]
    assert json.loads(read(os.path.join(d, "config.json"))) == {"lr": 0.1, "epochs": 4}


STALLED = """
import json
import os
import signal
import torch
import flor

torch.set_num_threads(1)
stall = os.environ.get("STALL") and os.environ.get("FLOR_REPLAY_WORKER") == "0"
with open("config.json", "w") as f:
    json.dump({"lr": 0.1, "epochs": 8}, f)
cfg = json.load(open("config.json"))
log = open("epochs.txt", "w")
w = torch.zeros(3)
for epoch in flor.generator(range(cfg["epochs"])):
    if flor.SkipBlock.step_into("train"):
        for _ in range(3):
            w += 1
    w = flor.SkipBlock.end(w)
    print("epoch", epoch, file=log, flush=True)
    if stall:
        signal.alarm(60)  # (a test that fails does not hang)
        signal.pause()  # the first worker stalls: a copy of its segment finishes it
log.close()
"""


def test_a_copy_of_a_stalled_worker_leaves_the_files_its_set_up_wrote_alone(tmp_path):
    d = str(tmp_path)
    write_script(d, "stalled.py", STALLED)
    flor(d, "record", "--no-adaptive", "stalled.py")
    edit(os.path.join(d, "stalled.py"), "w += 1", 'print("probe", w.sum().item())')
    proc = flor(d, "replay", "--jobs", "2", "stalled.py",
                env={"STALL": "1", "FLOR_SEGMENTS": "4"})
    assert "segment 0 is running slowly; running a copy of it" in proc.stderr
    assert "deferred checks passed" in proc.stderr
    # The copy's set-up wrote config.json privately: it is as the first run left it.
    assert json.loads(read(os.path.join(d, "config.json"))) == {"lr": 0.1, "epochs": 8}
    with open(os.path.join(d, "epochs.txt")) as f:
        lines = f.read().splitlines()
    # Nothing lost; the copy wrote its segment's lines again
    # (docs/resume-and-elastic-replay.md).
    assert sorted(set(lines)) == sorted(f"epoch {i}" for i in range(8))
    # The killed worker's private copies are gone with the replay.
    assert glob.glob(os.path.join(d, ".flor", "runs", "*", "private")) == []


def test_a_trainer_that_keeps_its_outputs_in_files_replays_on_two_workers(tmp_path):
    # Hands-free, unmodified: tests/scripts/handsfree/outputs.py.
    d = str(tmp_path)
    shutil.copy(os.path.join(ROOT, "tests", "scripts", "handsfree", "outputs.py"), d)
    flor(d, "record", "--no-adaptive", "outputs.py")
    out = os.path.join(d, "out")
    recorded = {name: read(os.path.join(out, name)) for name in sorted(os.listdir(out))}
    assert sorted(recorded) == ["args.json", "meta.json", "metrics.csv", "model.json",
                                "train.log"]
    edit(os.path.join(d, "outputs.py"), "loss.backward()",
         'print(f"  grad {model[0].weight.grad.norm().item():.6f}")')
    proc = flor(d, "replay", "--jobs", "2", "outputs.py")
    assert "deferred checks passed" in proc.stderr
    # No worker failed and ran again (the set-up read back its own files),
    # nor found its file objects to be loop state.
    assert "running it again" not in proc.stderr and "program changed" not in proc.stderr
    assert len(re.findall(r"^  grad ", proc.stdout, re.M)) == 6 * 15
    assert sorted(os.listdir(out)) == sorted(recorded)  # (no meta.json.tmp)
    for name, text in recorded.items():
        # Lines in the order the workers wrote them; the same lines.
        assert sorted(read(os.path.join(out, name)).splitlines()) == sorted(text.splitlines())
    assert glob.glob(os.path.join(d, ".flor", "runs", "*", "private")) == []


ATOMIC = """
import os
import torch
import flor

torch.set_num_threads(1)
os.makedirs("out", exist_ok=True)
w = torch.zeros(3)
for epoch in flor.generator(range(4)):
    if flor.SkipBlock.step_into("train"):
        for _ in range(3):
            w += 1
    w = flor.SkipBlock.end(w)
    with open(f"out/e{epoch}.tmp", "w") as f:  # saved atomically, every epoch
        f.write(f"{w.sum().item()}\\n")
    os.replace(f"out/e{epoch}.tmp", f"out/e{epoch}.txt")
"""


def test_files_saved_atomically_in_pseudoresumed_iterations(tmp_path):
    d = str(tmp_path)
    write_script(d, "atomic.py", ATOMIC)
    flor(d, "record", "--no-adaptive", "atomic.py")
    recorded = {n: read(os.path.join(d, "out", n)) for n in os.listdir(os.path.join(d, "out"))}
    edit(os.path.join(d, "atomic.py"), "w += 1", 'print("probe", w.sum().item())')
    proc = flor(d, "replay", "--jobs", "2", "atomic.py", env={"FLOR_SEGMENTS": "2"})
    assert "in segments [0, 2), [2, 4)" in proc.stderr
    # The second worker pseudoresumed the first's iterations: their files were
    # renamed privately, not missed (FileNotFoundError) nor written twice.
    assert {n: read(os.path.join(d, "out", n)) for n in os.listdir(os.path.join(d, "out"))} \
        == recorded


COPY_STALLS = """
import os
import signal
import torch
import flor

torch.set_num_threads(1)
gate = os.environ.get("GATE")
w = torch.zeros(3)
for epoch in flor.generator(range(8)):
    if flor.SkipBlock.step_into("train"):
        w += 1
    w = flor.SkipBlock.end(w)
    print("epoch", epoch, w.sum().item())
    worker = os.environ.get("FLOR_REPLAY_WORKER")
    # The second worker comes here first running the second segment (its
    # set-up), then as the copy of the first, started once that one stalls.
    if gate and epoch == 1 and worker == "1" and os.path.exists(gate + ".seen"):
        os.close(os.open(gate, os.O_WRONLY))  # lets the first worker go on
        signal.alarm(60)  # (a test that fails does not hang)
        signal.pause()  # the copy stalls: the first worker finishes its segment
    elif gate and epoch == 1 and worker == "1":  # (os.open: even where replay drops writes)
        os.close(os.open(gate + ".seen", os.O_CREAT | os.O_WRONLY))
    elif gate and epoch == 1 and worker == "0":
        with open(gate) as f:  # waits until a copy of its segment has started
            f.read()
"""


def test_a_copy_that_loses_to_its_original_is_stopped(tmp_path):
    d = str(tmp_path)
    write_script(d, "race.py", COPY_STALLS)
    flor(d, "record", "--no-adaptive", "race.py")
    edit(os.path.join(d, "race.py"), "w += 1", 'print("probe", w.sum().item())')
    gate = os.path.join(d, "gate")
    os.mkfifo(gate)
    proc = flor(d, "replay", "--jobs", "2", "race.py", env={"GATE": gate, "FLOR_SEGMENTS": "4"})
    assert "segment 0 is running slowly; running a copy of it" in proc.stderr
    assert "deferred checks passed" in proc.stderr and "replay: 8/8 iterations" in proc.stderr
    assert proc.stdout == plain(d, "race.py").stdout
