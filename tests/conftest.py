import json
import os
import signal
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


@pytest.fixture(scope="session", autouse=True)
def _store_outside_the_checkout(tmp_path_factory):
    """Runs that a test records without naming FLOR_DIR (snippets, code run
    in this process) go to a temporary store, never to the checkout."""
    old = os.environ.get("FLOR_DIR")
    os.environ["FLOR_DIR"] = str(tmp_path_factory.mktemp("default-store") / ".flor")
    yield
    if old is None:
        os.environ.pop("FLOR_DIR", None)
    else:
        os.environ["FLOR_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def _every_worker_asked_for():
    """A replay starts every worker --jobs asks for (FLOR_ALL_JOBS, the
    seam that fixes the planner's choice of how many pay: the tests'
    scripts are too short for a second worker to pay)."""
    old = os.environ.get("FLOR_ALL_JOBS")
    os.environ["FLOR_ALL_JOBS"] = "1"
    yield
    if old is None:
        os.environ.pop("FLOR_ALL_JOBS", None)
    else:
        os.environ["FLOR_ALL_JOBS"] = old


@pytest.fixture(scope="session", autouse=True)
def _signing_key_outside_home(tmp_path_factory):
    """flor's per-user signing key (~/.config/flor/key) is made in a
    temporary config directory, shared by every process a test starts."""
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))
    yield
    if old is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = old


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


# --- record and replay across processes ----------------------------------

def _ctrl_c():
    """In the child, before it runs python: Ctrl-C as a shell leaves it
    (pytest-xdist's workers ignore SIGINT, and a child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def flor(cwd, *argv, env=None, check=True, drop=(), ctrl_c=False):
    """Run `python -m flor ARGV` in `cwd` with its own store; `drop` names
    variables of this environment to leave out; `ctrl_c`: SIGINT works in
    it as in a shell's python (a test that sends it)."""
    full_env = dict(os.environ, FLOR_DIR=os.path.join(cwd, ".flor"))
    for name in ("FLOR_MODE", *drop):
        full_env.pop(name, None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "flor", *argv], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=_ctrl_c if ctrl_c else None)
    if check and proc.returncode != 0:
        pytest.fail(f"flor {' '.join(argv)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def read(path):
    with open(path) as f:
        return f.read()


def store(cwd):
    from flor.store import Store

    return Store(os.path.join(cwd, ".flor"))


def edit(path, anchor, line, after=True):
    """Add `line` next to the line containing `anchor`, at its indentation."""
    src = read(path).splitlines(keepends=True)
    i = next(i for i, l in enumerate(src) if anchor in l)
    indent = src[i][: len(src[i]) - len(src[i].lstrip())]
    src.insert(i + 1 if after else i, indent + line + "\n")
    with open(path, "w") as f:
        f.write("".join(src))


def values(st, run_id, name):
    """(iter, seq, value) of what run `run_id` logged or printed as `name`
    (an added print also by its old name, ``stdout@file:new:line``)."""
    return [(r["iter"], r["seq"], json.loads(r["value"])) for r in st.logged(run_id, [name])]


def runs(st, kind):
    return [r for r in st.runs() if r["kind"] == kind]


def block_stats(st, run_id, key):
    rows = [r for r in st.rows("blocks", run_id) if r["block"] == key]
    return {k: sum(r[k] for r in rows) for k in ("n", "skips", "steps", "restores")}


def write_script(directory, name, text):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text).lstrip())
    return path


def plain(cwd, script, *args, env=None):
    """The script run without flor recording: what a plain run prints."""
    full_env = dict(os.environ, FLOR_MODE="off", FLOR_DIR=os.path.join(cwd, ".flor-off"))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, script, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc
