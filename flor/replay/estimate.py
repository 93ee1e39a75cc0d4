"""What a replay is expected to take, and what re-running the edited script
would, from what the record measured: the planner says before it starts
when more workers would not finish sooner or re-running would be faster,
and a replay's closing line compares it with re-running.

Re-running is the record's time less flor's own work in it (checkpoints,
fingerprints, bookkeeping).  A replay worker runs the script's start (the
record's time to the main loop's first iteration, and at least a process's
own start: segments.worker_start_s), gets to its segment and
replays it (segments.Costs); the last one also runs what comes after the
main loop; segments go to the workers in order as they free up.  A local
replay starts only the workers that pay (`workers_that_pay`).
"""
from __future__ import annotations

from .segments import worker_start_s

__all__ = ["rerun_seconds", "replay_seconds", "workers_that_pay", "planning_notes",
           "closing_line", "ALL_JOBS_ENV", "GAIN"]

ALL_JOBS_ENV = "FLOR_ALL_JOBS"  # "1": start every worker --jobs allows
GAIN = 0.1  # what one more worker must save of the expected time to be started


def rerun_seconds(rec) -> float | None:
    """A plain run of the recorded script, in seconds (None: the record did
    not finish, or was resumed: its time holds the pause, and what it
    measured, the last process's alone)."""
    if not rec["finished"] or not rec["started"] or rec["info"].resumed:
        return None
    seconds = rec["finished"] - rec["started"] - (rec["info"].flor_seconds or 0.0)
    return seconds if seconds > 0 else None


def replay_seconds(rec, main_s, segments, costs, workers) -> float | None:
    """The expected wall time of replaying `segments` (costs: segments.Costs)
    on `workers` processes; `main_s`: the record's main-loop seconds."""
    rerun = rerun_seconds(rec)
    if rerun is None:
        return None
    after = max(0.0, rerun - (rec["info"].startup_s or 0.0) - main_s)
    startup = worker_start_s(rec)
    free = [0.0] * max(1, workers)
    for i, (s, e) in enumerate(segments):
        w = free.index(min(free))
        free[w] += startup + costs.segment(s, e) + (after if i == len(segments) - 1 else 0.0)
    return max(free)


def workers_that_pay(rec, main_s, options, costs):
    """(workers, note or None): the fewest workers of `options` ({workers:
    their segments}) expected to finish within GAIN of the soonest.  A
    worker pays only if it saves time: each runs the script's start and
    gets to its segment, and the estimate does not see a busy machine.
    With no estimate (the record did not finish), all of them."""
    asked = max(options)
    expected = {k: replay_seconds(rec, main_s, segments, costs, k)
                for k, segments in options.items()}
    if any(v is None for v in expected.values()):
        return asked, None
    best = min(expected.values())
    chosen = min(k for k, v in expected.items() if v <= best * (1 + GAIN))
    if chosen == asked:
        return asked, None
    return chosen, (f"replaying on {chosen} worker{'s' if chosen > 1 else ''} of the {asked} "
                    f"--jobs allows: about {expected[chosen]:.1f} s expected, against "
                    f"{expected[asked]:.1f} s on {asked} (each worker runs the script's start, "
                    f"{worker_start_s(rec):.1f} s, and gets to its segment); "
                    f"{ALL_JOBS_ENV}=1 starts all {asked}")


def planning_notes(rec, main_s, segments, alone, costs, workers) -> list[str]:
    """Notes before a local replay starts: `segments` on `workers`, against
    `alone` (the segments of one worker; None where workers_that_pay chose
    `workers`) and against re-running."""
    rerun = rerun_seconds(rec)
    mine = replay_seconds(rec, main_s, segments, costs, workers)
    if rerun is None or mine is None:
        return []
    notes = []
    if workers > 1 and len(segments) > 1 and alone is not None:
        one = replay_seconds(rec, main_s, alone, costs, 1)
        if one is not None and one <= mine * 1.05:
            notes.append(f"{workers} workers are not expected to finish sooner than one "
                         f"(about {mine:.1f} s against {one:.1f} s): each runs the script's "
                         f"start ({worker_start_s(rec):.1f} s) and gets "
                         "to its segment")
    if mine >= rerun:
        notes.append(f"this replay is expected to take about {mine:.1f} s, and re-running the "
                     f"script about {rerun:.1f} s: it restores too little to be faster (the "
                     "probed blocks run, and the script's start and what no block holds run "
                     "in every worker)")
    return notes


def closing_line(replay_id, seconds, rec) -> str | None:
    """The replay's time against re-running the script's."""
    rerun = rerun_seconds(rec)
    if not rerun or seconds <= 0:
        return None
    flor_s = rec["info"].flor_seconds or 0.0
    return (f"replay {replay_id} took {seconds:.1f} s; re-running the script would take about "
            f"{rerun:.1f} s (the record's {rerun + flor_s:.1f} s less flor's own "
            f"{flor_s:.1f} s): {rerun / seconds:.1f}x")
