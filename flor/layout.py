"""The files of the run store under ``.flor/`` (flor/store.py holds its
database): run directories, kept sources, plans, part databases, logged
arrays, and this machine's calibration.  docs/results.md lists every file."""
from __future__ import annotations

import json
import math
import os
import secrets
import socket
import time

__all__ = ["Layout", "store_root", "new_run_id", "checkpoint_path", "process_start",
           "process_alive"]

_UP = "__up__"  # a module source's ".." in a run's modules/ directory


def store_root() -> str:
    return os.path.abspath(os.environ.get("FLOR_DIR") or os.path.join(os.getcwd(), ".flor"))


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def checkpoint_path(ckpt_dir: str, name) -> str:
    """The file `name` (a checkpoint's name, as the store gives it) of the
    run's checkpoint directory: a name that is not one file's there (a
    path, "..") is refused with a StoreError, never followed."""
    from .errors import StoreError

    if not isinstance(name, str) or not name or name in (".", "..") or \
            os.path.basename(name) != name or (os.altsep and os.altsep in name):
        raise StoreError(f"the run store names {name!r} as a checkpoint of {ckpt_dir}, "
                         "which is not a file name there: it is not read")
    return os.path.join(ckpt_dir, name)


class Layout:
    """The files of the store under `root`: run directories, kept sources,
    plans, part databases, the calibration."""

    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root) if root else store_root()

    # -- layout -------------------------------------------------------------

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.root, "runs", run_id)

    def ckpt_dir(self, run_id: str) -> str:
        return os.path.join(self.run_dir(run_id), "ckpt")

    def plan_path(self, run_id: str) -> str:
        return os.path.join(self.run_dir(run_id), "plan.json")

    def part_db(self, run_id: str, part: int, attempt: int | None = None) -> str:
        """A part's own database (attempt n of a local replay's segment:
        its own too, imported into flor.db if it is the one that finished)."""
        name = f"part-{part}" if attempt is None else f"part-{part}.a{attempt}"
        return os.path.join(self.run_dir(run_id), f"{name}.db")

    def worker_log(self, run_id: str, part: int, attempt: int = 0) -> str:
        return os.path.join(self.run_dir(run_id), f"part{part}.a{attempt}.stderr")

    def save_instrumented(self, run_id, text: str, summary: dict):
        """Keep a hands-free record's instrumented script and its summary."""
        run_dir = self.run_dir(run_id)
        with open(os.path.join(run_dir, "instrumented.py"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(run_dir, "handsfree.json"), "w") as f:
            json.dump(summary, f, indent=1)

    def handsfree_summary(self, run_id) -> dict:
        """A hands-free record's summary of its script's instrumentation
        (handsfree.json: its loops and blocks); {} if it has none."""
        try:
            with open(os.path.join(self.run_dir(run_id), "handsfree.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def save_code_diff(self, run_id, text: str) -> str:
        """Keep the diff of a record's repository against its commit; returns
        its name in the run directory."""
        with open(os.path.join(self.run_dir(run_id), "code.diff"), "w") as f:
            f.write(text)
        return "code.diff"

    def save_module_source(self, run_id, relpath, text):
        """Keep the source of another file of the program (one with flor
        calls, or a module of the project); `relpath` is relative to the
        script's directory, and may go up from it (``../lib/data.py``)."""
        parts = [_UP if p == os.pardir else p for p in relpath.split(os.sep)]
        path = os.path.join(self.run_dir(run_id), "modules", *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def module_sources(self, run_id) -> dict:
        """{None: the script's source, relpath: another file's source}."""
        out = {}
        run_dir = self.run_dir(run_id)
        try:
            with open(os.path.join(run_dir, "source.py")) as f:
                out[None] = f.read()
        except FileNotFoundError:
            pass
        base = os.path.join(run_dir, "modules")
        for dirpath, _, files in os.walk(base):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, base).split(os.sep)
                with open(path) as f:
                    out[os.path.join(*[os.pardir if p == _UP else p for p in rel])] = f.read()
        return out

    def save_handsfree_modules(self, run_id, summaries: dict):
        """Keep the hands-free summaries of the project's modules a record
        instrumented ({relpath: summary}, as handsfree.json's)."""
        path = os.path.join(self.run_dir(run_id), "handsfree-modules.json")
        with open(path + ".tmp", "w") as f:
            json.dump(summaries, f, indent=1)
        os.replace(path + ".tmp", path)

    def handsfree_modules(self, run_id) -> dict:
        try:
            with open(os.path.join(self.run_dir(run_id), "handsfree-modules.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def save_printed_names(self, run_id, names: dict):
        """Keep the names of a replay's printed statements that replay --runs
        carried onto a record's version ({relpath: {line: name}}): their
        names in the script the user edited."""
        path = os.path.join(self.run_dir(run_id), "names.json")
        with open(path + ".tmp", "w") as f:
            json.dump(names, f)
        os.replace(path + ".tmp", path)

    def printed_names(self, run_id) -> dict:
        """save_printed_names' {relpath: {line: name}} of a replay (lines as ints)."""
        try:
            with open(os.path.join(self.run_dir(run_id), "names.json")) as f:
                data = json.load(f)
        except (FileNotFoundError, ValueError):
            return {}
        return {rel: {int(line): name for line, name in lines.items()}
                for rel, lines in data.items()}

    def value(self, run_id, value):
        """A logged value (decoded JSON) as flor.log received it: a large
        tensor or array is read back from its file."""
        if isinstance(value, dict) and set(value) == {"$array", "dtype", "shape"}:
            from .checkpoint import load

            return load(os.path.join(self.run_dir(run_id), value["$array"]), map_location="cpu")
        return value

    def part_replays(self) -> list[str]:
        """Replays run in --part pieces (a part's own database is there),
        the one whose plan was written last first."""
        runs_dir = os.path.join(self.root, "runs")
        if not os.path.isdir(runs_dir):
            return []
        plans = sorted(((os.path.getmtime(self.plan_path(d)), d) for d in os.listdir(runs_dir)
                        if os.path.isfile(self.plan_path(d))), reverse=True)
        return [d for _, d in plans if any(
            f.startswith("part-") and f.endswith(".db") and ".a" not in f
            for f in os.listdir(self.run_dir(d)))]

    def calibration(self, **measures) -> dict:
        """This machine's measured speeds (bytes/s), each measured once per
        store and host by its function in `measures` (``write_bytes_per_s=
        f``) and kept in calibration.json."""
        path = os.path.join(self.root, "calibration.json")
        host = socket.gethostname()
        try:
            with open(path) as f:
                cal = json.load(f)
        except (FileNotFoundError, ValueError):
            cal = {}
        cal = cal if isinstance(cal, dict) else {}  # not ours: measured again, and replaced
        mine = cal[host] = cal.get(host) if isinstance(cal.get(host), dict) else {}
        missing = [k for k in measures if not (type(mine.get(k)) in (int, float)
                                               and 0 < mine[k] < math.inf)]
        for key in missing:
            mine[key] = float(measures[key]())
            mine[f"{key}.measured"] = time.time()
        if missing:
            os.makedirs(self.root, exist_ok=True)
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(cal, f)
            os.replace(tmp, path)
        return {k: float(mine[k]) for k in measures}


def process_start(pid) -> int | None:
    """When process `pid` started (clock ticks after boot), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def process_alive(pid, start=None) -> bool:
    """Whether process `pid` (started at `start`, when known) still runs:
    not a zombie, and not another process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] != "Z" and (start is None or int(fields[19]) == start)
