"""What a session stores as the run goes: logged values, printed lines,
output, the adaptive rule's decisions and (replay) how each block ran.

Rows wait in memory and are written to the store at the end of every
main-loop iteration and when the run finishes.  A printed line is stored as
a value of the statement that printed it, ``stdout@file:line``, so that the
deferred checks compare it like a ``flor.log`` value; the raw output is
stored too, in chunks per stream and iteration, for replay to reassemble.
"""
from __future__ import annotations

import json
import os
import sys

__all__ = ["Logbook", "jsonable"]

_FLOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def jsonable(value):
    """Tensors and arrays become numbers (or nested lists of numbers)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.numel() == 1 else value.cpu().tolist()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return value.item() if value.size == 1 else value.tolist()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


class Logbook:
    """The pending rows of one session (see flor/store.py for the tables)."""

    def __init__(self, session):
        self.s = session
        self.logs, self.out, self.decisions, self.blockruns = [], [], [], []
        self.ord = 0
        self._line = None  # a printed line not yet ended: [where, phase, top, indices, text]
        self._user_files: dict[str, bool] = {}

    def value(self, name, value, loc):
        """A flor.log value at the session's current context."""
        s = self.s
        ctx = s.context.encode()
        seq = s.context.next("S", (name, loc), ctx)
        self._add_log(s.phase, s.context.top()[0], ctx, name, json.dumps(s.context.indices()),
                      seq, json.dumps(jsonable(value)), loc)

    def _add_log(self, phase, top, ctx, name, indices, seq, value, loc):
        s = self.s
        self.ord += 1
        self.logs.append((s.run_id, s.part, self.ord, phase, top, ctx, name, indices, seq,
                          value, loc))

    def text(self, stream, text):
        """Output the script wrote to `stream`."""
        s = self.s
        if stream == "stdout":
            self._stdout_lines(text)
        top, it = s.context.top()
        last = self.out[-1] if self.out else None
        if (last is not None and last[3] == stream and last[4] == s.phase
                and last[5] == top and last[6] == it):
            last[7] += text
            return
        self.ord += 1
        self.out.append([s.run_id, s.part, self.ord, stream, s.phase, top, it, text])

    def _user_frame(self):
        """The innermost frame running a file of the user's program."""
        s = self.s
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            mine = self._user_files.get(fn)
            if mine is None:
                path = os.path.abspath(fn)
                mine = self._user_files[fn] = (
                    path == s.script or (path.startswith(s.base + os.sep)
                                         and not path.startswith(_FLOR_DIR)
                                         and "site-packages" not in path))
            if mine:
                return f
            f = f.f_back
        return None

    def _stdout_lines(self, text):
        s = self.s
        frame = self._user_frame()
        where = (s.site(frame), s.context.encode()) if frame is not None else None
        if self._line is not None and self._line[0] != where:
            self.end_line()
        if where is None:
            return
        if self._line is None:
            self._line = [where, s.phase, s.context.top()[0], json.dumps(s.context.indices()), ""]
        self._line[4] += text
        while self._line is not None and "\n" in self._line[4]:
            first, rest = self._line[4].split("\n", 1)
            self._line[4] = first
            self.end_line()
            if rest:
                self._line = [where, s.phase, s.context.top()[0],
                              json.dumps(s.context.indices()), rest]

    def end_line(self):
        """Store the printed line in progress, if any, even if unended."""
        if self._line is None:
            return
        (loc, ctx), phase, top, indices, text = self._line
        self._line = None
        name = f"stdout@{loc}"
        seq = self.s.context.next("S", (name, loc), ctx)
        self._add_log(phase, top, ctx, name, indices, seq, json.dumps(text), loc)

    def flush(self, store):
        self.end_line()
        logs, out, dec, runs = self.logs, self.out, self.decisions, self.blockruns
        self.logs, self.out, self.decisions, self.blockruns = [], [], [], []
        store.add_logs(logs)
        store.add_output([tuple(r) for r in out])
        store.add_decisions(dec)
        store.add_blockruns(runs)
