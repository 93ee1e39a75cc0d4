"""A run of a step loop's quiet iterations in C (SkipMachine.quiet_steps in
csrc/skipblock.c; flor/runtime/loops.py and recording.py use it): what each
iteration sets before its item is drawn, what it accounts as it ends, and
where the run stops (unit tests, in-process); and a step loop recorded
through such runs, end to end."""
import json
import os
import time

import pytest

from flor import _core
from flor.context import LOOP, LoopFrame, Where



class Session:
    """What the run sets on a session: `where` (Session._context_changed)."""

    where = None


def run(items, quota=100, deadline=None, index=5, body=None):
    """Drive a run over `items` as a for loop does; `body(i, item, session)`
    runs as each item's iteration.  Returns (machine, handle, frame, session,
    journal, what each body saw, the run)."""
    m = _core.SkipMachine(_core.RECORD, 1 / 15, 1.0)
    h = m.block("loop (iteration)")
    frame = LoopFrame([LOOP, "t.py:3", 0, index - 1])
    s, journal = Session(), _core.Journal(lambda code: None)
    q = m.quiet_steps(h, iter(items), frame, index, quota,
                      time.monotonic() + 60 if deadline is None else deadline, s, journal,
                      Where, None, '[["L","t.py:3",0,', '["t.py:3",0]')
    seen = []
    for x in q:
        seen.append((x, frame[3], s.where, journal.info))
        if body is not None:
            body(frame[3], x, s)
    return m, h, frame, s, journal, seen, q


@pytest.mark.unit
def test_each_item_is_drawn_in_its_iteration_and_each_iteration_is_accounted():
    m, h, frame, s, journal, seen, q = run("abc")
    assert [x for x, *_ in seen] == ["a", "b", "c"]
    for i, (_, index, where, info) in enumerate(seen, start=5):
        assert index == i and where is info
        assert where == Where(None, f'[["L","t.py:3",0,{i}]]', '["t.py:3",0]', i, (i,))
        assert type(where) is Where
    # The iterable ended: the index is that of the draw that found its end,
    # and the three iterations were accounted as ran() accounts one.
    status, drawn, accounted, clean, own, pending = q.outcome()
    assert (status, drawn, accounted, frame[3]) == (_core.QUIET_ENDED, 3, 3, 8)
    st = m.stats(h)
    assert st["n"] == 3 and st["compute_s"] == pytest.approx(clean) and clean >= 0 and own >= 0
    assert pending == 0.0 and list(q) == []  # a stopped run stays stopped


@pytest.mark.unit
def test_the_run_stops_at_the_end_of_its_quota_of_iterations():
    m, h, frame, _, _, seen, q = run(range(100), quota=4)
    assert [x for x, *_ in seen] == [0, 1, 2, 3]
    assert q.outcome()[:3] == (_core.QUIET_LIMIT, 4, 4) and m.stats(h)["n"] == 4
    assert frame[3] == 8  # the last iteration it ran: the next starts at 9


@pytest.mark.unit
def test_an_iteration_that_ends_past_the_deadline_is_left_to_end_in_python():
    """A flush is due: the iteration by whose end it is due ends the
    Python way, which flushes."""
    m, h, frame, _, _, seen, q = run(range(100), deadline=time.monotonic() - 1)
    status, drawn, accounted, _, _, pending = q.outcome()
    assert len(seen) == 1 and (status, drawn, accounted, frame[3]) == (_core.QUIET_OPEN, 1, 0, 5)
    assert pending >= 0 and m.stats(h)["n"] == 0


@pytest.mark.unit
def test_an_iteration_that_changes_where_is_left_to_end_in_python():
    """A loop or block opened in an iteration changes the session's where:
    the run stops at that iteration's end and leaves it open (unaccounted),
    saying how long its body ran."""
    def body(i, x, s):
        if i == 7:
            s.where = Where(None, "elsewhere", None, None, ())
            time.sleep(0.01)  # a body that runs 10 ms at least

    m, h, frame, _, _, seen, q = run(range(100), body=body)
    status, drawn, accounted, _, _, pending = q.outcome()
    assert (status, drawn, accounted, frame[3]) == (_core.QUIET_OPEN, 3, 2, 7)
    assert pending >= 0.01 and m.stats(h)["n"] == 2


@pytest.mark.unit
def test_an_error_drawing_an_item_comes_out_of_the_run():
    def items():
        yield 1
        raise KeyError("bad item")

    m = _core.SkipMachine(_core.RECORD, 1 / 15, 1.0)
    h = m.block("loop (iteration)")
    frame = LoopFrame([LOOP, "t.py:3", 0, 0])
    q = m.quiet_steps(h, items(), frame, 1, 10, time.monotonic() + 60, Session(),
                      _core.Journal(lambda code: None), Where, None, "[", "top")
    assert next(q) == 1
    with pytest.raises(KeyError, match="bad item"):
        next(q)
    assert q.outcome()[:3] == (3, 1, 1) and m.stats(h)["n"] == 1 and frame[3] == 2
    with pytest.raises(StopIteration):
        next(q)


@pytest.mark.unit
def test_bad_arguments_are_refused():
    m = _core.SkipMachine(_core.RECORD, 1 / 15, 1.0)
    h = m.block("b")
    frame = LoopFrame([LOOP, "t.py:3", 0, 0])
    args = [h, iter(()), frame, 0, 1, 0.0, Session(), _core.Journal(lambda c: None), Where,
            None, "[", "top"]

    def call(**change):
        a = list(args)
        for k, v in change.items():
            a[int(k[1:])] = v
        return m.quiet_steps(*a)

    call()  # as given, they are accepted
    with pytest.raises(IndexError, match="no SkipBlock with handle 9"):
        call(a0=9)
    with pytest.raises(TypeError, match="an iterator"):
        call(a1=[1, 2])
    with pytest.raises(TypeError, match="loop frame"):
        call(a2=[LOOP, "t.py:3"])
    with pytest.raises(ValueError, match="quota >= 1"):
        call(a4=0)
    with pytest.raises(TypeError, match="tuple type"):
        call(a8=dict)
    with pytest.raises(TypeError, match="exactly 12 arguments"):
        m.quiet_steps(h)
    with pytest.raises(TypeError, match="cannot create"):
        type(call())()
    rep = _core.SkipMachine(_core.REPLAY, 1 / 15, 1.0)
    with pytest.raises(RuntimeError, match="record mode"):
        rep.quiet_steps(rep.block("b"), *args[1:])


STEPS = """
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(64, 4)
Y = X.sum(1, keepdim=True)
step = 0
norms = []
while True:
    i = step % 56
    loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 50 == 0:
        total = 0.0
        for p in model.parameters():
            total += float(p.detach().abs().sum())
        norms.append(total)
    if step % 7 == 0:
        print(f"step {step} loss {loss.item():.6f}")
    step += 1
    if step >= 1500:
        break
print("norms", [round(n, 6) for n in norms])
"""

# Record in a fresh interpreter, counting how each run of quiet iterations
# stopped (Recording.quiet_done, wrapped: the runs themselves are real).
RECORD_COUNTING = """
import collections, json, sys
from flor import __main__ as cli
from flor.runtime.recording import Recording

stops = collections.Counter()
done = Recording.quiet_done

def counting(self, session, frame, q, n):
    got = done(self, session, frame, q, n)
    stops[got[0]] += 1
    stops["accounted"] += got[2]
    return got

Recording.quiet_done = counting
rc = cli.main(["record", "steps.py"])
with open("stops.json", "w") as f:
    json.dump(stops, f)
sys.exit(rc)
"""


@pytest.mark.core
def test_a_step_loop_recorded_through_quiet_runs_is_exact(tmp_path):
    """A step loop whose steps print, with a nested loop every 50 steps and
    a break: the record prints what a plain run prints, each iteration is
    counted once, most are accounted in quiet runs (some stopped by the
    nested loop), and replays with a probe in the step, on one worker and
    on two, print what the edited script prints."""
    from conftest import block_stats, edit, flor, plain, run_py, runs, store, write_script

    d = str(tmp_path)
    write_script(d, "steps.py", STEPS)
    want = plain(d, "steps.py").stdout
    rec = run_py(RECORD_COUNTING, cwd=d, env={"FLOR_DIR": os.path.join(d, ".flor")})
    assert rec.stdout == want
    with open(os.path.join(d, "stops.json")) as f:
        stops = json.load(f)
    assert stops.get(str(_core.QUIET_LIMIT), 0) >= 1, stops
    assert stops.get(str(_core.QUIET_OPEN), 0) >= 1, stops
    assert stops["accounted"] >= 1000, stops  # most of the 1500 steps
    st = store(d)
    (r,) = runs(st, "record")
    assert r["iterations"] == 1500
    # Each iteration is an execution of the loop's iteration block, counted
    # once as it ends (the last one ends in break: it never does).
    assert block_stats(st, r["run_id"], "steps.py:10 (iteration)")["n"] == 1499
    assert block_stats(st, r["run_id"], "steps.py:18")["n"] == 30
    edit(os.path.join(d, "steps.py"), "opt.step()", 'print(f"  w {model.weight.sum().item():.6f}")')
    want = plain(d, "steps.py").stdout
    for jobs in ("1", "2"):
        out = flor(d, "replay", "--jobs", jobs, "steps.py")
        assert out.stdout == want, jobs
