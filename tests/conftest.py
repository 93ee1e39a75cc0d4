import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code, *, timeout=180, env=None, cwd=None, check=True):
    """Run a Python snippet in a fresh interpreter; return CompletedProcess.

    With check, a non-zero exit fails the test and shows the child's stderr."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"child exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def zombies_of(pid):
    """Pids of zombie children of pid, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name is in parentheses and may contain spaces
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state == "Z":
            found.append(int(entry))
    return found


@pytest.fixture
def torch():
    return pytest.importorskip("torch")
