"""Cheap replay workers: a process that imports the script's installed
modules once, then forks each worker from there.

A worker started from scratch pays the interpreter's start and the script's
imports (torch alone takes seconds) before it runs a line of the script.
`flor replay` starts the server as it begins, so these imports go on while
it plans; the workers forked from it run `flor _worker` as a spawned worker
would, with the modules already in ``sys.modules``.  Nothing of the script
runs in the server.

The server is used only where a forked worker behaves as a spawned one
would, and the replay spawns its workers otherwise:
- it imports, as the script's ``__main__`` would (a warning is shown where
  the script would show it), only the script's leading imports (those
  before its first other statement, which might set sys.path or the
  environment they read), of installed modules (the standard library's and
  site-packages', a virtual environment's included) that the script would
  not find first in its own directory or the working directory; never the
  project's own sources (an editable install's included), whose import may
  do what the script should see;
- what the imports keep of sys.stdout and sys.stderr (a logging handler's
  stream) writes where a worker's session captures them
  (flor/runtime/capture.py, `Relay`);
- an import that fails, prints anything (a warning included), replaces
  sys.stdout or sys.stderr, starts a Python thread or loads CUDA's driver
  makes the server refuse (a native library's thread pool, OpenBLAS's, is
  fork-safe, as DataLoader's forked workers rely on);
- it must have started with the workers' thread count (OpenBLAS sizes its
  threads as numpy is imported; torch's are set in each forked worker).

What a forked worker can still tell: its parent process is the server;
gc.get_freeze_count() is not 0; the modules imported ahead hold the
server's import-time state (logging's start time, say, or an environment
variable read as they were imported: FLOR_REPLAY_WORKER and a worker's own
CUDA_VISIBLE_DEVICES are set in the worker only); what they kept of
sys.stdout is a `Relay`.

No server is started for a script whose leading imports are all of the
standard library (there is little to save), and ``FLOR_FORKSERVER=0``
spawns every worker (the tests' seam for that path).
"""
from __future__ import annotations

import ast
import builtins
import gc
import importlib.machinery
import importlib.util
import json
import os
import select
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile

from ..runtime.capture import relay, relayed, unrelay

__all__ = ["ForkServer", "imports_of", "serve"]

ENV = "FLOR_FORKSERVER"  # "0": spawn every worker
PIPE = "{pipe}"  # in a fork request's argv: the progress pipe's fd in the child
_POLL = 0.02  # seconds between the server's checks for ended workers


def imports_of(script: str) -> list[str]:
    """The modules `script` imports ahead in a fork server (`_imports`)."""
    return [name for name, _ in _imports(script)]


def _imports(script: str) -> list[tuple[str, int]]:
    """(module, line) for the modules `script` imports before its first statement that is not
    an import (its docstring aside), in order, that are installed: found in
    the interpreter's library directories, and not in the script's
    directory or the working directory, where the script would find its
    own module first.  Imports after a statement (sys.path or os.environ
    set, say), or under an if or a try, are left to the script."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return []
    names: dict[str, int] = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.setdefault(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if not node.level and node.module:  # (a relative import is the project's)
                names.setdefault(node.module, node.lineno)
        elif not (i == 0 and isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str)):
            break
    local = [os.path.dirname(os.path.abspath(script)), os.getcwd()]
    installed = _library_dirs()
    out = []
    for name, line in names.items():
        top = name.partition(".")[0]
        if top == "__future__" or importlib.machinery.PathFinder.find_spec(top, local):
            continue  # the project's own module (or one it shadows)
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        where = spec.origin if spec.has_location else None
        if where is None and spec.submodule_search_locations:
            where = next(iter(spec.submodule_search_locations), None)
        if spec.origin not in ("built-in", "frozen") and not (
                where and any(os.path.realpath(where).startswith(d + os.sep)
                              for d in installed)):
            continue  # not installed (the project's sources, an editable install)
        out.append((name, line))
    return out


def _library_dirs() -> list[str]:
    """The interpreter's library directories: the standard library's and
    site-packages (a virtual environment's too, wherever it lies)."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.update(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return sorted({os.path.realpath(d) for d in dirs})


# -- the server ----------------------------------------------------------------

def _send(sock, **msg):
    sock.send(json.dumps(msg).encode())


def _refusal(script, imports) -> str | None:
    """Import what the script imports ahead, as its ``__main__`` would (so
    that a warning is shown, or not, as it would be there); why forking
    workers from here would not do, or None."""
    # What the worker has when its script imports: sys.path[0] the
    # script's directory (an import may put a path before it), and the
    # streams that its session will capture.
    sys.path[0] = os.path.dirname(script)
    relay()
    out = os.fstat(1).st_size, os.fstat(2).st_size
    for name in ["flor.runtime.entry", "flor.replay.plan"]:
        importlib.import_module(name)
    code = ast.Module(body=[ast.Import(names=[ast.alias(name)], lineno=line, col_offset=0,
                                       end_lineno=line, end_col_offset=0)
                            for name, line in imports], type_ignores=[])
    try:
        exec(compile(ast.fix_missing_locations(code), script, "exec"),
             {"__name__": "__main__", "__file__": script, "__builtins__": builtins})
    except BaseException as e:  # noqa: BLE001 -- any failure: spawn instead
        return f"an import failed ({type(e).__name__})"
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if (os.fstat(1).st_size, os.fstat(2).st_size) != out:
        return "an import printed"
    if not relayed():
        return "an import replaced sys.stdout or sys.stderr"
    import threading

    if threading.active_count() > 1:
        return "an import started a thread"
    if _cuda_loaded():
        return "an import initialised CUDA"
    return None


def _cuda_loaded() -> bool:
    """Whether CUDA's driver library is loaded here (torch.cuda.is_available()
    loads it, and torch.cuda.is_initialized() does not tell)."""
    try:
        with open("/proc/self/maps") as f:
            return any(os.path.basename(line.split()[-1]).startswith("libcuda.so")
                       for line in f if "/" in line)
    except OSError:
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_initialized()


def _child(sock, req, fds, server, interrupt) -> list[str]:
    """In a forked worker: take its files and environment; its argv."""
    sock.close()
    _die_with_parent(server)
    if interrupt is not None:  # (None: a handler not set from Python, kept)
        signal.signal(signal.SIGINT, interrupt)
    stdin, stdout, stderr, pipe = fds
    for fd, to in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, to)
        os.close(fd)
    unrelay()
    os.environ.clear()
    os.environ.update(req["env"])
    torch = sys.modules.get("torch")
    if torch is not None and req.get("threads"):
        torch.set_num_threads(req["threads"])
    argv = [str(pipe) if a == PIPE else a for a in req["argv"]]
    sys.orig_argv[:] = [sys.executable, "-m", "flor", *argv]  # as a started worker's
    return argv


def _die_with_parent(server: int):
    """SIGKILL this worker if the server (pid `server`) dies (Linux's
    parent-death signal): a server killed with its replay leaves no worker
    running."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != server:  # it died before the call
        os._exit(128 + signal.SIGKILL)


def serve(script: str, fd: int) -> list[str] | None:
    """The server's loop (``flor _forkserver SCRIPT FD``): None when the
    replay is done with it; in a forked worker, the worker's arguments."""
    sock = socket.socket(fileno=fd)
    why = _refusal(script, _imports(script))
    _send(sock, op="ready", refused=why)
    if why is not None:
        return None
    # Ctrl-C reaches the process group: the replay stops the server, and
    # each worker gets back the handler the imports left.
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.collect()  # what the imports left is freed, not kept by gc.freeze
    children: set[int] = set()
    while True:
        try:
            ready, _, _ = select.select([sock], [], [], _POLL)
            if ready:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
                if not msg:
                    break  # the replay is done
                req = json.loads(msg)
                if req["op"] == "fork":
                    # The server's objects stay out of the workers' collections,
                    # which would otherwise write to (and so copy) every page of them.
                    gc.freeze()
                    server = os.getpid()
                    pid = os.fork()
                    if pid == 0:
                        return _child(sock, req, fds, server, interrupt)
                    for f in fds:
                        os.close(f)
                    children.add(pid)
                    _send(sock, op="pid", pid=pid)
                elif req["op"] == "kill" and req["pid"] in children:
                    os.kill(req["pid"], signal.SIGKILL)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                _send(sock, op="exit", pid=pid, code=os.waitstatus_to_exitcode(status))
        except OSError:  # the replay is gone
            break
    for pid in children:  # none outlives the server
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)
    return None


# -- the replay's side ---------------------------------------------------------

class Forked:
    """A worker forked by the server, as much of subprocess.Popen as the
    replay's queue uses."""

    def __init__(self, server, pid):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.server.pump(block=False)
        return self.returncode

    def wait(self):
        while self.returncode is None:
            self.server.pump(block=True)
        return self.returncode

    def kill(self):
        if self.returncode is None:
            self.server.kill(self.pid)


class ForkServer:
    def __init__(self, proc, sock, omp):
        self.proc, self.sock = proc, sock
        self.omp = omp  # the server's OMP_NUM_THREADS
        self.children: dict[int, Forked] = {}
        self.state = None  # the ready message, once read
        self.gone = False

    @classmethod
    def start(cls, script: str, threads: int | None = None) -> ForkServer | None:
        """Start the server for `script`, if replay may use one; it imports
        while the caller goes on.  `threads`: the workers' torch threads, if
        known now."""
        if os.environ.get(ENV, "1") == "0" or not hasattr(socket, "send_fds") \
                or not hasattr(os, "fork"):
            return None
        if all(name.partition(".")[0] in sys.stdlib_module_names for name in imports_of(script)):
            return None  # nothing dear to import ahead: not worth a process
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        try:
            with open(os.devnull, "rb") as null:
                # Its output goes to a file, as a worker's does (an import that
                # prints is found by the file's size).
                log = tempfile.TemporaryFile()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "flor", "_forkserver", script, str(theirs.fileno())],
                    env=env, stdin=null, stdout=log, stderr=log, pass_fds=(theirs.fileno(),))
                log.close()
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(proc, ours, env.get("OMP_NUM_THREADS"))

    def usable(self, threads: int) -> bool:
        """Wait for the server's imports; whether workers of `threads` torch
        threads may be forked from it (else it is closed)."""
        # A forked worker's torch threads are set as it starts; a library that
        # sized its threads at import (OpenBLAS, numpy's) sized them as a
        # started worker's would only if the server had their count.
        ok = self.omp == str(threads) or (self.omp is None and (os.cpu_count() or 1) == threads)
        while ok and self.state is None and not self.gone:
            self.pump(block=True)
        ok = ok and not self.gone and self.state is not None and self.state["refused"] is None
        if not ok:
            self.close()
        return ok

    def fork(self, argv, env, stdin, stdout, stderr, pipe, threads) -> Forked:
        """A worker running ``flor`` `argv` (PIPE standing for the pipe's fd)
        with `env`, its standard files and `pipe` given as descriptors."""
        msg = json.dumps({"op": "fork", "argv": argv, "env": env, "threads": threads})
        socket.send_fds(self.sock, [msg.encode()], [stdin, stdout, stderr, pipe])
        while True:
            reply = self._read(block=True)
            if reply is None:
                raise OSError("flor's fork server ended")
            if reply["op"] == "pid":
                child = self.children[reply["pid"]] = Forked(self, reply["pid"])
                return child

    def kill(self, pid):
        try:
            _send(self.sock, op="kill", pid=pid)
        except OSError:
            pass

    def _read(self, block):
        """One message from the server, handling exits and readiness;
        None at its end (or, not blocking, when none is waiting)."""
        while True:
            if not block and not select.select([self.sock], [], [], 0)[0]:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self._ended()
                return None
            msg = json.loads(data)
            if msg["op"] == "exit":
                child = self.children.pop(msg["pid"], None)
                if child is not None:
                    child.returncode = msg["code"]
            elif msg["op"] == "ready":
                self.state = msg
                if msg["refused"] is not None:
                    self.close()
            else:
                return msg
            if block and msg["op"] in ("exit", "ready"):
                return msg

    def pump(self, block):
        """Take what the server has said (waiting for one message if `block`)."""
        if self.gone:
            return
        if block:
            self._read(block=True)
        else:
            while not self.gone and self._read(block=False) is not None:
                pass

    def _ended(self, wait=True):
        """The server is gone, and with it the workers it had not reported
        ended: it killed them as it left, or the kernel did as it died
        (each worker's parent-death signal); they count as killed.  Not
        `wait`ing leaves reaping it to a later close()."""
        if self.gone:
            return
        self.gone = True
        self.sock.close()
        if wait:
            self.proc.wait()
        for child in self.children.values():
            child.returncode = -signal.SIGKILL
        self.children.clear()

    def close(self, wait=True):
        """Done: the server kills any worker still running and exits (one
        still importing is killed).  Not `wait`ing lets its exit (an
        interpreter's, with torch loaded) go on beside the replay's
        conclusion; a later close() reaps it."""
        if not self.gone and self.state is None:
            self.proc.kill()
        if not self.gone:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._ended(wait=False)
        if wait:
            self.proc.wait()
