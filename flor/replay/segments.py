"""How a replay splits the main loop into segments, one per worker task.

From what the record measured, each main-loop iteration costs a worker
some seconds to replay (its probed blocks run, the others are restored) and
some to pseudoresume (to get past it on the way to a later segment);
an iteration checkpoint lets a worker start after it at the cost of a
restore.  `partition` chooses the segment starts that let the busiest
worker finish soonest, and with that the least busy one as late as it
can (workers that finish together); `segments_for` how many segments a local replay
makes; FLOR_SEGMENTS is the tests' seam that fixes the starts.
"""
from __future__ import annotations

import bisect
import heapq
import os

from ..context import is_outermost, top_key
from ..errors import FlorError

__all__ = ["Costs", "partition", "iteration_costs", "resume_points", "main_iteration",
           "segments_for", "forced_segments", "worker_start_s", "SEGMENTS_ENV"]


class Costs:
    """What the record measured of the main loop's iterations, in seconds:
    `work[i]` to replay iteration i (probed blocks run, the others are
    restored), `pseudo[i]` to get past it, `restart[s]` to start at s from an
    iteration checkpoint instead.  Without costs every iteration counts 1
    and getting to a start 0."""

    def __init__(self, total, work=None, pseudo=None, restart=None):
        work = list(work) if work is not None else [1.0] * total
        pseudo = list(pseudo) if pseudo is not None else [0.0] * total
        self.restart = {s: c for s, c in (restart or {}).items() if 0 < s < total}
        self.pw, self.pp = [0.0], [0.0]  # prefix sums of work and pseudo
        for w, p in zip(work, pseudo):
            self.pw.append(self.pw[-1] + w)
            self.pp.append(self.pp[-1] + p)

    def reach(self, s) -> float:
        """Seconds for a worker to get to start s."""
        return min(self.pp[s], self.restart.get(s, self.pp[s]))

    def segment(self, s, e) -> float:
        """Seconds for a worker to replay segment [s, e), getting to s first."""
        return self.reach(s) + self.pw[e] - self.pw[s]


def partition(total: int, jobs: int, resumable: set, work=None, pseudo=None,
              restart=None) -> list[list[int]]:
    """Split iterations [0, total) into at most `jobs` contiguous segments, each
    starting just after a resumable iteration (one whose block executions were
    all checkpointed) or at a key of `restart`, so that the busiest worker
    finishes soonest and then the least busy one as late as that allows.

    A worker first gets to the start s of its segment, by pseudoresuming the
    iterations before it (pseudo[i] seconds each) or, where s is in
    `restart`, by restoring an iteration checkpoint (restart[s] seconds),
    then replays its own iterations at work[i] each.  Without costs every
    iteration counts 1 and getting to a start 0: equal-length segments.
    """
    if total <= 0:
        return [[0, 0]]
    costs = Costs(total, work, pseudo, restart)
    pw, reach = costs.pw, costs.reach
    starts = sorted({i + 1 for i in resumable if 0 <= i < total - 1} | set(costs.restart))

    def fits(limit, floor=0.0):
        """Segment starts (fewest segments) with which every worker takes
        between `floor` and `limit` seconds, if at most `jobs` segments do
        it, else None.  A segment from s may end at any start e where
        reach(s) + the work from s to e is within the bounds; a nearer start
        can be cheaper to get to than a later one."""
        waiting, open_ = [], []  # (first end, n, last end, s); (n, -last end, s)
        came = {}
        for s in [0] + starts:
            while waiting and waiting[0][0] <= s:
                _, n, last, q = heapq.heappop(waiting)
                heapq.heappush(open_, (n, -last, q))
            while open_ and -open_[0][1] < s:
                heapq.heappop(open_)
            if s == 0:
                n = 0
            elif open_:
                n, came[s] = open_[0][0], open_[0][2]
            else:
                continue
            if n == jobs:
                continue
            base = pw[s] - reach(s)
            first = max(bisect.bisect_left(pw, floor + base), s + 1)
            last = bisect.bisect_right(pw, limit + base) - 1
            if first <= total <= last:
                bounds = [s]
                while bounds[-1] != 0:
                    bounds.append(came[bounds[-1]])
                return bounds[::-1]
            if first <= last:
                heapq.heappush(waiting, (first, n + 1, last, s))
        return None

    # The busiest worker's time, as small as it can be; then, with it, the
    # least busy one's as large (balanced finish times).
    hi = reach(0) + pw[total]
    lo, best = 0.0, fits(hi)
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        found = fits(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    limit, lo, up = hi, 0.0, hi
    while up - lo > 1e-3 * limit:
        mid = (lo + up) / 2
        found = fits(limit, mid)
        if found is None:
            up = mid
        else:
            lo, best = mid, found
    return [[b, e] for b, e in zip(best, best[1:] + [total])]


def main_iteration(row, main_top):
    """The main-loop iteration a decision row is in (None: outside it)."""
    return row["top_iter"] if row["top"] == main_top else None


def iteration_costs(rec, decisions, loops, probed, no_restore):
    """Seconds per main-loop iteration when replayed (probed blocks run, the
    others are restored) and when pseudoresumed, from what the record measured."""
    total = rec["iterations"] or 0
    main_top = top_key(rec["main_loop"], rec["main_run"])
    loop = [r for r in loops if (r["loop"], r["run"], r["depth"]) ==
            (rec["main_loop"], rec["main_run"], 0)]
    block_time, run_time, pseudo_time = [0.0] * total, [0.0] * total, [0.0] * total
    for d in decisions:
        i = main_iteration(d, main_top)
        if i is None or not 0 <= i < total or not is_outermost(d["ctx"]):
            continue
        block_time[i] += d["compute_s"]
        restorable = d["checkpoint"] and d["block"] not in no_restore
        write_s = d["nbytes"] / d["bandwidth"] if d["bandwidth"] else 0.0
        restore = (rec["c"] or 0.0) * write_s  # c: restore over write time
        run_time[i] += d["compute_s"] if d["block"] in probed or not restorable else restore
        pseudo_time[i] += restore if restorable else d["compute_s"]
    outer = max(0.0, (loop[0]["seconds"] - sum(block_time)) / total) if loop and total else 0.0
    return [outer + t for t in run_time], [outer + t for t in pseudo_time]


def resume_points(store, rec, iterations, total):
    """({i: file} of the iteration checkpoints of the main loop that
    were written, {i + 1: estimated seconds to restore it})."""
    main_top = top_key(rec["main_loop"], rec["main_run"])
    resume, restart = {}, {}
    ckpt_dir = store.layout.ckpt_dir(rec["run_id"])
    for d in iterations:
        i = main_iteration(d, main_top)
        if d["checkpoint"] and d["file"] and i is not None and 0 <= i < total - 1 and \
                os.path.isfile(os.path.join(ckpt_dir, d["file"])):
            resume[i] = d["file"]
            write_s = d["nbytes"] / d["bandwidth"] if d["bandwidth"] else 0.0
            restart[i + 1] = (rec["c"] or 0.0) * write_s
    return resume, restart


SEGMENTS_ENV = "FLOR_SEGMENTS"  # the tests' seam: where segments start, "0,5,9"


def forced_segments(starts: str, total: int) -> list:
    """The segments that start at the iterations `starts` names (and 0)."""
    try:
        at = sorted({0} | {int(x) for x in starts.split(",") if x.strip()})
    except ValueError:
        raise FlorError(f"{SEGMENTS_ENV} must list iterations, as 0,5,9: not {starts!r}") \
            from None
    if at[-1] >= total or at[0] < 0:
        raise FlorError(f"{SEGMENTS_ENV}={starts}: the main loop has iterations 0 to "
                        f"{total - 1}")
    return [[a, b] for a, b in zip(at, at[1:] + [total])]


MIN_START_S = 0.5  # a worker process's own start (Python, flor, its plan), at least


def worker_start_s(rec) -> float:
    """Seconds a replay worker takes to reach the main loop: the record's
    time before it, and never less than a process's own start."""
    return max(rec["info"].startup_s or 0.0, MIN_START_S)


def segments_for(jobs, work, rec) -> int:
    """How many segments a local replay on `jobs` workers splits the main
    loop into: one per worker, and more (up to 4 per worker, for the queue
    to balance and to re-run less after a failure) while each segment's work
    stays 20 times the cost of starting a worker (the script's start: the
    record's time before its main loop)."""
    if jobs <= 1:
        return 1
    startup = worker_start_s(rec)
    per_worker = int(sum(work) / (jobs * 20 * startup))
    return jobs * max(1, min(4, per_worker))
