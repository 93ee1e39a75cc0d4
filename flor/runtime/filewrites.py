"""What a record's blocks write to the script's files: journaled, so that a
replay that restores a block execution from its checkpoint writes it again
(`rewrite`), and a script that reads the file back prints what a plain
run prints.

Journaled, made by the session's thread while a block runs, for each
`GuardedFile` (a file the user's code opened for writing, files.py; each
has a `handle`, its number in the session): its opening inside the block
(mode and encoding arguments: replay opens it again, truncating it where
the block did), what is written to it (consecutive writes to one file in
one context make one row), and its flushes and closes.  Writes outside
blocks are not journaled: replay runs that code.  The rows of a block
execution are kept only if it, or a block around it, is checkpointed.

A block execution whose writes cannot be written again faithfully is not
checkpointed (`refusal`), and replay runs it again: it moved within a file
(``seek`` other than to its end, ``truncate``), reached past the file
object (``fileno``, ``buffer``), let another thread write to one (which
the journal does not follow), opened one for updating (``r+``), renamed
or removed a file (``os.replace``, ``os.remove``...), left open a file it
opened (a later iteration writes to it), or wrote more than `LIMIT` bytes
(a model saved into an open file: cheaper to run again than to keep twice).
A replay that cannot do them again in its own files (`unrewritable`: a
run directory named by the time) runs the block instead of skipping it.
"""
from __future__ import annotations

import json
import os
import threading
import weakref

from ..context import BlockFrame, PLAIN
from ..schema import WRITES

__all__ = ["WriteJournal", "rewrite", "unrewritable", "LIMIT", "OPEN_ARGS"]

LIMIT = 4 << 20  # bytes journaled for one block execution
# open()'s arguments after the mode that change what reaches the file
OPEN_ARGS = ("buffering", "encoding", "errors", "newline")


class _Execution:
    """What one block execution wrote: bytes, its rows (lists, turned into
    WRITES rows when kept), weak references to the files it opened, and
    why its writes cannot be written again (None while they can)."""

    __slots__ = ("nbytes", "rows", "opened", "why")

    def __init__(self):
        self.nbytes, self.rows, self.opened, self.why = 0, [], [], None


class _Gathered:
    """Consecutive writes to one file (`ref`: a weak reference; the file
    object is closed when the script drops it, as without flor) in one
    context (`where`) of the session's thread: one row, made at the
    journal's next event (`WriteJournal._settle`)."""

    __slots__ = ("ref", "where", "type", "parts", "nbytes", "blocks", "name", "handle")

    def __init__(self, gfile, where, data, blocks, name):
        self.ref, self.where, self.type = weakref.ref(gfile), where, type(data)
        self.parts, self.nbytes = [data], len(data)
        self.blocks, self.name, self.handle = blocks, name, gfile.handle


class WriteJournal:
    """The record side (see the module's docstring).  GuardedFile.write adds
    a write to `gathered` where it continues it (`gathers`), and calls
    `wrote` otherwise; every other event settles the gathered writes first,
    so the rows keep the order of the writes."""

    def __init__(self, session):
        self.s = session
        self.thread = threading.get_ident()
        self._cwd = os.getcwd()
        self._handles = 0
        self.gathered = None  # a _Gathered, or None
        self.unjournaled = None  # the context (a Where) in which no block is open

    def gathers(self, gfile, data) -> bool:
        """Whether `data`, written to `gfile`, goes to the gathered writes
        (GuardedFile.write appends it) or needs nothing (no block is open)."""
        where = self.s.where
        if where is self.unjournaled:
            return True
        g = self.gathered
        return g is not None and g.where is where and g.type is type(data) and \
            g.nbytes < LIMIT and g.ref() is gfile and threading.get_ident() == self.thread

    def _open_blocks(self, thread=True):
        """The block executions open now, in the session's thread (any, unless
        `thread`), when the session keeps what it runs (not record
        --resume's set-up)."""
        s = self.s
        if (thread and threading.get_ident() != self.thread) or s.discard or \
                s.pid != os.getpid():
            return ()
        frames = [f for f in s.context.frames if f is not PLAIN and isinstance(f, BlockFrame)]
        for f in frames:
            if f.writes is None:
                f.writes = _Execution()
        return frames

    def _name(self, gfile):
        """The file's path, relative to the session's first working directory
        where it is inside it (replay resolves it against its own)."""
        rel = os.path.relpath(gfile.key, self._cwd)
        return gfile.key if rel.startswith("..") else rel

    def _row(self, blocks, name, handle, mode, args=None, data=None, where=None):
        """A row in the innermost block execution's journal (a list until it
        is kept: `ended`)."""
        _, ctx, top, it, _ = where or self.s.where
        blocks[-1].writes.rows.append([self.s.logbook.next_ord(), top, it, ctx, name, handle,
                                       mode, args, data])

    def _settle(self):
        """The gathered writes become a row."""
        g, self.gathered = self.gathered, None
        if g is None:
            return
        data = "".join(g.parts) if g.type is str else b"".join(g.parts)
        for b in g.blocks:
            b.writes.nbytes += len(data)
            if b.writes.nbytes > LIMIT:
                self._refuse((b,), f"it writes more than {LIMIT >> 20} MiB to its files")
        if any(b.writes.why is None for b in g.blocks):  # (a block inside may be restored)
            self._row(g.blocks, g.name, g.handle, "write", data=data, where=g.where)

    @staticmethod
    def _refuse(blocks, why):
        for b in blocks:
            if b.writes.why is None:
                b.writes.why = why

    # -- what the script does -----------------------------------------------------

    def opened(self, gfile, mode, args, kwargs):
        """The user's code opened `gfile` for writing: open(file, mode, *args,
        **kwargs)."""
        self._settle()
        self._handles += 1
        gfile.handle = self._handles
        blocks = self._open_blocks()
        if not blocks:
            return
        ref = weakref.ref(gfile)
        for b in blocks:
            b.writes.opened.append(ref)
        if gfile.key is None or "r" in mode:
            self._refuse(blocks, f"it opens {gfile.name!r} with mode {mode!r}")
            return
        given = dict(zip(OPEN_ARGS, args))
        given.update((k, v) for k, v in kwargs.items() if k in OPEN_ARGS)
        given.pop("buffering", None)
        given = {k: v for k, v in given.items() if v is not None}
        try:
            encoded = json.dumps(given) if given else None
        except TypeError:
            self._refuse(blocks, f"it opens {gfile.name!r} with arguments {given!r}")
            return
        self._row(blocks, self._name(gfile), gfile.handle, mode.replace("x", "w"), encoded)

    def wrote(self, gfile, data):
        """`data` went to `gfile` (after the write succeeded), and does not
        continue the gathered writes (`gathers`): gather from it."""
        self._settle()
        if threading.get_ident() != self.thread:  # (a thread of the script's: not journaled)
            self._refuse(self._open_blocks(thread=False), f"another thread writes to "
                         f"{gfile.name!r}")
            return
        if not any(f is not PLAIN and isinstance(f, BlockFrame) for f in self.s.context.frames):
            self.unjournaled = self.s.where  # (until the context changes)
            return
        blocks = self._open_blocks()
        if not blocks:
            return
        if gfile.key is None:
            self._refuse(blocks, f"it writes to the file descriptor {gfile.name!r}")
            return
        data = str(data) if isinstance(data, str) else bytes(data)
        self.gathered = _Gathered(gfile, self.s.where, data, blocks, self._name(gfile))

    def done(self, gfile, how):
        """The user's code called `how` ("flush" or "close") on `gfile`:
        replay does it again after the writes before it."""
        self._settle()
        blocks = self._open_blocks()
        if blocks and gfile.key is not None and any(b.writes.why is None for b in blocks):
            self._row(blocks, self._name(gfile), gfile.handle, how)

    def moved(self, what, how):
        """The user's code called `how` (seek, truncate, fileno, os.replace
        ...) on `what` (a file's name)."""
        self._settle()
        blocks = self._open_blocks()
        if blocks:
            self._refuse(blocks, f"it calls {how}() on {what!r}")

    # -- the end of a block execution -----------------------------------------

    def refusal(self, b) -> str | None:
        """Why replay cannot write again what block execution `b` (ending
        now) wrote, or None."""
        self._settle()
        ex = b.writes
        if ex is None:
            return None
        if ex.why is None:
            for ref in ex.opened:
                f = ref()
                if f is not None and not f.closed:
                    ex.why = f"it leaves {f.name!r} open"
                    break
        return None if ex.why is None else f"{ex.why}, and replay could not write it again"

    def ended(self, b, kept: bool):
        """Block execution `b` ended (`kept`: checkpointed): its rows are
        stored, or left to the block around it, or dropped."""
        self._settle()
        ex = b.writes
        if ex is None or not ex.rows:
            return
        if kept:
            s = self.s
            s.logbook.writes.extend(WRITES.Row(
                run_id=s.run_id, ord=r[0], top=r[1], iter=r[2], ctx=r[3], file=r[4], handle=r[5],
                mode=r[6], args=r[7], data=r[8]) for r in ex.rows)
        else:
            outer = [f for f in self.s.context.frames
                     if f is not PLAIN and isinstance(f, BlockFrame)]
            if outer:
                if outer[-1].writes is None:
                    outer[-1].writes = _Execution()
                outer[-1].writes.rows.extend(ex.rows)
        ex.rows = []


# -- replay -------------------------------------------------------------------

_NOT_OPENS = ("write", "flush", "close")  # the rows' modes that do not open a file


def _path(files, name) -> str:
    """A row's file, resolved against the session's first working directory
    (the script may have moved since)."""
    return os.path.abspath(os.path.join(files.cwd, name))


def unrewritable(files, rows) -> str | None:
    """Why what a block execution wrote in the record (its `writes` rows)
    cannot be written again in this process (`files`, files.py's Files),
    asked before the block would be skipped (None: it can).  A file it
    wrote without opening it must be open here at the same path, and a
    file it opened must be in the working directory or in one where this
    process opened a file for writing: a script that names its run's
    directory by the time or the process writes elsewhere in a replay than
    in its record."""
    opened = set()  # the handles the block opened
    for r in rows:
        file = _path(files, r["file"])
        if r["mode"] not in _NOT_OPENS:
            opened.add(r["handle"])
            where = os.path.dirname(file)
            if where != os.path.abspath(files.cwd) and where not in files.dirs:
                return (f"it opened {r['file']!r}, and this replay wrote no file in "
                        f"{os.path.dirname(r['file'])!r}")
        elif r["mode"] == "write" and r["handle"] not in opened and \
                files.still_open(file, isinstance(r["data"], str)) is None:
            return f"it wrote to {r['file']!r}, which this replay has not open"
    return None


def rewrite(files, rows):
    """Do again, in order, what a block execution that replay restored did to
    files in the record (`writes` rows), as the script's own writes would
    be (suppressed, claimed, appended: files.py's rules): to the file the
    script still has open for it, else to the file opened again (with "w"
    where the block truncated it)."""
    opened = {}  # the record's handle -> the file this restore opened for it
    files.dirs.update(os.path.dirname(_path(files, r["file"])) for r in rows
                      if r["mode"] not in _NOT_OPENS)
    try:
        for r in rows:
            data, mode, handle = r["data"], r["mode"], r["handle"]
            file = _path(files, r["file"])
            if mode == "write":
                f = opened.get(handle) or files.still_open(file, isinstance(data, str))
                if f is not None:  # (`unrewritable` found it open)
                    f.write(data)
            elif mode in ("flush", "close"):
                f = opened.pop(handle, None) if mode == "close" else opened.get(handle)
                if f is not None:
                    f.flush() if mode == "flush" else f.close()
                elif (f := files.still_open(file, None)) is not None:
                    f.flush()  # (the script's own file object: it closes it itself)
            else:  # the block opened it
                if handle in opened:
                    opened.pop(handle).close()
                opened[handle] = files.open(file, mode, (), json.loads(r["args"] or "{}"))
    finally:
        for f in opened.values():
            f.close()
