"""Files the script writes: written once however many workers replay the
script (in a replay worker, and in record --resume); in record, what a
block writes to them is journaled, and a replay that restores the block
writes it again (filewrites.py).

The rule: a file that the user's program opens for writing with ``open()``
(builtins.open or io.open, also through ``pathlib.Path.open`` and
``write_text``, and the file of a ``logging.FileHandler`` it makes; the
statement calling it is in a file of the program: not flor, not an
installed library) is a `GuardedFile`:

- while the session suppresses side effects (effects.py: pseudoresumed
  iterations, the set-up before the main loop in parts other than the
  first, record --resume before its restore; and, for files only, the
  set-up of a copy of a slow worker that was past its own), writes to it
  do not reach the file;
- a file opened while they are suppressed is neither created nor truncated
  (modes ``w`` and ``x``): it is opened only if the script writes to it
  once they no longer are, for appending (truncated first if the set-up
  opened it with ``w`` and no part of the replay wrote it yet);
- in a replay of several segments, what a worker writes to such a file
  while suppressed (its set-up, pseudoresumed iterations; also appending
  to it later) goes to a private copy, which it reads in its place while
  suppressed (``open``/``io.open`` for reading, from any Python code; not
  ``os.path.exists``, readers in C, or ones that took ``open`` before
  flor patched it, such as numpy's loadtxt), and which ``os.replace``/
  ``os.rename`` move and the user's ``os.remove``/``os.unlink`` drop
  (removing nothing else then), until it writes the file itself: the
  worker reads back what it wrote, as in a plain run, never the file
  another part is writing at that moment;
- a file that replay's set-up (before the main loop) opens with ``w`` is
  truncated by the first part only, unless another part wrote to it first
  (workers start together, and parts run by a scheduler in any order;
  every part that writes a file leaves a mark in the replay's directory,
  and decides under a lock whether it truncates, so the truncation
  happens before any other part writes), and appended to by every part,
  the first included, so that workers writing one file side by side
  never overwrite each other's lines.  Their lines follow the order the
  workers wrote them in, not the iterations'; a file rewritten every
  iteration ends as the part that finished last left it.
- a replay of one segment opens files as the script asks.

Files that libraries open for writing (torch.save(path), numpy.save,
DataFrame.to_csv), os.open and flor's own files are never touched.
"""
from __future__ import annotations

import builtins
import fcntl
import functools
import hashlib
import io
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import weakref

from ..context import PRE

__all__ = ["Files", "GuardedFile"]

_WRITING = frozenset("wax+")
_PAST = frozenset({"fileno", "buffer", "raw", "detach"})  # ways past a GuardedFile's writes
_STDLIB = os.path.dirname(pathlib.__file__)
# Code between the user's statement and open(): pathlib, logging's file
# handlers, and the logging patch of effects.py (a handler that opens its
# file at the first record).
_THROUGH = frozenset({pathlib.__file__, os.path.join(_STDLIB, "logging", "__init__.py"),
                      os.path.join(_STDLIB, "logging", "handlers.py"),
                      os.path.join(os.path.dirname(os.path.abspath(__file__)), "effects.py")})


def _key(file) -> str:
    try:
        return os.path.abspath(os.fsdecode(file))
    except TypeError:
        return repr(file)


class GuardedFile:
    """A file the user's code opened for writing (see the module's docstring):
    opened now (`real`) or at its first write (`pending`: open's arguments),
    with what is written while suppressed in the `private` copy, if any.
    `key` is its absolute path (None for a descriptor).  In record, what
    it writes inside a block is journaled (filewrites.py)."""

    def __init__(self, effects, real=None, pending=None, opener=None, truncate=False,
                 private=None, key=None):
        self._fx, self._real, self._pending, self._opener = effects, real, pending, opener
        self._truncate = truncate  # opened with "w" while quiet
        self._private = private
        self._closed = False
        self.key = key
        self.handle = None  # its number in a record's journal (filewrites.py)

    def _file(self):
        if self._real is None:
            if self._closed:
                raise ValueError("I/O operation on closed file.")
            file, mode, args, kwargs = self._pending
            if self._private is not None:  # from now on this process reads the file
                self._private.close()
                self._fx.files.forget(file)
                self._private = None

            # The first part of a replay to write a file its set-up opened
            # with "w" truncates it (what it held predates the replay).
            # Every part appends, the first too: a part that wrote at its
            # own offset would overwrite the lines others appended since.
            def truncate(others, mine):
                if self._truncate and not others and not mine:
                    self._opener(file, mode.replace("a", "w", 1), *args, **kwargs).close()

            self._fx.files_claim(file, truncate)
            self._real = self._opener(file, mode, *args, **kwargs)
        return self._real

    def _quiet(self):
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        return self._private

    def write(self, data):
        if self._fx.files_quiet():
            private = self._quiet()
            return private.write(data) if private is not None else len(data)
        n = self._file().write(data)
        journal = self._fx.journal
        if journal is not None:
            if not journal.gathers(self, data):
                journal.wrote(self, data)
            elif (g := journal.gathered) is not None and g.where is journal.s.where:
                g.parts.append(data if type(data) in (str, bytes) else bytes(data))
                g.nbytes += len(data)
        return n

    def writelines(self, lines):
        if self._fx.journal is not None:
            lines = list(lines)  # (an iterator: journaled as written)
        if self._fx.files_quiet():
            private = self._quiet()
            return private.writelines(lines) if private is not None else None
        self._file().writelines(lines)
        if self._fx.journal is not None and lines:
            self._fx.journal.wrote(self, "".join(lines) if isinstance(lines[0], str)
                                   else b"".join(lines))

    def seek(self, offset, whence=0):
        # (to the end, as a rotating log handler does: nothing moves)
        if self._fx.journal is not None and (offset, whence) != (0, 2):
            self._fx.journal.moved(self.name, "seek")
        return self._target().seek(offset, whence)

    def truncate(self, *args, **kwargs):
        if self._fx.journal is not None:
            self._fx.journal.moved(self.name, "truncate")
        return self._target().truncate(*args, **kwargs)

    def binary(self) -> bool:
        mode = self._pending[1] if self._real is None else getattr(self._real, "mode", "")
        return "b" in mode

    def flush(self):
        for f in (self._private, self._real):
            if f is not None:
                f.flush()
        if self._fx.journal is not None:
            self._fx.journal.done(self, "flush")

    def close(self):
        if self._fx.journal is not None and not self.closed:
            self._fx.journal.done(self, "close")
        self._closed = True
        for f in (self._private, self._real):
            if f is not None:
                f.close()

    @property
    def closed(self):
        return self._real.closed if self._real is not None else self._closed

    def __reduce_ex__(self, protocol):
        # As the file itself: a file object cannot be pickled (nor copied).
        raise TypeError(f"cannot pickle file object {self.name!r}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _target(self):
        """What reads and other calls go to: the private copy while writes
        are suppressed (the file itself is not opened for them), else the file."""
        if self._real is None and self._private is not None and self._fx.files_quiet():
            return self._private
        return self._file()

    def __iter__(self):
        return iter(self._target())

    def __next__(self):
        return next(self._target())

    def __repr__(self):
        return f"<flor guarded {self._real!r}>" if self._real is not None else \
            f"<flor guarded file {self._pending[0]!r}, not opened yet>"

    @property
    def name(self):
        if self._real is None:
            file = self._pending[0]
            return file if isinstance(file, (bytes, int)) else os.fspath(file)
        return self._real.name

    def __getattr__(self, name):
        if name in _PAST and self._fx.journal is not None:  # (what is written there is not seen)
            self._fx.journal.moved(self.name, name)
        return getattr(self._target(), name)  # (tell, read, mode: of what it wrote)


# A file object, like the one it stands for: hands-free mode does not take
# it for loop state (handsfree.py), as it does not take the real one.
io.IOBase.register(GuardedFile)


class Files:
    """builtins.open and io.open (and os.replace/os.rename for a suppressed
    set-up's private copies), guarded while the session runs."""

    def __init__(self, effects):
        self.fx = effects
        self.original = original = builtins.open
        self._io_open = io.open
        self._claimed = set()  # files this process marked (Files.claim)
        self._locked = 0  # Files.claim calls under way (an opener's open is one inside another)
        self._thread_lock = threading.RLock()
        self._set_up_w = set()  # files the suppressed set-up opened with "w"
        self._private = {}  # file -> its private copy
        self._private_dir = None
        self._serial = 0  # of private copies
        self._live = {}  # file -> weak references to the GuardedFiles open on it
        self.dirs = set()  # directories this process opened files in for writing
        self.cwd = os.getcwd()  # what the journal's relative file names are relative to
        guard = self

        def open(file, mode="r", *args, **kwargs):
            if not (_WRITING & set(mode)):
                if guard._private:
                    file = guard.private_copy(file)
                return original(file, mode, *args, **kwargs)
            if not guard.by_user(sys._getframe(1)):
                return original(file, mode, *args, **kwargs)
            return guard.open(file, mode, args, kwargs)

        # What the script sees of open() is the builtin's: its name, module
        # (pickled by reference) and docstring.
        functools.update_wrapper(open, original)
        self.replacement = open
        builtins.open = io.open = open
        self._moves = {}  # name -> (os's function, flor's, the modules holding it)
        s = effects.s
        if s.replaying and len(s.policy.plan.segments) > 1 and (s.part > 0 or effects.copy):
            self._patch_os(self._private_moves)  # (this process's set-up is suppressed)
        elif effects.journal is not None:
            self._patch_os(self._journaled_moves)

    def _private_moves(self, name, original):
        """os.replace/os.rename move private copies, os.remove/os.unlink
        drop them (and, called by the user's code while suppressed, remove
        nothing else): in the workers that have suppressed phases."""
        if name in ("replace", "rename"):
            def patched(src, dst, *args, **kwargs):
                if not args and not kwargs and self.renamed(src, dst):
                    return None
                if not isinstance(dst, int):
                    self.forget(dst)  # (a real file comes to its place)
                return original(src, dst, *args, **kwargs)
        else:
            def patched(path, *args, **kwargs):
                if not args and not kwargs and self.removed(path, sys._getframe(1)):
                    return None
                return original(path, *args, **kwargs)
        return patched

    def _journaled_moves(self, name, original):
        """Record: a block whose code renames or removes a file is not
        checkpointed (filewrites.py)."""
        def patched(path, *args, **kwargs):
            if self.by_user(sys._getframe(1)):
                try:
                    what = os.fsdecode(path)
                except TypeError:  # (os's own function says what is wrong with it)
                    what = repr(path)
                self.fx.journal.moved(what, f"os.{name}")
            return original(path, *args, **kwargs)
        return patched

    def _patch_os(self, make):
        """os.replace, os.rename, os.remove and os.unlink, as `make(name,
        os's function)` makes them."""
        for name in ("replace", "rename", "remove", "unlink"):
            original = getattr(os, name)
            patched = make(name, original)
            # The script sees os's function (its name, module, docstring), and
            # pickles it by reference: its module (posix) holds flor's too.
            # A function another module put in os's place is pickled as os's.
            functools.update_wrapper(patched, original)
            home = sys.modules.get(original.__module__)
            homes = (os,)
            if home is not None and home is not os and getattr(home, name, None) is original:
                homes += (home,)
            else:
                patched.__module__, patched.__name__, patched.__qualname__ = "os", name, name
            self._moves[name] = (original, patched, homes)
            for home in homes:
                setattr(home, name, patched)

    def flush_open(self):
        """Flush the files the script left open (a replay worker's, at its
        exit, after the script's own exit handlers): the interpreter's last
        collections close a file held in a reference cycle in no set order,
        and a file object closed before its buffer loses what the buffer
        held (CPython's bpo-17852), in some workers and not in a plain run.
        A failure is left unsaid, as a plain run's exit leaves it."""
        for refs in self._live.values():
            for ref in refs:
                f = ref()
                if f is not None and not f.closed:
                    try:
                        f.flush()
                    except (OSError, ValueError):
                        pass

    def by_user(self, frame) -> bool:
        """Whether open() was called by the user's program (maybe through
        pathlib or a logging.FileHandler)."""
        if not self.fx._mine():
            return False
        while frame is not None and frame.f_code.co_filename in _THROUGH:
            frame = frame.f_back
        return frame is not None and self.fx.user_code(frame.f_code)

    def open(self, file, mode, args, kwargs):
        """A GuardedFile for the user's open(file, mode, *args, **kwargs)."""
        f = self._open(file, mode, args, kwargs)
        if not isinstance(file, int):
            f.key = _key(file)
            self.dirs.add(os.path.dirname(f.key))
            live = self._live.setdefault(f.key, [])
            live[:] = [r for r in live if (g := r()) is not None and not g.closed]
            live.append(weakref.ref(f))
        if self.fx.journal is not None:
            self.fx.journal.opened(f, mode, args, kwargs)
        return f

    def _open(self, file, mode, args, kwargs):
        fx, original = self.fx, self.original
        if isinstance(file, int):  # a descriptor: guard its writes only
            return GuardedFile(fx, original(file, mode, *args, **kwargs))
        creates = "w" in mode or "x" in mode
        s = fx.s
        several = s.replaying and len(s.policy.plan.segments) > 1
        if creates and fx.files_quiet():
            appending = mode.replace("w", "a").replace("x", "a")
            private = None
            if several:
                if "w" in mode and s.phase == PRE:
                    self._set_up_w.add(_key(file))
                private = self._private_open(file, mode.replace("x", "w"), args, kwargs)
            return GuardedFile(fx, pending=(file, appending, args, kwargs), opener=original,
                               truncate="w" in mode, private=private)
        key = _key(file)
        if key in self._private and "a" in mode and fx.files_quiet():
            return GuardedFile(fx, pending=(file, mode, args, kwargs), opener=original,
                               truncate=key in self._set_up_w,
                               private=original(self._private[key], mode, *args, **kwargs))
        if not fx.files_quiet():
            self.forget(file)  # (this process reads what it writes now)
        if several and not fx.files_quiet():
            if "w" in mode and s.phase == PRE:
                def truncate(others, mine):  # unless a part (not a run of this one) wrote it
                    if not others or others == {"0"}:
                        original(file, mode, *args, **kwargs).close()

                self.claim(file, truncate)
                mode = mode.replace("w", "a")
            else:
                def truncate(others, mine):  # a file this part's set-up opened with "w"
                    if key in self._set_up_w and not others and not mine:
                        original(file, "wb").close()

                self.claim(file, truncate)
        return GuardedFile(fx, original(file, mode, *args, **kwargs))

    # -- private copies of what is written while suppressed --------------------

    def _private_open(self, file, mode, args, kwargs):
        """A private copy for what is written to `file` while suppressed,
        which this process reads in its place; None where there is none."""
        try:
            if self._private_dir is None:
                plan = self.fx.s.policy.plan
                root = os.path.join(plan.store, "runs", plan.replay_id, "private")
                os.makedirs(root, exist_ok=True)
                self._private_dir = tempfile.mkdtemp(dir=root, prefix=f"part{self.fx.s.part}-")
            self._serial += 1
            copy = os.path.join(self._private_dir,
                                f"{self._serial}-{os.path.basename(os.fsdecode(file))}")
            f = self.original(copy, mode, *args, **kwargs)
        except (OSError, TypeError, ValueError):
            return None
        self._private[_key(file)] = copy
        return f

    def private_copy(self, file):
        """What to open to read `file`: its private copy while suppressed,
        if it has one."""
        if isinstance(file, int) or not self.fx.files_quiet():
            return file
        return self._private.get(_key(file), file)

    def forget(self, file):
        self._private.pop(_key(file), None)

    def renamed(self, src, dst) -> bool:
        """os.replace/os.rename while suppressed: a private copy moves
        to its new name (True), as the file would have in a plain run."""
        if isinstance(src, int) or isinstance(dst, int) or not self._private or \
                not self.fx.files_quiet() or os.path.isdir(dst):
            return False
        copy = self._private.pop(_key(src), None)
        if copy is None:
            return False
        self._private[_key(dst)] = copy
        return True

    def removed(self, path, frame) -> bool:
        """os.remove/os.unlink by the user's code while suppressed: it drops the
        file's private copy, and removes nothing else (True)."""
        if isinstance(path, int) or not self.fx.files_quiet() or not self.by_user(frame):
            return False
        self.forget(path)
        return True

    # -- the files open now (filewrites.py redoes a restored block's writes) ---

    def still_open(self, file, text):
        """The GuardedFile the script opened last on `file` and has not
        closed, if it writes `text` (str) or bytes (either: None)."""
        for ref in reversed(self._live.get(_key(file), ())):
            f = ref()
            if f is not None and not f.closed and (text is None or f.binary() != text):
                return f
        return None

    # -- parts that write one file ------------------------------------------------

    def claim(self, file, act):
        """Leave this part's mark for `file` in the replay's directory and
        return `act(others, mine)`: `others`, the parts that marked it
        before (that wrote it), this process not counted; `mine`, whether
        this process did.  Parts hold a lock on the marks meanwhile, so what
        `act` does to the file happens before any other part writes it."""
        s = self.fx.s
        plan = s.policy.plan
        marks = os.path.join(plan.store, "runs", plan.replay_id, "written")
        key = _key(file)
        digest = hashlib.sha1(key.encode(errors="surrogateescape")).hexdigest()
        with self._thread_lock:
            return self._claim(s.part, len(plan.segments), key, marks, digest, act)

    def _claim(self, part, parts, key, marks, digest, act):
        lock = None
        self._locked += 1
        try:
            if self._locked == 1:  # (`act` may open files: the lock is this process's)
                try:
                    os.makedirs(marks, exist_ok=True)
                    lock = os.open(os.path.join(marks, "lock"), os.O_CREAT | os.O_RDWR, 0o644)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                except OSError:  # (a file system without locks: the marks still count)
                    pass
            try:
                others = {str(p) for p in range(parts)
                          if os.path.exists(os.path.join(marks, f"{digest}.{p}"))}
                os.close(os.open(os.path.join(marks, f"{digest}.{part}"),
                                 os.O_CREAT | os.O_WRONLY, 0o644))
            except OSError:
                others = set()  # no marks: as if no other part wrote it
            mine = key in self._claimed
            if mine:
                others.discard(str(part))
            self._claimed.add(key)
            return act(others, mine)
        finally:
            self._locked -= 1
            if lock is not None:
                os.close(lock)  # (which releases the lock)

    def restore(self):
        if builtins.open is self.replacement:
            builtins.open = self.original
        if io.open is self.replacement:
            io.open = self._io_open
        for name, (original, move, homes) in self._moves.items():
            for home in homes:
                if getattr(home, name) is move:
                    setattr(home, name, original)
        self._private = {}
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
