"""Killed and evicted records: what they keep, replay of them, `record
--resume`, and replay workers that die.  Scripts are a small trainer in the
style of the PyTorch examples (hands-free, its epoch loop in main():
tests/scripts/handsfree/digits_epochs.py) and a manual-API one that passes
its loop's state."""
import json
import os
import signal
import textwrap

import pytest

from conftest import ROOT, flor, read, store, write_script

# The sanitized build (make test-asan) runs the records killed while the C
# core writes (in a thread, in forked children); the other cases here are
# the Python of lifecycles, resumes and replay workers over the same paths.
CORE = pytest.mark.core

def _stoppable(source):
    """tests/scripts/handsfree/digits_epochs.py, which kills itself (signal
    STOP_WITH) when STOP_AT names an epoch it has printed, or is "start".
    Before it does, it waits (up to a minute) for the iteration checkpoint
    of the epoch before to be durable (under its final name): the
    background writer may still be at it, and a killed record keeps what
    was written."""
    source = source.replace("import sys\n", "import glob\nimport os\nimport sys\nimport time\n", 1)
    source = source.replace(
        '    print("data ready")\n',
        '    print("data ready")\n'
        '    if os.environ.get("STOP_AT") == "start":\n'
        '        os.kill(os.getpid(), 9)\n', 1)
    source = source.replace(
        '              f"noise {torch.rand(1).item():.6f}", flush=True)\n',
        '              f"noise {torch.rand(1).item():.6f}", flush=True)\n'
        '        if os.environ.get("STOP_AT") == str(epoch):\n'
        '            done = os.path.join(os.environ["FLOR_DIR"], "runs", "*", "ckpt",\n'
        '                                f"*iteration@{epoch - 1}-*.flor")\n'
        '            deadline = time.monotonic() + 60\n'
        '            while epoch and not glob.glob(done) and time.monotonic() < deadline:\n'
        '                time.sleep(0.01)\n'
        '            os.kill(os.getpid(), int(os.environ["STOP_WITH"]))\n', 1)
    assert source.count("STOP_AT") == 2
    return source


HANDS_FREE = _stoppable(read(os.path.join(ROOT, "tests", "scripts", "handsfree",
                                          "digits_epochs.py")))


def _record(d, *args, env=None, check=True):
    return flor(d, "record", *args, env=dict({"FLOR_ADAPTIVE": "0"}, **(env or {})),
                check=check, ctrl_c=True)


def _tensors(path):
    import torch

    return torch.load(path)


def _same_model(a, b):
    import torch

    a, b = _tensors(a), _tensors(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _stored(d):
    """What the run stored: its printed lines and logged values."""
    st = store(d)
    run = st.runs()[-1]
    lines = [(r["iter"], r["value"]) for r in st.logs(run["run_id"])
             if r["name"].startswith("stdout@")]
    states = [(r["name"], r["iter"], r["value"]) for r in st.logs(run["run_id"])
              if r["name"] in ("state@iteration", "state@block")]
    return run, lines, states


SIGNALS = {"term": signal.SIGTERM, "int": signal.SIGINT}
STATUS = {"term": 143, "int": 130}  # what a shell's python exits with


@pytest.mark.parametrize("how", [pytest.param("kill", marks=CORE), "term", "int",
                                 pytest.param("kill-fork", marks=CORE)])
def test_a_killed_record_resumes_to_the_uninterrupted_result(tmp_path, torch, how):
    """int: Ctrl-C.  kill-fork: the fork materializer writes each checkpoint
    in a child of its own as it is taken, so a killed record keeps them."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_script(str(d), "train.py", HANDS_FREE)
    _record(str(whole), "train.py", "6")
    stop = {"STOP_AT": "3", "STOP_WITH": str(int(SIGNALS.get(how, signal.SIGKILL)))}
    if how == "kill-fork":
        stop["FLOR_MATERIALIZER"] = "fork"
    proc = _record(str(cut), "train.py", "6", env=stop, check=False)
    assert proc.returncode == STATUS.get(how, -9), proc.stderr
    if how in SIGNALS:  # flushed, and says how to go on
        assert "record --resume train.py 6" in proc.stderr
    if how == "int":  # the traceback python prints, from the script's own frames
        tb = proc.stderr.split("Traceback (most recent call last):\n", 1)[1].splitlines()
        assert tb[0].startswith('  File "') and "train.py" in tb[0], proc.stderr
        assert "KeyboardInterrupt" in proc.stderr and "/flor/" not in proc.stderr
    st = store(str(cut))
    (run,) = st.runs()
    assert st.status(run) == "interrupted"
    assert run["iterations"] == 3  # epoch 3 was cut short
    listing = flor(str(cut), "runs").stdout
    assert "interrupted" in listing
    assert not os.path.exists(cut / "final.pt")

    res = _record(str(cut), "--resume", "train.py", "6")
    assert f"resuming run {run['run_id']} at iteration" in res.stderr
    (after,) = store(str(cut)).runs()
    assert after["status"] == "finished" and after["iterations"] == 6
    # From the checkpoint of the last iteration it finished, not the start.
    assert after["info"].resumed == [3]
    assert _same_model(whole / "final.pt", cut / "final.pt")
    w, c = _stored(str(whole)), _stored(str(cut))
    assert c[1] == w[1]  # every printed line, once, in order
    assert c[2] == w[2]  # and the state fingerprints

    # It replays as one run.
    rep = flor(str(cut), "replay", "train.py", "6")
    assert "deferred checks passed" in rep.stderr, rep.stderr


def test_a_failed_record_resumes_with_force_once_its_script_is_fixed(tmp_path, torch):
    """A bug at epoch 3 (STOP_AT: the script raises there) fails the record;
    run without it, `record --resume --force` goes on from the checkpoint of
    epoch 2 to the uninterrupted result."""
    kill = '            os.kill(os.getpid(), int(os.environ["STOP_WITH"]))\n'
    failing = HANDS_FREE.replace(kill,
                                 '            raise RuntimeError(f"a bug at epoch {epoch}")\n')
    assert failing != HANDS_FREE
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_script(str(d), "train.py", failing)
    _record(str(whole), "train.py", "6")
    proc = _record(str(cut), "train.py", "6", env={"STOP_AT": "3"}, check=False)
    assert proc.returncode == 1 and "RuntimeError: a bug at epoch 3" in proc.stderr
    (run,) = store(str(cut)).runs()
    assert run["status"] == "failed"

    refused = _record(str(cut), "--resume", "train.py", "6", check=False)
    assert refused.returncode == 2
    assert f"run {run['run_id']}, failed (RuntimeError('a bug at epoch 3'))" in refused.stderr
    assert "record --resume --force" in refused.stderr
    res = _record(str(cut), "--resume", "--force", "train.py", "6")
    assert f"resuming run {run['run_id']} at iteration 3" in res.stderr, res.stderr
    (after,) = store(str(cut)).runs()
    assert after["status"] == "finished" and after["iterations"] == 6
    assert after["info"].resumed == [3] and after["info"].error is None
    assert _same_model(whole / "final.pt", cut / "final.pt")
    w, c = _stored(str(whole)), _stored(str(cut))
    assert c[1] == w[1] and c[2] == w[2]


def test_a_record_killed_before_its_main_loop_resumes_from_its_start(tmp_path, torch):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_script(str(d), "train.py", HANDS_FREE)
    _record(str(whole), "train.py", "3")
    _record(str(cut), "train.py", "3", env={"STOP_AT": "start"}, check=False)
    res = _record(str(cut), "--resume", "train.py", "3")
    assert "no iteration checkpoint to resume from" in res.stderr
    (after,) = store(str(cut)).runs()
    assert after["status"] == "finished" and after["iterations"] == 3
    assert _same_model(whole / "final.pt", cut / "final.pt")
    assert _stored(str(cut))[1:] == _stored(str(whole))[1:]


def test_an_interrupted_record_replays_up_to_what_it_committed(tmp_path, torch):
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    _record(d, "train.py", "5", env={"STOP_AT": "2", "STOP_WITH": "9"}, check=False)
    rep = flor(d, "replay", "train.py", "5")
    assert "was interrupted after 2 iterations" in rep.stderr, rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "epoch 0 loss" in rep.stdout and "epoch 1 loss" in rep.stdout
    assert "epoch 2 loss" not in rep.stdout


def test_resume_refuses_what_it_cannot_continue(tmp_path, torch):
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    none = flor(d, "record", "--resume", "train.py", "4", check=False)
    assert none.returncode == 2 and "no interrupted record of train.py" in none.stderr
    assert not os.path.exists(os.path.join(d, ".flor"))  # and no store made

    _record(d, "train.py", "4", env={"STOP_AT": "1", "STOP_WITH": "9"}, check=False)
    (run,) = store(d).runs()
    args = flor(d, "record", "--resume", "train.py", "5", check=False)
    assert args.returncode == 2
    assert f"run {run['run_id']} recorded train.py with arguments ['4'], not ['5']" in \
        args.stderr

    path = os.path.join(d, "train.py")
    with open(path, "a") as f:
        f.write("print('one more line')\n")
    changed = flor(d, "record", "--resume", "train.py", "4", check=False)
    assert changed.returncode == 2
    assert f"train.py changed since run {run['run_id']} recorded it" in changed.stderr
    assert "--force" in changed.stderr
    assert store(d).status(store(d).run(run["run_id"])) == "interrupted"  # nothing lost

    forced = _record(d, "--resume", "--force", "train.py")  # no ARGS: the recorded ones
    assert "(--force)" in forced.stderr
    done = store(d).run(run["run_id"])
    assert done["status"] == "finished" and done["iterations"] == 4


# The manual API's scripts below: a linear model trained by a SkipBlock in an
# epoch loop that carries (net, opt), written at the body's indentation.
_MANUAL_SETUP = """
import glob, os, time
import flor
import torch

torch.manual_seed(0)
torch.set_num_threads(1)
net = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
X, Y = torch.randn(256, 8), torch.randn(256, 2)
"""
_MANUAL_TRAIN = """\
if flor.SkipBlock.step_into("train"):
    for i in range(0, 256, 32):
        opt.zero_grad()
        ((net(X[i:i + 32]) - Y[i:i + 32]) ** 2).mean().backward()
        opt.step()
flor.SkipBlock.end(net, opt)
"""

MANUAL = _MANUAL_SETUP + """\
shadow = torch.nn.Linear(8, 2)  # changed by the loop, but not in state=
for epoch in flor.generator(range(6), state=(net, opt)):
""" + textwrap.indent(_MANUAL_TRAIN, "    ") + """\
    with torch.no_grad():
        shadow.weight.add_(net.weight)
    print(f"epoch {epoch} {net.weight.sum().item():.6f} {shadow.weight.sum().item():.6f}")
"""

def test_a_restore_whose_fingerprint_differs_is_refused(tmp_path, torch):
    """state= leaves out a module the loop changes: an iteration checkpoint
    cannot reproduce the iteration's end, and both replay and resume say so
    instead of going on from it."""
    d = str(tmp_path)
    write_script(d, "train.py", MANUAL)
    _record(d, "train.py", env={"OMP_NUM_THREADS": "1"})
    rep = flor(d, "replay", "--jobs", "2", "train.py")
    assert "does not have the fingerprint the record computed" in rep.stderr, rep.stderr
    assert "running it again from the start" in rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert [l for l in rep.stdout.splitlines() if l.startswith("epoch")] == \
        [l for l in read_output(d) if l.startswith("epoch")]


REFUSED = _MANUAL_SETUP + """\
try:
    for epoch in flor.generator(range(int(os.environ.get("EPOCHS", "6"))), state=(net, opt)):
        if os.environ.get("STOP_AT") == str(epoch):  # once the checkpoint before is written
            done = os.path.join(os.environ["FLOR_DIR"], "runs", "*", "ckpt",
                                f"*iteration@{epoch - 1}-*.flor")
            deadline = time.monotonic() + 60
            while not glob.glob(done) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), 9)
""" + textwrap.indent(_MANUAL_TRAIN, "        ") + """\
        print(f"epoch {epoch} {net.weight.sum().item():.6f}")
except Exception as e:
    print("training failed:", type(e).__name__)
    raise
print("training done")
"""

def test_a_refused_resume_stores_nothing_the_script_prints_after_it(tmp_path, torch):
    """A resume whose main loop cannot reach its checkpoint is refused; what
    the script's own handler prints then is not stored in the interrupted
    run (a later resume kept it, and every replay's checks failed on it)."""
    d = str(tmp_path)
    write_script(d, "train.py", REFUSED)
    _record(d, "train.py", env={"STOP_AT": "3"}, check=False)
    refused = _record(d, "--resume", "train.py", env={"EPOCHS": "2"}, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "cannot resume: the main loop at train.py:11 ended after 2 iterations" in \
        refused.stderr
    _record(d, "--resume", "train.py")
    run = store(d).runs()[-1]
    assert "training failed: FlorError\n" not in [r["text"] for r in
                                                  store(d).rows("output", run["run_id"])]
    rep = flor(d, "replay", "train.py")
    assert "deferred checks passed" in rep.stderr, rep.stderr


def read_output(d):
    st = store(d)
    rec = [r for r in st.runs() if r["kind"] == "record"][-1]
    return [json.loads(r["value"]) for r in st.logs(rec["run_id"])
            if r["name"].startswith("stdout@")]


def test_a_replay_worker_that_dies_has_its_segment_run_again(tmp_path, torch):
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    _record(d, "train.py", "6", env={"OMP_NUM_THREADS": "1"})
    marker = os.path.join(d, "died-once")
    path = os.path.join(d, "train.py")
    src = read(path).replace(
        "        best = max(best, acc)\n",
        "        best = max(best, acc)\n"
        "        print('norm', round(net[0].weight.norm().item(), 4))\n"
        f"        if epoch == 4 and not os.path.exists({marker!r}):\n"
        f"            open({marker!r}, 'w').close()\n"
        "            os.kill(os.getpid(), 9)\n")
    with open(path, "w") as f:
        f.write(src)
    rep = flor(d, "replay", "--jobs", "2", "train.py", "6")
    assert os.path.exists(marker)
    assert "was killed (exit -9); running it again" in rep.stderr, rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr
    serial = flor(d, "replay", "train.py", "6")
    assert rep.stdout == serial.stdout
    assert rep.stdout.count("norm ") == 6


def test_a_replay_stopped_by_ctrl_c_is_left_interrupted(tmp_path, torch):
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    _record(d, "train.py", "6", env={"OMP_NUM_THREADS": "1"})
    path = os.path.join(d, "train.py")
    src = read(path).replace(  # a worker (spawned: the replay's child) presses Ctrl-C
        "        best = max(best, acc)\n",
        "        best = max(best, acc)\n"
        "        print('norm', round(net[0].weight.norm().item(), 4))\n"
        "        if epoch == 4:\n"
        "            parent = os.getppid()\n"
        "            os.kill(parent, signal.SIGINT)\n"
        "            while os.getppid() == parent:  # until the replay stops it, or is gone\n"
        "                time.sleep(0.05)\n")
    src = src.replace("import sys\n", "import signal\nimport sys\n", 1)
    with open(path, "w") as f:
        f.write(src)
    rep = flor(d, "replay", "--jobs", "2", "train.py", "6", env={"FLOR_FORKSERVER": "0"},
               check=False, ctrl_c=True)
    assert rep.returncode == 130, rep.stderr
    assert "flor: interrupted" in rep.stderr
    (replay,) = [r for r in store(d).runs() if r["kind"] == "replay"]
    assert replay["status"] == "interrupted" and replay["finished"]
    assert "interrupted" in flor(d, "runs", "--status", "interrupted").stdout


def test_a_signal_that_comes_while_a_worker_starts_waits_until_it_is_tracked():
    from flor.replay.workers import _held

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as python starts
    tracked = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with _held():
                signal.raise_signal(signal.SIGINT)  # Ctrl-C while the worker starts
                tracked.append("worker")
        assert tracked == ["worker"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_parts_take_their_index_from_the_scheduler_array(tmp_path, torch):
    """A SLURM array of 1-based indices (--array=1-2) runs the two parts;
    merge assembles them into the serial replay's output."""
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    _record(d, "train.py", "4", env={"OMP_NUM_THREADS": "1"})
    edit_norm(d)
    for task in ("1", "2"):
        env = {"SLURM_ARRAY_TASK_ID": task, "SLURM_ARRAY_TASK_MIN": "1",
               "SLURM_ARRAY_TASK_COUNT": "2"}
        part = flor(d, "replay", "--parts", "2", "train.py", "4", env=env)
        assert f"part {int(task) - 1}/2 of replay" in part.stderr, part.stderr
    merged = flor(d, "merge")
    assert "deferred checks passed" in merged.stderr, merged.stderr
    serial = flor(d, "replay", "train.py", "4")
    assert merged.stdout == serial.stdout and merged.stdout.count("norm ") == 4
    unset = flor(d, "replay", "--parts", "2", "train.py", "4", check=False,
                 drop=("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"))
    assert unset.returncode == 2 and "SLURM_ARRAY_TASK_ID" in unset.stderr


def edit_norm(d):
    path = os.path.join(d, "train.py")
    src = read(path).replace(
        "        best = max(best, acc)\n",
        "        best = max(best, acc)\n"
        "        print('norm', round(net[0].weight.norm().item(), 4))\n")
    with open(path, "w") as f:
        f.write(src)


def test_replay_on_a_local_ray_cluster(tmp_path, torch):
    """--backend ray runs the segments as Ray tasks on a cluster the replay
    starts on this machine; the output is the local replay's."""
    pytest.importorskip("ray")
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    _record(d, "train.py", "4", env={"OMP_NUM_THREADS": "1"})
    edit_norm(d)
    ray = flor(d, "replay", "--backend", "ray", "--jobs", "2", "train.py", "4",
               drop=("RAY_ADDRESS",))
    assert "deferred checks passed" in ray.stderr, ray.stderr
    st = store(d)
    replay = [r for r in st.runs() if r["kind"] == "replay"][-1]
    info = replay["info"]
    assert info.mode == "ray" and info.nparts == 2
    local = flor(d, "replay", "train.py", "4")
    assert ray.stdout == local.stdout and ray.stdout.count("norm ") == 4


def test_ray_missing_says_how_to_install_it(tmp_path, torch):
    d = str(tmp_path)
    write_script(d, "train.py", HANDS_FREE)
    blocker = tmp_path / "noray"
    blocker.mkdir()
    (blocker / "ray.py").write_text("raise ImportError('no ray here')\n")
    proc = flor(d, "replay", "--backend", "ray", "train.py", "4", check=False,
                env={"PYTHONPATH": str(blocker)})
    assert proc.returncode == 2 and "pip install 'flor-hindsight[ray]'" in proc.stderr


STEPS_STOPPED = """\
import os, signal

def batches():
    while True:
        yield 1.0

it = batches()
w, step = 0.0, 0
while True:
    if step == 300:
        os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(3):
        w += 0.5 * next(it)
    print("step", step, w)
    step += 1
"""


def test_a_stopped_record_counts_every_iteration_it_stored(tmp_path):
    """A step loop whose iterations take no checkpoint (a generator feeds
    it) flushes its rows at most once a second; stopped, the record stores
    what every iteration printed, and its run row counts every iteration
    that ended (it counted those of the last flush): a replay of it
    finds every line it stored, and its checks pass."""
    d = str(tmp_path)
    write_script(d, "steps.py", STEPS_STOPPED)
    proc = flor(d, "record", "steps.py", check=False)
    assert proc.returncode == 143, proc.stderr
    st = store(d)
    (run,) = st.runs()
    assert st.status(run) == "interrupted"
    printed = [r for r in st.logs(run["run_id"]) if r["name"].startswith("stdout@")]
    assert run["iterations"] == 300 and len(printed) == 300
    assert json.loads(printed[-1]["value"]).startswith("step 299 ")
    rep = flor(d, "replay", "steps.py")
    assert "deferred checks passed" in rep.stderr, rep.stderr


@pytest.mark.unit
def test_the_main_loop_so_far_is_the_top_level_loop_that_has_run_longest():
    """What a killed record's run row names as its main loop: a data
    preparation loop that began first and ended soon is not it once the
    training loop after it has run longer (record --resume restarted the
    training from a checkpoint of the preparation loop's)."""
    from flor.runtime.loops import Loops

    loops = Loops(None)
    loops.began = {("prep", 0): 100.0, ("train", 0): 101.0}
    for i in range(10):  # 100.0 to 100.9
        assert loops.main_so_far((None, "prep", 0, i), now=100.1 + i / 10) == ("prep", 0, i + 1)
    # The training loop has run 0.5 s at its fifth iteration's end: less
    # than the preparation loop's 1.0 s.
    assert loops.main_so_far((None, "train", 0, 4), now=101.5) is None
    assert loops.main_so_far((None, "train", 0, 9), now=102.0) == ("train", 0, 10)
    assert loops.main_so_far((None, "train", 0, 10), now=102.1) == ("train", 0, 11)
    # A later top-level loop is measured against the training loop's 1.1 s.
    loops.began[("eval", 0)] = 103.0
    assert loops.main_so_far((None, "eval", 0, 0), now=103.5) is None
