"""Process hygiene: quiet import, multi-phase init, no leaks."""
import gc
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flor
from flor import _core

from conftest import run_py

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core


# Under AddressSanitizer freed memory sits in a quarantine, so RSS grows
# without a leak; the object counts below still apply.
SANITIZED = os.environ.get("FLOR_SANITIZED") == "1"


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def assert_rss_stable(before, limit=16 << 20):
    if not SANITIZED:
        assert rss_bytes() - before < limit


def test_import_is_silent_and_light():
    out = run_py(
        """
        import sys, threading
        import flor
        assert "torch" not in sys.modules, "import flor imported torch"
        assert "numpy" not in sys.modules
        assert threading.active_count() == 1
        """
    )
    assert out.stdout == "" and out.stderr == ""


def test_fresh_reimport_gives_a_fresh_module():
    out = run_py(
        """
        import importlib, sys
        import flor._core as first
        del sys.modules["flor._core"]
        second = importlib.import_module("flor._core")
        assert first is not second
        assert first.Snapshot is not second.Snapshot
        assert first.snapshot([1, {"a": 2}]).restore() == [1, {"a": 2}]
        assert second.snapshot([3]).restore() == [3]
        print("ok")
        """
    )
    assert out.stdout.strip() == "ok"


def test_c_functions_have_signatures():
    import inspect

    assert str(inspect.signature(_core.snapshot)) == "(obj, /)"
    assert str(inspect.signature(_core.load)) == "(path, hook, policy, /)"


def _training_state():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "rows": [[i, str(i)] for i in range(200)],
            "arr": np.arange(100.0), "t": (torch.ones(3), torch.float16)}


def test_snapshot_restore_does_not_leak():
    obj = _training_state()
    weight = obj["model"][0].weight
    refs_before = sys.getrefcount(weight)
    for _ in range(50):
        flor.snapshot(obj).restore()
    gc.collect()
    objects_before, rss_before = len(gc.get_objects()), rss_bytes()
    for _ in range(1000):
        snap = flor.snapshot(obj)
        out = snap.restore()
        del snap, out
    gc.collect()
    assert len(gc.get_objects()) - objects_before < 100
    assert_rss_stable(rss_before)
    assert sys.getrefcount(weight) == refs_before


def test_save_load_and_materializer_do_not_leak(tmp_path):
    obj = _training_state()
    path = tmp_path / "x.flor"
    m = flor.Materializer(tmp_path / "m")
    for _ in range(20):
        flor.save(obj, path)
        flor.load(path)
        m.submit("c", obj)
    m.flush()
    gc.collect()
    objects_before, rss_before = len(gc.get_objects()), rss_bytes()
    for _ in range(300):
        flor.save(obj, path)
        flor.load(path)
        m.submit("c", obj)
    m.close()
    gc.collect()
    assert len(gc.get_objects()) - objects_before < 100
    assert_rss_stable(rss_before)


@pytest.mark.parametrize("n", [1 << 20, 1000])
def test_staging_buffers_are_reused(n):
    """In a process of its own: the pool keeps what the process's largest
    snapshot needs, a whole staging buffer for small ones too."""
    out = run_py(f"""
        import torch, flor
        from flor import _core
        obj = {{"w": torch.ones({n})}}
        flor.snapshot(obj)
        before = _core.pool_stats()
        for _ in range(20):
            flor.snapshot(obj)
        after = _core.pool_stats()
        print(after["takes"] - before["takes"], after["fresh"] - before["fresh"])
    """)
    assert out.stdout.split() == ["20", "0"], "a snapshot mapped fresh memory instead of reusing"


class _Writes(io.RawIOBase):
    """A raw stream that keeps each write: what the kernel sees of stderr."""

    def __init__(self):
        self.calls = []

    def writable(self):
        return True

    def write(self, b):
        self.calls.append(bytes(b).decode())
        return len(b)


def test_a_note_is_one_write_so_processes_sharing_stderr_keep_whole_lines(monkeypatch):
    # torchrun's ranks and replay's workers share one stderr; under
    # PYTHONUNBUFFERED (python -u) a print() of a line is two writes, and
    # another process's line can land between them.
    from flor.errors import note, say

    raw = _Writes()
    monkeypatch.setattr(sys, "__stderr__", io.TextIOWrapper(raw, write_through=True))
    note("replaying run 1: 4 iterations in segments [0, 2), [2, 4)")
    say("--- replay worker 1 ---\nTraceback ...\nValueError: x", sys.__stderr__)
    assert raw.calls == ["flor: replaying run 1: 4 iterations in segments [0, 2), [2, 4)\n",
                         "--- replay worker 1 ---\nTraceback ...\nValueError: x\n"]


def test_a_note_goes_to_file_descriptor_2_when_the_script_set_stderr_to_none():
    code = ("import sys\nsys.stderr = sys.__stderr__ = None\n"
            "from flor.errors import note\nnote('still said')\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "flor: still said\n")
