"""The iteration checkpoints a record keeps on disk: at most a bound per
run of a loop, spread over the loop.

A step loop may checkpoint thousands of iterations (the adaptive rule finds
each one cheap), and nothing else bounds their disk use.  What they are for
needs few of them: a replay worker starts its segment after one, so a few
dozen spread over the loop let the planner split it evenly among the
workers; ``record --resume`` starts after the newest.  So a record keeps
at most ``limit`` iteration checkpoints of each run of a loop
(``--iteration-checkpoints``, ``FLOR_ITERATION_CHECKPOINTS``; default
DEFAULT_LIMIT).  When one more is written, one kept goes: the one whose
removal leaves the smallest gap between its neighbours (the loop's start
counts as a point before iteration 0; on ties, the oldest; never the
newest).  Once a loop has its limit, the record asks the rule again only
where a checkpoint is worth its cost (``due``): the kept ones thin from
the start of the loop onward and the new ones grow sparser, and at any
moment the largest gap, the loop's last iterations since the newest
included, is at most twice an even spread's, plus however long the
adaptive rule waited to say yes (or a larger gap the rule left).

A file goes once its write, and that of the newer checkpoint that took
its place, have finished (one whose newer checkpoint failed to write
stays), and only if no checkpoint of the run refers to its bytes
(incremental checkpoints, ``Materializer.remove``); one that is referred
to stays (a start point still) until the files that refer to it have
gone.  Removing files is charged to the loop's checkpoints, as training
pays for it.  The decisions row of a removed file says so (no checkpoint,
no file: replay and resume never look for it); the store is told at the
record's next flush, so a record killed in between leaves a row whose file
is missing, which replay skips and resume skips with a note.  Block
checkpoints are never removed: they are what lets a replay skip a block.
"""
from __future__ import annotations

import os

from ..errors import FlorError, note

__all__ = ["Thinning", "DEFAULT_LIMIT", "ENV", "limit_from_env"]

DEFAULT_LIMIT = 64
ENV = "FLOR_ITERATION_CHECKPOINTS"


def limit_from_env(default: int = DEFAULT_LIMIT) -> int:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return default
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise FlorError(f"{ENV} must be a whole number of at least 1 (the iteration "
                        f"checkpoints a record keeps of each loop), not {text!r}")
    return limit


def victim(points: list[int], origin: int = -1) -> int:
    """The index in `points` (iterations, increasing) of the point whose
    removal leaves the smallest gap between its neighbours; `origin` (the
    iteration before the loop's start, or a resumed record's restored one)
    is a point before them, and the last one stays."""
    best, best_gap = 0, None
    for j in range(len(points) - 1):
        gap = points[j + 1] - (points[j - 1] if j else origin)
        if best_gap is None or gap < best_gap:
            best, best_gap = j, gap
    return best


class Thinning:
    """The iteration checkpoints of one record, kept and going."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        self.limit = limit
        self._kept: dict[tuple, list[tuple[int, str, int]]] = {}  # (loop, run): (i, name, n)
        self._origin: dict[tuple, int] = {}  # (loop, run): where a resumed record started
        # (name, its submission number, the newer checkpoint's name and number)
        self._going: list[tuple[str, int, str, int]] = []
        self._referred: list[str] = []  # going, but a file refers to them: tried again
        self.removed: list[str] = []  # names removed, not yet told to the store
        self._tried = None  # the writes done at the last collect, until another goes
        self._due: dict[tuple, int] = {}  # (loop, run): due()

    def resumed_at(self, loop, run, i):
        """``record --resume`` restored iteration i of (loop, run): the files
        before it are the interrupted process's, left as they are, and this
        process spreads its own over the loop from there."""
        self._origin[(loop, run)] = i

    def written(self, loop, run, i, name, number):
        """Iteration i of (loop, run) was submitted as checkpoint `name`,
        the run's `number`-th (from 0)."""
        kept = self._kept.setdefault((loop, run), [])
        kept.append((i, name, number))
        origin = self._origin.get((loop, run), -1)
        if len(kept) > self.limit:
            _, gone, n = kept.pop(victim([p[0] for p in kept], origin))
            self._going.append((gone, n, name, number))
            self._tried = None
        if len(kept) == self.limit:
            points = [origin] + [p[0] for p in kept]
            spread = -(-2 * (points[-1] - origin) // self.limit)  # twice an even spread's gap
            due = points[-1] + spread
            if self.limit > 1:  # where the newest one's removal leaves the smallest gap
                due = max(due, points[-2] + min(b - a for a, b in zip(points, points[2:])))
            self._due[(loop, run)] = due

    def due(self, loop, run) -> int:
        """The first iteration of (loop, run) worth a checkpoint once the
        loop has its limit (0 until then): the newest kept one plus twice
        the gap of an even spread of the kept ones over the loop so far
        (and never where the checkpoint would just take the newest one's
        place: there its removal leaves the smallest gap).  Nearer, a
        checkpoint buys only a newer start point for ``record --resume``,
        at the price of removing an older one.  Written at every
        iteration, a loop's checkpoints then grow sparser as it runs, each
        about 1 + 2 / limit times as far into the loop as the one before:
        a record writes about limit + ln(n / n0) / ln(1 + 2 / limit) of
        them in n iterations (n0: where it reached the limit; about
        limit + (limit / 2) * ln(n / n0) for a large limit) rather than
        one at every gap the rule allows.  The largest gap then stays
        within twice an even spread's, plus however long the rule, once
        a checkpoint is due, waits before it says yes; ``record --resume``
        gives up at most that."""
        return self._due.get((loop, run), 0)

    def pending(self) -> bool:
        return bool(self._going)

    def collect(self, mat, done: int, final: bool = False):
        """Remove the files going whose writes finished, and that of the
        newer checkpoint that took their place (so that a kill never finds
        the newest finished checkpoint removed): the first `done` submitted
        (one writer finishes them in order) and, with several writers (fork
        mode), files in place; `final`: every write has finished.  A file
        that another refers to stays until that one has gone too."""
        if not self._going and not (final and self._referred):
            return
        if not final and done == self._tried:  # as then: nothing more can be removed
            return
        self._tried = done

        def ready(name, n):
            return (final or n < done) and os.path.exists(mat.path_for(name))

        # At the end, files whose references a failed write gave back are tried again.
        waiting, freed = [], final
        for going in self._going:
            name, n, newer, n_newer = going
            if not ready(newer, n_newer):  # not written yet, or its write failed: it stays
                if not final:
                    waiting.append(going)
            elif not final and not ready(name, n):
                waiting.append(going)
            elif self._remove(mat, name):
                freed = True
            else:
                self._referred.append(name)
        self._going = waiting
        while freed:  # a removal may have released a file it referred to
            freed, still = False, []
            for name in self._referred:
                if self._remove(mat, name):
                    freed = True
                else:
                    still.append(name)
            self._referred = still

    def _remove(self, mat, name) -> bool:
        """Whether the file went (or was never there).  One that cannot be
        deleted (a read-only directory) no longer keeps the files it refers
        to: it is left on disk, said, and its row says it is removed, so
        that nothing restores it; training goes on."""
        try:
            if not mat.remove(name):
                return False
        except OSError as e:
            note(f"could not delete iteration checkpoint {mat.path_for(name)} ({e}); it is "
                 "no longer used")
        self.removed.append(name)
        return True

    def take_removed(self) -> list[str]:
        out, self.removed = self.removed, []
        return out
