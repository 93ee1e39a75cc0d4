"""flor.Materializer: background writes in every mode, across real processes."""
import gc
import os
import threading
import time
import weakref

import pytest
import torch

import flor
from flor import _core

from conftest import run_py

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

MODES = ["inline", "thread", "fork"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.unit
def test_roundtrip_and_isolation(tmp_path, mode):
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    expected = []
    with flor.Materializer(tmp_path, mode=mode, batch_count=3) as m:
        for step in range(7):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            m.submit(f"step-{step}", {"model": model, "opt": opt, "step": step})
            # training goes on in place right after submit
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0)
        m.flush()
        assert m.stats()["written"] == 7 and m.stats()["failed"] == 0
    for step in range(7):
        saved = flor.load(tmp_path / f"step-{step}.flor")
        assert saved["step"] == step
        for k, v in expected[step].items():
            assert torch.equal(saved["model"][k], v), (step, k)
        assert saved["opt"]["param_groups"][0]["momentum"] == 0.9


@pytest.mark.unit
def test_submit_returns_bytes_and_names_files(tmp_path):
    with flor.Materializer(tmp_path) as m:
        assert m.submit("a", {"t": torch.zeros(100)}) == 400
        assert m.path_for("a") == str(tmp_path / "a.flor")
        for bad in ("", "x/y", ".hidden", "..", "a\0b"):
            with pytest.raises(ValueError, match="name"):
                m.submit(bad, 1)
    with pytest.raises(ValueError, match="closed"):
        m.submit("late", 1)


@pytest.mark.unit
def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        flor.Materializer(tmp_path, mode="async")
    with pytest.raises(ValueError, match="max_buffer_bytes"):
        flor.Materializer(tmp_path, max_buffer_bytes=0)
    with pytest.raises(ValueError, match="max_children"):
        flor.Materializer(tmp_path, max_children=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        flor.Materializer(tmp_path / "file")


class Gate:
    """Pickling this object (which the writer does, not the snapshot) blocks
    until the test writes a byte to a pipe: a deterministic stall of the
    writer, in the writer thread or in a forked writer child alike."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce_ex__(self, protocol):
        if protocol < 5:  # the snapshot's copy keeps the pipe
            return (Gate, (self.fd,))
        if self.fd is not None:
            os.read(self.fd, 1)
        return (Gate, (None,))


@pytest.mark.parametrize("mode", ["thread", "fork"])
@pytest.mark.unit
def test_memory_is_bounded_in_bytes(tmp_path, mode):
    """With the writer stalled, staged bytes never pass max_buffer_bytes:
    further submits wait instead of growing the buffer."""
    one = 4 << 20
    limit = 3 * one + 4096
    rfd, wfd = os.pipe()
    m = flor.Materializer(tmp_path, mode=mode, max_buffer_bytes=limit, batch_count=100,
                          batch_bytes=1 << 40)

    def trainer():
        for i in range(10):
            obj = {"w": torch.full((one // 4,), float(i))}
            if i == 0:
                obj["gate"] = Gate(rfd)
            m.submit(f"c{i}", obj)

    t = threading.Thread(target=trainer)
    t.start()
    try:
        while m.stats()["held_bytes"] < 3 * one:
            assert t.is_alive(), "the trainer finished with the writer stalled"
    finally:
        os.write(wfd, b"x")  # open the gate
        t.join(timeout=120)
        os.close(rfd)
        os.close(wfd)
    assert not t.is_alive()
    m.close()
    stats = m.stats()
    assert stats["peak_held_bytes"] <= limit
    assert stats["written"] == 10
    for i in range(10):
        assert flor.load(tmp_path / f"c{i}.flor", trusted=True)["w"][0] == i  # holds a Gate


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_a_finished_write_is_counted_with_its_seconds(tmp_path, mode):
    """stats(): once a write has finished, its file and bytes are counted
    with its seconds, before anything else is asked of the materializer
    (the adaptive rule divides the one by the others)."""
    m = flor.Materializer(tmp_path, mode=mode, batch_count=1)
    try:
        m.submit("small", {"step": 1})
        m.submit("large", {"w": torch.zeros(1 << 20)})
        deadline = time.monotonic() + 120
        while m.stats()["pending"]:  # the writes finish; nothing reaps them
            assert time.monotonic() < deadline, "the writes never finished"
        st = m.stats()
        assert (st["written"], st["failed"]) == (2, 0) and st["write_seconds"] > 0
        assert st["bytes_written"] >= 4 << 20
    finally:
        m.close()


@pytest.mark.unit
def test_single_snapshot_larger_than_the_bound_is_written_alone(tmp_path):
    with flor.Materializer(tmp_path, max_buffer_bytes=1024) as m:
        m.submit("big", torch.zeros(10_000))
        m.submit("big2", torch.ones(10_000))
    assert flor.load(tmp_path / "big2.flor").sum() == 10_000


class FailsToPickle:
    """Copies fine (the walk uses protocol 4) but cannot be pickled (5)."""

    def __reduce_ex__(self, protocol):
        if protocol >= 5:
            raise RuntimeError("refusing to be pickled")
        return (FailsToPickle, ())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.unit
def test_background_failure_is_raised_by_flush(tmp_path, mode):
    m = flor.Materializer(tmp_path, mode=mode)
    m.submit("good", {"a": 1})
    m.submit("bad", {"x": FailsToPickle()})
    with pytest.raises(flor.CheckpointWriteError) as info:
        m.flush()
    m.close()
    assert len(info.value.failures) == 1
    path, err, step, message = info.value.failures[0]
    assert path.endswith("bad.flor") and err == -1 and step == "pickle"
    assert "refusing to be pickled" in message
    assert sorted(os.listdir(tmp_path)) == ["good.flor"]


@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_small_frequent_checkpoints_hold_memory_within_the_bound(tmp_path, mode):
    # Every snapshot holds a staging arena until its file is written.  The
    # bound counts the arenas, not the few bytes staged in each: 3000
    # submits of a 64-byte tensor behind a slower writer mapped an arena of
    # 2 MiB apiece (peak RSS +4 GiB in fork mode, against a 4 MiB bound).
    out = run_py(f"""
        import os, resource, torch, flor
        m = flor.Materializer({str(tmp_path)!r}, mode={mode!r}, max_buffer_bytes=4 << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for i in range(3000):
            m.submit(f"c{{i}}", {{"t": torch.randn(16)}})
        m.flush()
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) << 10
        stats = m.stats()
        m.close()
        assert len(os.listdir({str(tmp_path)!r})) == 3000
        print(grew, stats["peak_held_bytes"])
    """, timeout=300)
    grew, peak = map(int, out.stdout.split())
    assert 0 < peak <= 4 << 20, peak
    if os.environ.get("FLOR_SANITIZED") != "1":  # RSS means little under ASan
        assert grew < 32 << 20, grew


@pytest.mark.unit
def test_failures_alike_are_said_once_and_counted():
    # A step loop whose state pickle refuses fails every checkpoint alike.
    why = "TypeError(\"cannot pickle 'weakref.ReferenceType' object\")"
    failures = [(f"/r/ckpt/it@{i}.flor", -1, "pickle", why) for i in range(225)]
    e = flor.CheckpointWriteError(failures + [("/r/ckpt/b.flor", 28, "write", "")])
    assert len(e.failures) == 226
    lines = str(e).splitlines()
    assert lines[0] == "flor could not write 226 checkpoints:"
    assert lines[1] == f"  /r/ckpt/it@0.flor: {why} (during pickle) (and 224 more with the same error)"
    assert lines[2].startswith("  /r/ckpt/b.flor: [Errno 28]") and len(lines) == 3


FORK_SCRIPT = r"""
import os, signal, subprocess, sys
import torch, flor
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, {tests!r})
from conftest import zombies_of

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=2)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
m = flor.Materializer({directory!r}, mode="fork", batch_count=1, max_children=2)
statuses, seen, expected = [], 0, []
for epoch in range(4):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        seen += len(y)
    expected.append(model.weight.detach().clone())
    # (the DataLoader installs its own SIGCHLD handler; flor changes none)
    sigchld = signal.getsignal(signal.SIGCHLD)
    m.submit(f"epoch-{{epoch}}", {{"model": model, "opt": opt}})
    assert signal.getsignal(signal.SIGCHLD) is sigchld
    statuses.append(subprocess.run(["sh", "-c", f"exit {{epoch + 3}}"]).returncode)
    child = os.fork()
    if child == 0:
        os._exit(7)
    statuses.append(os.waitpid(child, 0)[1] >> 8)
sigchld = signal.getsignal(signal.SIGCHLD)
m.close()
assert signal.getsignal(signal.SIGCHLD) is sigchld
assert seen == 4 * 256, seen
assert statuses == [3, 7, 4, 7, 5, 7, 6, 7], statuses
assert m.stats()["forks"] == 4, m.stats()
assert zombies_of(os.getpid()) == [], zombies_of(os.getpid())
for epoch in range(4):
    w = flor.load(os.path.join({directory!r}, f"epoch-{{epoch}}.flor"))["model"]["weight"]
    assert torch.equal(w, expected[epoch]), epoch
print("ok")
"""


def test_fork_mode_alongside_dataloader_workers_and_subprocesses(tmp_path):
    tests = os.path.dirname(__file__)
    out = run_py(FORK_SCRIPT.format(tests=tests, directory=str(tmp_path)))
    assert out.stdout.strip() == "ok"
    assert out.stderr == ""


@pytest.mark.parametrize("disposition", ["ignore", "reaping-handler"])
def test_fork_mode_survives_the_users_sigchld_choices(tmp_path, disposition):
    """SIG_IGN auto-reaps, and a handler may waitpid(-1) our children away:
    results still arrive (through the pipe), and nothing is reported lost."""
    code = f"""
        import os, signal, torch, flor
        if {disposition!r} == "ignore":
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        else:
            def reap(signum, frame):
                try:
                    while os.waitpid(-1, os.WNOHANG)[0]:
                        pass
                except ChildProcessError:
                    pass
            signal.signal(signal.SIGCHLD, reap)
        with flor.Materializer({str(tmp_path)!r}, mode="fork", batch_count=1) as m:
            for i in range(5):
                m.submit(f"c{{i}}", {{"w": torch.full((1000,), float(i))}})
        print(sorted(os.listdir({str(tmp_path)!r})))
    """
    out = run_py(code)
    assert out.stdout.strip() == str([f"c{i}.flor" for i in range(5)])


@pytest.mark.parametrize("mode", ["thread", "fork"])
@pytest.mark.parametrize("ending", ["normal", "exception"])
def test_exit_hook_flushes(tmp_path, mode, ending):
    code = f"""
        import torch, flor
        m = flor.Materializer({str(tmp_path)!r}, mode={mode!r})
        for i in range(3):
            m.submit(f"c{{i}}", {{"w": torch.full((100_000,), float(i))}})
        if {ending!r} == "exception":
            raise SystemExit("training crashed")
    """
    proc = run_py(code, check=False)
    assert proc.returncode == (0 if ending == "normal" else 1), proc.stderr
    for i in range(3):
        assert flor.load(tmp_path / f"c{i}.flor")["w"][0] == i


def test_forked_copy_is_inert(tmp_path):
    """A child forked by the user neither uses nor writes the parent's buffer."""
    code = f"""
        import os, sys, flor
        m = flor.Materializer({str(tmp_path)!r}, mode="fork", batch_count=100)
        m.submit("parent", {{"a": 1}})
        pid = os.fork()
        if pid == 0:
            try:
                m.submit("child", {{"b": 2}})
            except RuntimeError as e:
                assert "belongs to process" in str(e)
                sys.exit(0)  # runs the exit hook in the child
            sys.exit(1)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        assert os.listdir({str(tmp_path)!r}) == [], "the child wrote the parent's batch"
        m.close()
        print(os.listdir({str(tmp_path)!r}))
    """
    assert run_py(code).stdout.strip() == "['parent.flor']"


@pytest.mark.unit
def test_context_manager_keeps_the_training_error(tmp_path):
    with pytest.raises(KeyError):
        with flor.Materializer(tmp_path) as m:
            m.submit("bad", {"x": FailsToPickle()})
            raise KeyError("training failed")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.unit
def test_concurrent_submitters(tmp_path, mode):
    """Several training threads may share one materializer."""
    m = flor.Materializer(tmp_path, mode=mode, batch_count=2, max_buffer_bytes=1 << 20)

    def work(k):
        for i in range(15):
            m.submit(f"t{k}-{i}", {"w": torch.full((20_000,), float(k * 100 + i))})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    m.close()
    assert m.stats()["written"] == 45
    for k in range(3):
        for i in range(15):
            assert flor.load(tmp_path / f"t{k}-{i}.flor")["w"][0] == k * 100 + i


@pytest.mark.parametrize("mode", ["thread", "fork"])
@pytest.mark.unit
def test_a_finished_write_is_no_longer_counted_as_writing(tmp_path, mode):
    """stats()['writing'] drops to 0 once the writer is done, without another
    submit or a flush (the adaptive rule asks it at every block's start and
    end); a fork batch not yet started is pending but not writing."""
    m = flor.Materializer(str(tmp_path), mode=mode, batch_count=1)
    m.submit("a", {"w": torch.zeros(1000)})
    deadline = time.monotonic() + 60
    while m.stats()["writing"]:
        assert time.monotonic() < deadline, m.stats()
    assert os.path.exists(tmp_path / "a.flor")
    assert m.stats()["pending"] == 0
    m.close()
    if mode == "fork":
        with flor.Materializer(str(tmp_path), mode="fork", batch_count=2) as b:
            b.submit("b", {"w": torch.zeros(10)})  # waits for a second one to fork
            assert b.stats()["pending"] == 1 and b.stats()["writing"] == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.unit
def test_the_writers_cpu_time_is_counted(tmp_path, mode):
    """stats()['writer_cpu_seconds']: the CPU time the background writers
    used (the adaptive rule bounds a checkpoint's slowdown by it): the
    writer thread's as it runs and after it stops, a fork child's once it
    is reaped; inline mode has no writer (training writes in submit)."""
    m = flor.Materializer(str(tmp_path), mode=mode, batch_count=1)
    assert m.stats()["writer_cpu_seconds"] == 0.0
    for i in range(3):
        m.submit(f"c{i}", {"w": torch.randn(1 << 21)})  # 8 MiB each
    m.flush()
    flushed = m.stats()["writer_cpu_seconds"]
    # The caller's own CPU is not the writers': spin while they are idle.
    spin = time.thread_time() + 0.3
    while time.thread_time() < spin:
        pass
    idle = m.stats()["writer_cpu_seconds"]
    m.close()
    closed = m.stats()["writer_cpu_seconds"]
    if mode == "inline":
        assert flushed == idle == closed == 0.0
    else:
        assert 0.0 < flushed <= idle <= closed, (flushed, idle, closed)
        assert idle - flushed < 0.05, (flushed, idle)


@pytest.mark.unit
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_a_signer_that_holds_its_materializer_is_collected(mode):
    """The materializer takes part in garbage collection: a signer that
    refers back to it is a cycle the collector frees (it leaked before)."""
    class Signer:
        def __call__(self, tag, meta, table):
            return b"\0" * 32

    signer = Signer()
    signer.materializer = _core.Materializer(mode, 1 << 20, 1, 1 << 20, 1, False, signer)
    gone = weakref.ref(signer)
    del signer
    gc.collect()
    assert gone() is None


@pytest.mark.unit
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_a_signer_that_fails_fails_its_checkpoint_and_says_why(tmp_path, mode):
    """The signer runs once the tensor table is known (in the writer thread
    or a forked child): its error is the checkpoint's failure, reported by
    flush with the step and the error, and no file is left."""
    def signer(tag, meta, table):
        assert len(table) > 0 and isinstance(table, bytes)
        raise RuntimeError("no key today")

    m = _core.Materializer(mode, 1 << 20, 1, 1 << 20, 1, False, signer)
    path = str(tmp_path / "a.flor")
    m.submit(path, {"w": torch.ones(3)})
    failures = m.flush()
    m.close()
    assert [(os.fsdecode(p), step) for p, _, step, _ in failures] == [(path, "sign")], failures
    assert "no key today" in failures[0][3], failures
    assert os.listdir(tmp_path) == []
