"""Replay workers forked from a server that imported the script's installed
modules once (flor/replay/forkserver.py): they print what spawned workers
and a plain run print, the project's own modules are not imported ahead,
and where the server cannot be used the workers are spawned."""
import os
import signal
import subprocess
import sys
import time

import pytest

from flor.replay.forkserver import ForkServer, imports_of

from conftest import edit, flor, plain, runs, store, write_script

TRAIN = """
    import logging
    import os
    import sys

    import torch

    import helper

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 3)
    y = x.sum(1, keepdim=True)
    for epoch in range(6):
        for step in range(4):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        print(epoch, helper.fmt(loss.item()), torch.get_num_threads(), len(sys.argv))
        logging.getLogger("torch").warning("torch says %d", epoch)  # torch's own handler
"""


def _project(d):
    write_script(d, "train.py", TRAIN)
    write_script(d, "helper.py", """
        print("helper imported")  # the project's module: imported by the script, not ahead


        def fmt(v):
            return f"{v:.6f}"
    """)


def _forked(d):
    st = store(d)
    return st.run(runs(st, "replay")[-1]["run_id"])["info"].forked


def _servers_of(script):
    """Fork servers (and workers forked from them) still running for `script`."""
    return [p for p, _, a in _processes() if "_forkserver" in a and script in a]


@pytest.mark.unit
def test_the_server_imports_the_script_s_installed_modules_and_not_its_own(tmp_path):
    """Only the leading imports: a statement before an import (sys.path or
    os.environ set) can change what it imports, and an import under an if
    (TYPE_CHECKING) or a try may not run at all."""
    d = str(tmp_path)
    write_script(d, "random.py", "x = 1\n")  # shadows the standard library's
    write_script(d, "mylib.py", "x = 1\n")
    os.mkdir(os.path.join(d, "pkg"))
    write_script(d, "pkg/__init__.py", "")
    script = write_script(d, "train.py", """
        \"\"\"A training script.\"\"\"
        from __future__ import annotations
        import os, json as j
        import random
        import mylib
        from pkg import thing
        from . import sibling
        from collections import abc
        import not_a_module_anywhere
        import csv
        if False:
            import numpy
        try:
            import sqlite3
        except ImportError:
            pass
        import wave
    """)
    assert imports_of(script) == ["os", "json", "collections", "csv"]
    assert imports_of(os.path.join(d, "missing.py")) == []
    sys_path_first = write_script(d, "other.py", """
        import sys
        sys.path.insert(0, "vendor")
        import csv
    """)
    assert imports_of(sys_path_first) == ["sys"]
    assert ForkServer.start(sys_path_first) is None  # nothing dear to import ahead


def test_forked_workers_print_what_spawned_workers_and_a_plain_run_print(tmp_path, torch):
    d = str(tmp_path)
    _project(d)
    one = {"OMP_NUM_THREADS": "1"}
    flor(d, "record", "--no-adaptive", "train.py", env=one)
    edit(os.path.join(d, "train.py"), "opt.step()", "print('loss', helper.fmt(loss.item()))")
    expected = plain(d, "train.py", env=one).stdout
    env = dict(one, FLOR_SEGMENTS="0,3")
    forked = flor(d, "replay", "--jobs", "2", "train.py", env=env)
    assert _forked(d) == 2, forked.stderr
    spawned = flor(d, "replay", "--jobs", "2", "train.py", env=dict(env, FLOR_FORKSERVER="0"))
    assert _forked(d) == 0, spawned.stderr
    assert forked.stdout == spawned.stdout == expected
    # torch's log handler, made as the server imported torch, writes where
    # a started worker's would: to the captured stderr, in order.
    said = [l[l.index("torch says"):] for l in plain(d, "train.py", env=one).stderr.splitlines()
            if "torch says" in l]
    assert said == [f"torch says {e}" for e in range(6)]
    for rep in (forked, spawned):
        assert [l[l.index("torch says"):] for l in rep.stderr.splitlines()
                if "torch says" in l] == said, rep.stderr
        assert "--- replay worker" not in rep.stderr
    assert forked.stdout.count("helper imported") == 1
    assert "checks passed" in forked.stderr and "checks passed" in spawned.stderr
    assert _servers_of(os.path.join(d, "train.py")) == []


def test_a_module_on_the_user_s_path_is_imported_by_each_worker_not_ahead(tmp_path, torch):
    """A module found through PYTHONPATH (not installed) prints as it is
    imported: in the workers, where a plain run prints it."""
    d = str(tmp_path / "project")
    os.mkdir(d)
    site = str(tmp_path / "site")
    os.mkdir(site)
    write_script(site, "noisy.py", 'print("noisy imported")\n')
    _project(d)
    edit(os.path.join(d, "train.py"), "import helper", "import noisy")
    env = {"PYTHONPATH": site, "OMP_NUM_THREADS": "1"}
    flor(d, "record", "--no-adaptive", "train.py", env=env)
    edit(os.path.join(d, "train.py"), "opt.step()", "print('loss', helper.fmt(loss.item()))")
    rep = flor(d, "replay", "--jobs", "2", "train.py", env=dict(env, FLOR_SEGMENTS="0,3"))
    assert _forked(d) == 2, rep.stderr
    assert rep.stdout == plain(d, "train.py", env=env).stdout
    assert rep.stdout.startswith("helper imported\nnoisy imported\nloss")


@pytest.mark.parametrize("module, why", [
    ('print("imported")', "an import printed"),
    ('import sys; print("imported", file=sys.stderr)', "an import printed"),
    ("import threading; threading.Thread(target=threading.Event().wait, daemon=True).start()",
     "an import started a thread"),
    ("raise RuntimeError('no')", "an import failed (RuntimeError)"),
    # shown as the script's __main__ shows it (the default filters hide a
    # DeprecationWarning elsewhere):
    ("import warnings; warnings.warn('old', DeprecationWarning, stacklevel=2)",
     "an import printed"),
    ("import sys, io; sys.stdout = io.TextIOWrapper(sys.stdout.buffer, write_through=True)",
     "an import replaced sys.stdout or sys.stderr"),
    ("x = 1", "None"),
])
def test_the_server_refuses_imports_that_a_forked_worker_would_not_repeat(tmp_path, module, why):
    """What an import printed or started stays in the server, and a failed
    import half-done: the server refuses and the replay spawns its workers."""
    write_script(str(tmp_path), "mod.py", module + "\n")
    script = write_script(str(tmp_path), "train.py", '"""A script."""\nimport os\nimport mod\n')
    with open(tmp_path / "out", "w") as out:
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; "
             "from flor.replay.forkserver import _refusal; r = _refusal(sys.argv[1], "
             "[('os', 2), ('mod', 3)]); open(sys.argv[2], 'w').write(str(r))", script,
             str(tmp_path / "why")], stdout=out, stderr=out, timeout=120)
    assert proc.returncode == 0
    assert (tmp_path / "why").read_text() == why


def test_a_server_of_another_thread_count_than_the_workers_is_not_waited_for(tmp_path, torch):
    """OpenBLAS sizes its threads as numpy is imported: a server started
    with another thread count than the workers' is killed at once, not
    waited for, and the workers are spawned."""
    d = str(tmp_path)
    _project(d)
    server = ForkServer.start(os.path.join(d, "train.py"), threads=1)
    assert server is not None
    assert not server.usable(2)
    assert server.gone and server.proc.poll() is not None
    other = ForkServer.start(os.path.join(d, "train.py"), threads=1)
    assert other.usable(1) and other.state["refused"] is None
    other.close()
    assert other.proc.poll() == 0


def _processes():
    """(pid, parent pid, arguments) of this machine's processes."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        out.append((int(pid), ppid, args))
    return out


def _until(condition, what, seconds=120):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # polling a condition, with a deadline


def test_a_killed_replay_leaves_no_worker_or_server_behind(tmp_path, torch):
    """kill -9 of `flor replay`: the server sees its end, kills the workers
    it forked and exits (spawned workers would run on)."""
    d = str(tmp_path)
    _project(d)
    one = {"OMP_NUM_THREADS": "1"}
    flor(d, "record", "--no-adaptive", "train.py", env=one)
    edit(os.path.join(d, "train.py"), "opt.step()",
         "threading.Event().wait() if os.environ.get('FLOR_REPLAY_WORKER') else None")
    edit(os.path.join(d, "train.py"), "import os", "import threading")
    env = dict(os.environ, FLOR_DIR=os.path.join(d, ".flor"), FLOR_SEGMENTS="0,3", **one)
    proc = subprocess.Popen([sys.executable, "-m", "flor", "replay", "--jobs", "2", "train.py"],
                            cwd=d, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    script = os.path.join(d, "train.py")
    try:
        _until(lambda: len(_servers_of(script)) == 3, "a server and its two workers")
        proc.kill()
        proc.wait()
        _until(lambda: not _servers_of(script), "no server or worker after the replay was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, _, args in _processes():  # whatever this test's replay left, if it failed
            if d in args:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


BACKGROUND = """
    import os
    import torch
    import flor

    torch.set_num_threads(1)
    # A process left running (a server the script starts, say): it gets the
    # script's open descriptors that are inheritable.
    os.system("sleep 1000 >/dev/null 2>&1 </dev/null & echo $! >> background.pids")
    w = torch.zeros(2)
    for epoch in flor.generator(range(4)):
        if flor.SkipBlock.step_into("train"):
            w += 1
        w = flor.SkipBlock.end(w)
        flor.log("w", w.sum().item())
"""


@pytest.mark.parametrize("server", ["1", "0"])
def test_a_process_the_script_leaves_running_does_not_hold_up_its_replay(tmp_path, server):
    d = str(tmp_path)
    write_script(d, "bg.py", BACKGROUND)
    try:
        flor(d, "record", "--no-adaptive", "bg.py")
        edit(os.path.join(d, "bg.py"), "w += 1", 'print("w", w.sum().item())')
        # Each worker's process left running would keep its end of the
        # progress pipe open; the replay returns once its workers have.
        rep = flor(d, "replay", "--jobs", "2", "bg.py",
                   env={"FLOR_SEGMENTS": "2", "FLOR_FORKSERVER": server})
        assert "deferred checks passed" in rep.stderr, rep.stderr
        assert "replay: 4/4 iterations, 2 workers" in rep.stderr
        assert rep.stdout == "".join(f"w {2.0 * (i + 1)}\n" for i in range(4))
    finally:
        with open(os.path.join(d, "background.pids")) as f:
            for pid in f.read().split():
                os.kill(int(pid), signal.SIGKILL)
