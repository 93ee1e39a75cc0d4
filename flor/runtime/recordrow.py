"""A record's row in the run store: made as the record starts (or, for
``record --resume``, reopened, after what the interrupted run stored past
its resume point is deleted), and completed at the end with what the run
measured: its main loop (the longest-running top-level loop), iteration
count, status and info (flor/runinfo.py).
"""
from __future__ import annotations

import os
import socket
import sys
import time

from .. import codeversion
from ..errors import SegmentDone, note
from ..runinfo import LABELS, RecordInfo
from ..seal import seal_run
from ..store import new_run_id, process_start
from ..version import __version__
from .blockstate import TAGS

__all__ = ["RecordRow", "versions"]


def versions() -> dict:
    v = {"python": sys.version.split()[0], "flor": __version__}
    for mod in ("torch", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    return v


def _threads_asked() -> int | None:
    """The torch thread count OMP_NUM_THREADS makes, or None: what it asks
    for, at most the machine's CPU count (torch takes no more)."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return min(threads, os.cpu_count() or threads) if threads >= 1 else None


class RecordRow:
    """The row of one record run (`run_id`), its `info`, and the script's
    `source` as the run stored it."""

    def __init__(self, store, script, argv, epsilon, c, adaptive, hands_free, resume, group,
                 fingerprint, keep):
        self.store = store
        self.source = None
        if script is not None:
            with open(script) as f:
                self.source = f.read()
        info = RecordInfo(adaptive=adaptive, hands_free=hands_free is not None,
                          pid=os.getpid(), pid_start=process_start(os.getpid()),
                          host=socket.gethostname(), fingerprint=fingerprint,
                          iteration_checkpoints=keep, tags=TAGS,
                          threads_asked=_threads_asked())
        if resume is None:
            diff = None
            if script is not None:
                info.code, diff = codeversion.capture(script, store.layout.root)
            run_id = group.new_run_id(store, new_run_id, info) if group else None
            self.run_id = store.new_run("record", script, argv, self.source, epsilon=epsilon,
                                        c=c, versions=versions(), info=info, run_id=run_id)
            if diff is not None:
                info.code["diff"] = store.layout.save_code_diff(self.run_id, diff)
                store.update_run(self.run_id, info=info)
            if group is not None:
                group.publish(self.run_id)
        else:
            self.run_id = resume.run_id
            before = store.run(resume.run_id)["info"]
            info.resumed = before.resumed + [resume.start]
            info.tags = before.tags  # (its checkpoints so far keep theirs)
            for key in LABELS:  # what the user calls it
                if getattr(before, key):
                    setattr(info, key, getattr(before, key))
            store.truncate_record(self.run_id, resume.ord, resume.decisions)
            store.update_run(self.run_id, status="running", info=info,
                             iterations=resume.start)
        self.info = info
        if hands_free is not None:
            store.layout.save_instrumented(self.run_id, hands_free.text, hands_free.summary())
        seal_run(store, self.run_id)

    def interrupted(self):
        """The run stays interrupted, as far as it committed."""
        self.store.update_run(self.run_id, status="interrupted")
        note(f"record of run {self.run_id} interrupted; continue it with: python -m flor "
             f"record --resume {' '.join(sys.argv)}")

    def finish(self, session, machine, point, error, failures):
        """Complete the row: `machine` (the SkipMachine) says whether any
        block ran, `point` (record --resume) which run of the main loop
        this process resumed, `error` what ended the run (if not its end),
        `failures` the checkpoint writes that failed."""
        failed = error is not None and not isinstance(error, SegmentDone)
        torch = sys.modules.get("torch")
        top = [row for row in session.loops.stats if row.depth == 0]
        if point is not None and point.start:
            top = [row for row in top if (row.loop, row.run) == (point.loop, point.loop_run)]
        main = max(top, key=lambda r: r.seconds) if top else None
        # A run that never reached a loop or block of flor's (a --help run, a
        # crash or an exit before the main loop) has nothing to replay.
        empty = main is None and not any(st["n"] for st in machine.stats())
        info = self.info
        info.failed_writes = [f[0] for f in failures]
        info.threads = session.loops.threads.get((main.loop, main.run)) if main else None
        if info.threads is None and torch is not None:
            info.threads = torch.get_num_threads()
        # is_initialized() never initialises CUDA itself
        info.cuda = torch is not None and torch.cuda.is_initialized()
        info.deterministic = torch is not None and torch.are_deterministic_algorithms_enabled()
        info.adaptive = machine.adaptive
        info.flor_seconds = session.own_time.seconds
        info.startup_s = session.loops.startup_s()
        if session.loops.config is not None:
            info.config, info.config_parsed = session.loops.config
        info.captured = session.block_labels
        info.main_ended = main is not None and (main.loop, main.run) in session.loops.ended
        info.error = repr(error) if failed else None
        stored = self.store.run(self.run_id)["info"]
        for key in LABELS:  # as `flor tag` left them while it ran
            if getattr(stored, key) or getattr(info, key):
                setattr(info, key, getattr(stored, key))
        self.store.update_run(
            self.run_id, finished=time.time(),
            status="empty" if empty else "failed" if failed else "finished",
            main_loop=main.loop if main else None, main_run=main.run if main else None,
            iterations=main.iterations if main else 0, versions=versions(), info=info)
        seal_run(self.store, self.run_id)
