"""The SkipBlock state machine and the adaptive checkpoint rule (csrc/skipblock.c)."""
import pytest

from flor import _core
from flor.runtime import charge
from flor.runtime.writes import Writing

pytestmark = pytest.mark.unit  # in-process: `make check` runs these

EPS = 1 / 15
C = 1.38


def machine(mode=_core.RECORD, eps=EPS, c=C):
    return _core.SkipMachine(mode, eps, c)


def test_states_by_mode_phase_and_probe():
    rec = machine()
    h = rec.block("train")
    assert rec.enter(h, True, True) == _core.EXECUTE  # record always executes
    rec.leave(h)

    rep = machine(_core.REPLAY)
    h = rep.block("train")
    cases = [
        # phase, probed, has_checkpoint -> state
        (_core.WORK, False, True, _core.SKIP),
        (_core.WORK, True, True, _core.STEP_INTO),
        (_core.WORK, False, False, _core.STEP_INTO),  # nothing to restore: run it
        (_core.PSEUDORESUME_PHASE, True, True, _core.PSEUDORESUME),
        (_core.PSEUDORESUME_PHASE, False, True, _core.PSEUDORESUME),
        (_core.PSEUDORESUME_PHASE, True, False, _core.STEP_INTO),
    ]
    for phase, probed, has, expected in cases:
        rep.phase = phase
        assert rep.enter(h, probed, has) == expected, (phase, probed, has)
        assert rep.leave(h)[0] == expected
    with pytest.raises(ValueError, match="only in replay"):
        rec.phase = _core.PSEUDORESUME_PHASE


def test_counters_and_nesting():
    m = machine(_core.REPLAY)
    outer, inner = m.block("outer"), m.block("inner")
    assert m.block("outer") == outer  # stable handles
    m.enter(outer, True, True)
    m.enter(inner, False, True)
    assert m.depth == 2
    with pytest.raises(RuntimeError, match="innermost open block 'inner'"):
        m.leave(outer)
    m.leave(inner)
    m.leave(outer)
    with pytest.raises(RuntimeError, match="without a matching"):
        m.leave(outer)
    m.restored(inner, 0.25)
    stats = {s["key"]: s for s in m.stats()}
    assert stats["outer"]["steps"] == 1 and stats["inner"]["skips"] == 1
    assert stats["inner"]["restores"] == 1 and stats["inner"]["restore_s"] == 0.25
    assert m.stats(inner) == stats["inner"] and m.stats(None) == m.stats()  # one block's
    with pytest.raises(IndexError, match="handle 2"):
        m.stats(2)


def test_rule_formula():
    ok, ratio, limit = _core.rule(0.5, 10.0, 3, 1, C, EPS)
    assert ratio == pytest.approx(0.05)
    assert limit == pytest.approx(3 / 2 * min(1 / (1 + C), EPS))
    assert ok
    assert _core.rule(0.5, 10.0, 1, 0, C, EPS)[0] is True  # 0.05 < 1/15
    assert _core.rule(1.0, 10.0, 1, 0, C, EPS)[0] is False  # 0.1 >= 1/15
    # With slow restores (large c), 1/(1+c) is the binding term.
    assert _core.rule(0.0, 1.0, 1, 0, 30.0, EPS)[2] == pytest.approx(1 / 31)


def simulate(M, C, iterations, eps=EPS, c=C):
    k, taken = 0, []
    for n in range(1, iterations + 1):
        ok, _, _ = _core.rule(M, C, n, k, c, eps)
        if ok:
            k += 1
            taken.append(n)
        # The two invariants the rule keeps after every decision:
        assert k * M <= n * eps * C + 1e-12  # record overhead at most epsilon
        if k:
            assert M + c * M < n / k * C  # replay from a checkpoint beats re-running
    return taken


def test_cheap_checkpoints_are_taken_every_iteration():
    assert simulate(M=0.01, C=10.0, iterations=20) == list(range(1, 21))


def test_expensive_checkpoints_are_taken_less_often_than_every_epoch():
    """A fine-tuning-like workload: materializing costs 15% of an epoch."""
    taken = simulate(M=0.3, C=2.0, iterations=30)
    assert 0 < len(taken) < 30
    assert 1 not in taken, "the first epoch cannot afford a checkpoint"
    gaps = [b - a for a, b in zip(taken, taken[1:])]
    assert min(gaps) >= 2


def test_decide_uses_the_rule_with_measured_time():
    m = machine()
    h = m.block("b")
    m.enter(h, False, False)
    _, elapsed = m.leave(h)
    decided = m.decide(h, 1_000_000, 1e-3, 0.25)
    ok, ratio, limit, M, _ = decided
    reason = charge.reason(m, 1_000_000, 0.25, decided)
    assert M == 1e-3
    # The overhead half, the paper's rule with the write left out of the floor.
    overhead = _core.rule(M, elapsed, 1, 0, 0.0, EPS)
    if not overhead[0]:
        assert (ok, ratio, limit) == overhead
        assert "M = 0.001 s for 1000000 B" in reason and "n/(k+1) * eps" in reason
    st = m.stats()[0]
    assert st["k"] == int(ok) and st["materialize_s"] == (0.25 if ok else 0.0)


def test_decide_keeps_replay_from_checkpoints_cheaper_than_running():
    """A checkpoint that costs training nothing but takes far longer to
    restore than the block takes to run is not taken: (M + c*W)/C < n/(k+1)."""
    m = machine()
    h = m.block("b")
    m.enter(h, False, False)
    m.leave(h)
    decided = m.decide(h, 1 << 30, 0.0, 1e6)
    ok, ratio, limit, _, (cheap, worth, _, n, k, *_) = decided
    assert not ok and cheap and not worth and limit == 1.0 and ratio > 1.0 and (n, k) == (1, 0)
    reason = charge.reason(m, 1 << 30, 1e6, decided)
    assert reason.startswith("no checkpoint:") and "(M + c*W)/C" in reason
    assert f"W = {1e6:.4g} s) >= n/(k+1) = 1/1 = 1" in reason
    decided = m.decide(h, 0, 0.0, 0.0)
    assert decided[0] and charge.reason(m, 0, 0.0, decided).startswith("checkpoint:")
    assert m.stats()[0]["k"] == 1


def test_decide_refuses_seconds_that_are_not_finite():
    m = machine()
    h = m.block("b")
    m.enter(h, False, False)
    m.leave(h)
    for M, W in ((float("nan"), 0.0), (0.0, float("inf")), (float("inf"), 1.0)):
        with pytest.raises(ValueError, match="finite seconds"):
            m.decide(h, 1, M, W)

    class Seconds:
        def __float__(self):
            return 1.0

    with pytest.raises(OverflowError):  # the first bad argument is the one reported
        m.decide(h, -1, Seconds(), 0.0)
    assert m.stats()[0]["k"] == 0


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError, match="epsilon"):
        machine(eps=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        machine(c=-1.0)
    with pytest.raises(ValueError, match="mode"):
        machine(mode=7)
    m = machine()
    h = m.block("b")
    with pytest.raises(RuntimeError, match="before the block ever executed"):
        m.decide(h, 1, 1.0, 1.0)
    m.enter(h, False, False)
    m.leave(h)
    with pytest.raises(ValueError, match="at least 0"):
        m.decide(h, 1, -1.0, 0.0)
    with pytest.raises(IndexError):
        m.enter(99, False, False)


def test_measure_counts_without_copying():
    import torch

    model = torch.nn.Linear(100, 10)
    before = _core.pool_stats()["takes"]
    assert _core.measure({"m": model, "t": torch.zeros(5)}) == (100 * 10 + 10 + 5) * 4
    assert _core.pool_stats()["takes"] == before


def test_skipmachine_reports_bad_arguments_given_by_keyword():
    with pytest.raises(ValueError, match=r"got epsilon=2, c=1\)"):
        _core.SkipMachine(_core.RECORD, epsilon=2.0, c=1.0)
    with pytest.raises(ValueError, match=r"got epsilon=0.5, c=-1\)"):
        _core.SkipMachine(_core.RECORD, 0.5, c=-1.0)


def test_the_charge_is_what_training_pays_per_checkpoint():
    """runtime/charge.py: before any checkpoint, a warm copy plus a share of
    the write; then the overhead measured so far and the marginal cost of
    one more (the cheapest blocking, and the mean slowdown of overlapped
    executions; the model until a warm checkpoint is measured), per
    checkpoint."""
    from flor.runtime import charge

    c = charge.Charges()
    c._share = 0.25
    assert c.cost("train", 1000, copy_bw=1000.0, write_s=2.0) == pytest.approx(1.0 + 0.5)
    for _ in range(2):  # two executions with no write going on: 1 s each
        c.started("train", Writing(None, None))
        c.ended("train", 1.0, Writing(None, None))
    c.charged("train", 1.9)  # the first copy faults its staging buffer in
    c.started("eval", Writing("train", None))
    c.ended("eval", 0.5, Writing("train", None))  # no clean measure of eval yet: no slowdown known
    c.started("train", Writing("train", None))
    c.ended("train", 1.3, Writing(None, None))  # overlapped: 0.3 s slower than clean
    # Spent: 1.9 + 0.3; the next one: the warm model (1.5, below the cold
    # 1.9) and the slowdown seen so far.
    assert c.cost("train", 1000, 1000.0, 2.0) == pytest.approx((1.9 + 0.3 + 1.5 + 0.3) / 2)
    c.charged("train", 0.1)  # a warm one measured: it replaces the model
    assert c.cost("train", 1000, 1000.0, 2.0) == pytest.approx(
        (1.9 + 0.1 + 0.3 + 0.1 + 0.15) / 3)
    c.paid("train", 0.5)  # its fingerprint, after the submit: the cheapest is now the cold one
    assert c.cost("train", 1000, 1000.0, 2.0) == pytest.approx(
        (1.9 + 0.6 + 0.3 + 0.6 + 0.15) / 3)
    c.charged("train", 0.4)
    assert c.cost("train", 1000, 1000.0, 2.0) == pytest.approx(
        (1.9 + 0.6 + 0.4 + 0.3 + 0.4 + 0.1) / 4)
    # A cold checkpoint cheaper than the model caps it.
    d = charge.Charges()
    d._share = 0.25
    d.charged("eval", 0.2)
    assert d.cost("eval", 1000, 1000.0, 2.0) == pytest.approx((0.2 + 0.2) / 2)


def test_bytes_in_cuda_tensors_are_predicted_as_a_copy_within_the_device():
    """Before a checkpoint is measured, its bytes in CUDA tensors cost a copy
    within the device and no share of the write; the host's, as before.
    measure() tells the two apart."""
    import torch

    from flor.runtime import charge

    assert _core.measure({"t": torch.zeros(5)}, True) == (20, 0)
    c = charge.Charges()
    c._share = 0.25
    n, copy_bw, write_s = 10**9, 1e9, 2.0
    assert c.cost("gpu", n, copy_bw, write_s, 1.0) == pytest.approx(n / charge.DEVICE_COPY_BPS)
    assert c.cost("host", n, copy_bw, write_s, 0.0) == pytest.approx(1.0 + 0.5)
    assert c.cost("half", n, copy_bw, write_s, 0.5) == pytest.approx(
        0.5 + n / 2 / charge.DEVICE_COPY_BPS + 0.25)


def test_a_block_is_charged_for_its_own_time_and_its_own_writes():
    """Nested blocks: the outer block's own time leaves out the inner
    executions and their checkpoints; a slowdown goes to the block whose
    write was going on, not to the one submitted last."""
    from flor.runtime import charge

    c = charge.Charges()
    c._share = 0.25
    c.started("outer", Writing(None, None))  # a clean outer execution of 1 s of its own
    c.ended("outer", 1.0, Writing(None, None))
    c.started("outer", Writing(None, None))
    c.started("inner", Writing(None, None))
    c.ended("inner", 0.2, Writing(None, None))
    c.charged("inner", 0.05)  # the inner checkpoint is being written...
    c.ended("outer", 1.25, Writing("inner", None))  # ...while outer ends: 1.25 - 0.25 = 1.0 of its own
    assert c._blocks["inner"].slowdown == 0.0  # the outer block was not slowed
    c.started("outer", Writing("big", None))  # a big block's write goes on; a small one is submitted
    c.charged("small", 0.01)
    c.ended("outer", 1.51, Writing("big", None))  # 0.5 s slower than clean
    assert c._blocks["big"].slowdown == pytest.approx(0.5)
    assert c._blocks.get("small").slowdown == 0.0
    # The same block nested in itself keeps each execution's own flag.
    c.started("rec", Writing("big", None))
    c.started("rec", Writing(None, None))
    c.ended("rec", 0.1, Writing(None, None))
    assert c._open[-1].writer == "big"
    c.ended("rec", 0.3, Writing(None, None))
    assert not c._open


def test_a_slowdown_is_at_most_the_cpu_the_writer_used_meanwhile():
    """An overlapped execution slower than the clean ones is charged no more
    than the writer's CPU time during it: a script whose steps drift slower,
    or a neighbour's load, is not the checkpoint's cost.  Nested executions
    share one writer's CPU: what the inner one was charged, the outer one
    is not charged again.  Where the writer's CPU is not known in time (fork
    mode), the whole slowdown is charged, as before."""
    c = charge.Charges()
    c._share = 0.25
    c.started("epoch", Writing(None, 0.0))  # a clean epoch of 1 s
    c.ended("epoch", 1.0, Writing(None, 0.0))
    c.charged("epoch", 0.05)
    # The next epoch drifts to 2.5 s while the writer used 0.08 s of CPU.
    c.started("epoch", Writing("epoch", 1.00))
    c.ended("epoch", 2.5, Writing(None, 1.08))
    assert c._blocks["epoch"].slowdown == pytest.approx(0.08)
    # A slowdown below the writer's CPU is charged as measured.
    c.started("epoch", Writing("epoch", 2.0))
    c.ended("epoch", 1.02, Writing(None, 2.5))
    assert c._blocks["epoch"].slowdown == pytest.approx(0.08 + 0.02)
    # Nested: inner is charged 0.1 of the writer's 0.15; outer gets the rest.
    d = charge.Charges()
    for key, s in (("outer", 1.0), ("inner", 0.5)):
        d.started(key, Writing(None, 0.0))
        d.ended(key, s, Writing(None, 0.0))
    d.started("outer", Writing("w", 5.0))
    d.started("inner", Writing("w", 5.0))
    d.ended("inner", 0.6, Writing("w", 5.1))
    d.ended("outer", 2.6, Writing("w", 5.15))  # 2.0 of its own: 1.0 slower
    assert d._blocks["w"].slowdown == pytest.approx(0.1 + 0.05)
    # Fork mode: the CPU is not known while the execution runs.
    e = charge.Charges()
    e.started("epoch", Writing(None, None))
    e.ended("epoch", 1.0, Writing(None, None))
    e.started("epoch", Writing("epoch", None))
    e.ended("epoch", 2.5, Writing(None, None))
    assert e._blocks["epoch"].slowdown == pytest.approx(1.5)


def test_writer_cpu_granted_to_nested_executions_is_not_granted_again():
    """Three levels, and a middle execution that an exception left open:
    the writer's CPU during the outermost execution is charged once in all."""
    c = charge.Charges()
    for key in ("outer", "middle", "inner"):
        c.started(key, Writing(None, 0.0))
        c.ended(key, 1.0, Writing(None, 0.0))
    for abandon in (False, True):
        before = sum(b.slowdown for b in c._blocks.values())
        c.started("outer", Writing("w", 10.0))
        c.started("middle", Writing("w", 10.0))
        c.started("inner", Writing("w", 10.0))
        c.ended("inner", 2.0, Writing("w", 10.1))  # 1 s slower; the writer used 0.1 s
        if not abandon:
            c.ended("middle", 4.0, Writing("w", 10.12))  # 1 s slower of its own: 0.02 left
        c.ended("outer", 6.0 if not abandon else 4.0, Writing("w", 10.15))  # 0.03 left
        assert sum(b.slowdown for b in c._blocks.values()) - before == pytest.approx(0.15)


def test_writing_gives_the_writers_cpu_only_where_it_is_counted_in_time(tmp_path):
    """Writes.writing(): the block being written and the writers' CPU, which
    a fork child reports only once reaped (too late to bound the executions
    it overlapped): None there, so that no bound applies."""
    import torch

    import flor
    from flor.runtime.writes import Writes

    for mode in ("thread", "fork"):
        w = Writes(store=None, run_id=None, adaptive=False)
        assert w.writing() == Writing(None, 0.0)  # no checkpoint yet: no writer
        w._mat = flor.Materializer(str(tmp_path / mode), mode=mode, batch_count=1)
        w._mat.submit("a", {"w": torch.zeros(1000)})
        w.submitted.append("block")
        got = w.writing()
        assert got.block in ("block", None)
        assert (got.cpu is None) == (mode == "fork"), (mode, got)
        w._mat.close()
        assert w.writing().block is None

def test_a_write_costs_a_fixed_time_per_file_plus_its_bytes():
    from flor.runtime.writes import Speeds

    cal = Speeds(latency_s=0.001, write_bps=100e6, copy_bps=1e9)  # files of 100 kB break even
    assert cal.write_seconds(0) == 0.001
    assert cal.write_seconds(200_000) == pytest.approx(0.003)
    assert cal.measured(1, 5.0, 100) == cal  # one write measures nothing yet
    # 4000 files of 300 B in 6 s (a data-preparation loop's checkpoints):
    # about 1.5 ms per file (less their bytes' 3 us), nothing said of the bandwidth.
    small = cal.measured(4000, 6.0, 4000 * 300)
    assert small.write_bps == 100e6 and small.latency_s == pytest.approx(0.001497)
    assert small.write_seconds(200_000) == pytest.approx(0.003497)
    # 10 files of 10 MB in 2.01 s: the bytes took 2 s (50 MB/s), the files 10 ms.
    large = cal.measured(10, 2.01, 10 * 10_000_000)
    assert large.latency_s == 0.001 and large.write_bps == pytest.approx(50e6)
    # Faster files than calibrated: no more than half the time is theirs.
    assert cal.measured(10, 0.01, 10 * 10_000_000).write_bps == pytest.approx(2e10)


def test_a_run_of_small_checkpoints_does_not_make_the_disk_look_slow(tmp_path):
    """Writes.speeds(): a run's own writes of checkpoints with no bytes
    measure the time per file; the bandwidth stays the calibrated one."""
    import flor
    from flor.runtime.writes import FALLBACK_WRITE_BPS, Writes

    w = Writes(store=None, run_id=None, adaptive=False)  # not calibrated: the fallback
    assert w.speeds().write_bps == FALLBACK_WRITE_BPS
    w._mat = flor.Materializer(str(tmp_path), mode="thread", batch_count=1)
    for i in range(10):
        w._mat.submit(f"step{i}", {"step": i})
    w._mat.close()
    assert w._mat.stats()["written"] == 10
    got = w.speeds()
    assert got.write_bps == FALLBACK_WRITE_BPS and got.latency_s > 0


def test_an_outer_block_is_charged_the_checkpoints_nested_in_it():
    """The overhead bound holds for a block as a whole: its mean compute
    time holds its nested blocks', so what their checkpoints blocked is
    part of its overhead too (a main loop's iteration and its training
    block that checkpoint the same state do not each spend epsilon of the
    training block's time)."""
    c = charge.Charges()
    c._share = 0.25
    idle = Writing(None, 0.0)
    for _ in range(2):
        c.started("iteration", idle)
        c.started("train", idle)
        c.ended("train", 1.0, idle)
        c.charged("train", 0.13)  # the training block's checkpoint
        c.paid("train", 0.01)  # and its fingerprint
        c.ended("iteration", 2.5, idle)
    c.charged("iteration", 0.13)
    # Spent: its own 0.13 and the nested 2 x 0.14; the next: 0.13 again.
    assert c.cost("iteration", 1000, 1000.0, 2.0) == pytest.approx((0.13 + 0.28 + 0.13) / 2)
    # The inner block's charge is its own, as before.
    assert c.cost("train", 1000, 1000.0, 2.0) == pytest.approx((0.14 + 0.14 + 0.14) / 3)
    # A block nested in itself counts a nested checkpoint once.
    d = charge.Charges()
    d.started("rec", idle)
    d.started("rec", idle)
    d.charged("leaf", 0.5)
    assert d._blocks["rec"].nested == pytest.approx(0.5)
    # Its own checkpoint, with an execution of it still open around it, is
    # its own blocking, not nested in itself.
    d.charged("rec", 0.2)
    assert d._blocks["rec"].nested == pytest.approx(0.5)
    # An iteration that a break left is no longer open: later checkpoints
    # are not nested in it, and the frames above it close with it.
    e = charge.Charges()
    e.started("iteration", idle)
    e.started("train", idle)
    e.ended("train", 1.0, idle)
    e.charged("train", 0.1)
    e.started("eval", idle)  # an exception leaves eval open too
    e.abandoned("iteration")
    assert not e._open
    e.charged("other", 0.5)
    assert e._blocks["iteration"].nested == pytest.approx(0.1)
    e.abandoned("never-open")  # nothing to close

def test_overruled_moves_the_accounting_to_the_group_decision():
    m = _core.SkipMachine(_core.RECORD, EPS, C, False)  # decide() says yes
    h = m.block("train")
    m.enter(h, False, False)
    m.leave(h)
    ok = m.decide(h, 1000, 0.0, 0.25)[0]
    assert ok and m.stats()[h]["k"] == 1
    m.overruled(h, False, 0.25, 1000)  # another rank decided not to
    st = m.stats()[h]
    assert st["k"] == 0 and st["materialize_s"] == 0.0
    m.overruled(h, True, 0.5, 2000)  # and later, that it does
    st = m.stats()[h]
    assert (st["k"], st["materialize_s"], st["nbytes"]) == (1, 0.5, 2000)
    m.overruled(h, False, 0.5, 2000)
    with pytest.raises(RuntimeError, match="without a checkpoint"):
        m.overruled(h, False, 0.5, 2000)
    with pytest.raises(ValueError):
        m.overruled(h, True, float("nan"), 1)
    with pytest.raises(IndexError):
        m.overruled(7, True, 0.1, 1)


@pytest.mark.parametrize("mode", [_core.RECORD, _core.REPLAY])
def test_the_skip_table_has_one_home(mode):
    """enter() restores a checkpoint (SKIP, PSEUDORESUME) exactly where
    wants() tells the caller to load one: a replay's unprobed block, or any
    block while pseudoresuming; a record runs every block."""
    m = _core.SkipMachine(mode, EPS, C)
    h = m.block("b")
    phases = [_core.WORK] + ([_core.PSEUDORESUME_PHASE] if mode == _core.REPLAY else [])
    for phase in phases:
        m.phase = phase
        for probed in (False, True):
            want = m.wants(probed)
            assert want == (mode == _core.REPLAY and (phase == _core.PSEUDORESUME_PHASE
                                                      or not probed))
            for has in (False, True):
                state = m.enter(h, probed, has)
                m.leave(h)
                restores = state in (_core.SKIP, _core.PSEUDORESUME)
                assert restores == (has and want), (phase, probed, has, state)
                assert state != _core.PSEUDORESUME or phase == _core.PSEUDORESUME_PHASE
                if not restores:
                    assert state == (_core.EXECUTE if mode == _core.RECORD else _core.STEP_INTO)


def test_a_state_is_read_to_measure_it_at_most_once_per_interval():
    """Between reads the rule uses the bytes it last knew (of the last
    checkpoint, or as last measured); a state that shrank or grew is
    measured again once the interval has passed."""
    reads = []

    def measure(objs):
        reads.append(objs)
        return len(objs), 0

    seldom, often = charge.StateReads(every=3600), charge.StateReads(every=0)
    for states in (seldom, often):
        assert states.size("b", lambda: "x" * 100, measure) == (100, True)
        assert states.size("b", lambda: "x" * 3, measure)[0] == (100 if states is seldom else 3)
    assert len(reads) == 3
    seldom.written("b", 7)  # a checkpoint says what it wrote
    assert seldom.size("b", lambda: "x" * 3, measure) == (7, False)
    # a rank that stands in for another measures every time, and keeps nothing
    assert seldom.size("c", lambda: "yy", measure, keep=False) == (2, True)
    assert seldom.size("c", lambda: "y", measure, keep=False) == (1, True)
    asked = []
    assert seldom.unheld_of("b", lambda: asked.append(1) or ["lock"], False, False) == ["lock"]
    assert seldom.unheld_of("b", lambda: asked.append(1) or [], False, False) == ["lock"]
    # A checkpoint the rule wants of a state known to be held by none: not read again.
    assert seldom.unheld_of("b", lambda: asked.append(1) or [], False, True) == ["lock"]
    assert seldom.unheld_of("b", lambda: asked.append(1) or [], True, False) == []
    assert len(asked) == 2
    # Known to be all held: read again before the checkpoint the rule wants.
    assert seldom.unheld_of("b", lambda: asked.append(1) or ["it"], False, True) == ["it"]
    assert len(asked) == 3


def test_flors_other_time_shares_the_bound_with_the_checkpoints():
    """decide(..., spent): (k+1) * M + B < n * epsilon * C, with B flor's
    own seconds at the n executions (a step loop's bookkeeping); ran()
    counts an execution timed without enter() and leave()."""
    m = machine()
    h = m.block("loop (iteration)")
    for _ in range(10):
        m.ran(h, 0.01)  # n * epsilon * C = 10 * 0.01 / 15 = 0.00667
    st = m.stats(h)
    assert st["n"] == 10 and st["compute_s"] == pytest.approx(0.1) and st["k"] == 0
    assert m.decide(h, 1, 0.003, 0.0)[0]  # 0.003 < 0.00667
    assert not m.decide(h, 1, 0.0034, 0.0, 0.0)[0]  # k = 1: 0.0068 >= 0.00667
    m2 = machine()
    h2 = m2.block("loop (iteration)")
    for _ in range(10):
        m2.ran(h2, 0.01)
    decided = m2.decide(h2, 1, 0.003, 0.0, 0.004)  # 0.003 + 0.004 >= 0.00667
    ok, ratio, limit, M, (cheap, worth, C, n, k, oratio, *_) = decided
    assert not ok and not cheap and M == 0.003 and oratio == pytest.approx(0.7) and n == 10
    reason = charge.reason(m2, 1, 0.0, decided, 0.004)
    assert reason.startswith("no checkpoint: (M + B/(k+1))/C = 0.7 (M = 0.003 s for 1 B, B = "
                             "0.004 s of flor's own at 10 iterations, C = 0.01 s) >= n/(k+1)")
    assert m2.decide(h2, 1, 0.003, 0.0, 0.003)[0]  # 0.006 < 0.00667
    with pytest.raises(ValueError, match="finite seconds"):
        m2.decide(h2, 1, 0.0, 0.0, float("inf"))
    with pytest.raises(ValueError, match="finite"):
        m2.ran(h2, -1.0)
    rep = machine(_core.REPLAY)
    with pytest.raises(RuntimeError, match="record mode"):
        rep.ran(rep.block("b"), 1.0)
    with pytest.raises(ValueError, match="restored: seconds must be finite"):
        rep.restored(rep.block("b"), float("nan"))  # (the same arguments, checked alike)

    class Bad:
        def __float__(self):
            raise KeyError("seconds")

    with pytest.raises(TypeError):  # the first bad argument is the one reported
        m2.ran("handle", Bad())
    with pytest.raises(KeyError):
        m2.ran(h2, Bad())
    assert m2.stats(h2)["n"] == 10


def _asks(M, C, iterations, spent_per=0.0, every=False, ask_s=0.0):
    """The iterations at which the rule is asked and what it said, asking
    where Waits says to (or at every one); an ask costs `ask_s`."""
    m, w = machine(), charge.Waits()
    h = m.block("loop (iteration)")
    out = []
    for n in range(1, iterations + 1):
        m.ran(h, C)
        if not every and w.waiting("loop (iteration)"):
            continue
        decided = m.decide(h, 1, M, 0.0, spent_per * n)
        out.append((n, decided[0]))
        w.asked("loop (iteration)", decided, EPS, spent_per * n, ask_s)
    return out


def test_the_rule_is_not_asked_where_it_cannot_say_yes():
    """runtime/charge.py Waits: asking where the numbers say the rule can
    say yes takes the same checkpoints as asking at every iteration, with
    a few asks per checkpoint."""
    for M, C, spent in ((0.01, 0.001, 0.0), (0.002, 0.0005, 0.00001), (0.02, 0.001, 0.00003)):
        every = _asks(M, C, 5000, spent, every=True)
        waited = _asks(M, C, 5000, spent)
        assert [n for n, ok in waited if ok] == [n for n, ok in every if ok]
        assert sum(ok for _, ok in every) >= 5
        assert len(waited) <= 12 * sum(ok for _, ok in every), len(waited)
    # Where flor's bookkeeping alone is all the bound allows, never, asked
    # about once each time the loop's length grows by three quarters.
    waited = _asks(0.001, 0.001, 20000, spent_per=0.001 / 14)
    assert not any(ok for _, ok in waited) and len(waited) <= 25, waited
    # An ask that costs flor time comes at most every so many iterations
    # that asks take a tenth of what the bound allows (here 15).
    waited = _asks(0.002, 0.0005, 5000, 0.00001, ask_s=5e-5)
    assert min(b - a for (a, _), (b, _) in zip(waited[4:], waited[5:])) >= 15
    assert sum(ok for _, ok in waited) >= 0.8 * sum(ok for _, ok in _asks(
        0.002, 0.0005, 5000, 0.00001, every=True))
