"""What every benchmark here shares: the machine it ran on, medians, timed
commands, a hindsight line added to a script, and the report written as
JSON and markdown side by side.

A benchmark imports these from here (``from harness import ...``, with this
directory on sys.path), never another benchmark's private helpers.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name() -> str:
    """The processor's model name, from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def machine_line() -> str:
    """The machine line a report quotes: CPU, cores, kernel, Python."""
    return (f"{cpu_name()}, {os.cpu_count()} cores, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def machine(torch=None) -> dict:
    """The machine as a report's JSON keeps it (with torch's threads and
    GPU, given the module)."""
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    out = {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
           "kernel": platform.release(), "python": platform.python_version()}
    if torch is not None:
        out.update(torch=torch.__version__, threads=torch.get_num_threads(),
                   cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return out


def load_average() -> list:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg words."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def report_header(script, rounds) -> dict:
    """A report's opening fields: the command that ran it (`script`, a
    file of benchmarks/, with this process's arguments), the machine, its
    load before, and the rounds.  The benchmark adds `load_after`."""
    return {"command": (f"python benchmarks/{script} " + " ".join(sys.argv[1:])).strip(),
            "machine": machine(), "machine_line": machine_line(),
            "load_before": load_average(), "rounds": rounds}


def header_line(report) -> str:
    """The markdown report's opening: the machine, the load before and after,
    the command and its rounds (the benchmark goes on with what it took)."""
    return (f"Machine: {report['machine_line']}; one torch thread per process; load average "
            f"{' '.join(report['load_before'])} before, {' '.join(report['load_after'])} "
            f"after.  Command: `{report['command']}`; {report['rounds']} interleaved round(s)")


def median(xs):
    """The median, NaNs left out (NaN when nothing is left)."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def timed(argv, cwd=None, env=None, check=True):
    """Run a command; (wall seconds, the CompletedProcess).  A failure
    stops the benchmark with the command's stderr when `check`."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if check and proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return dt, proc


def script_env(store):
    """The environment a workload script runs in: flor's variables of this
    shell left out, the store at `store`, one torch thread, Python's own
    defaults for buffering and bytecode."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLOR_") and k not in ("PYTHONUNBUFFERED",
                                                       "PYTHONDONTWRITEBYTECODE")}
    env.update(FLOR_DIR=store, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def add_line(source, anchor, line):
    """`source` with `line` added after each line containing `anchor`, at
    that line's indentation (a hindsight statement)."""
    out = []
    for text in source.splitlines(keepends=True):
        out.append(text)
        if anchor in text:
            out.append(text[: len(text) - len(text.lstrip())] + line + "\n")
    return "".join(out)


def write_report(report, out, render):
    """Write OUT.json and OUT.md (render(report)), and print the markdown."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    md = render(report)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)


def open_store(root):
    """The flor run store at `root` (this checkout's flor)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from flor.store import Store

    return Store(root)
