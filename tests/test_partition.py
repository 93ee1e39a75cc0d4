"""Splitting the main loop among replay workers, and the Plan that says how."""
import dataclasses
import json

import pytest

from flor.program.source import FileMap
from flor.replay.plan import Plan
from flor.replay.segments import partition

from conftest import read

pytestmark = pytest.mark.unit  # in-process: `make check` runs these

ALL = set(range(100))


def test_equal_segments_without_costs():
    assert partition(4, 2, ALL) == [[0, 2], [2, 4]]
    assert partition(10, 3, ALL) == [[0, 4], [4, 7], [7, 10]] or \
        max(e - s for s, e in partition(10, 3, ALL)) == 4
    assert partition(5, 1, ALL) == [[0, 5]]
    assert partition(0, 4, ALL) == [[0, 0]]
    assert partition(3, 8, ALL) == [[0, 1], [1, 2], [2, 3]]


def test_segments_start_just_after_resumable_iterations():
    # Only iterations 2 and 6 were fully checkpointed: segments start at 3 or 7.
    segs = partition(10, 3, {2, 6})
    assert segs == [[0, 3], [3, 7], [7, 10]]
    assert partition(10, 4, set()) == [[0, 10]]  # no checkpoint: one worker


def test_pseudoresume_cost_moves_work_to_earlier_workers():
    """The second worker pays for pseudoresuming the first segment."""
    work, pseudo = [1.0] * 20, [0.5] * 20
    segs = partition(20, 2, ALL, work, pseudo)
    (s0, e0), (s1, e1) = segs
    assert e0 > 10  # the first worker takes more iterations
    busiest = max(sum(work[s0:e0]), sum(pseudo[:s1]) + sum(work[s1:e1]))
    for b in range(1, 20):
        assert busiest <= max(sum(work[:b]), sum(pseudo[:b]) + sum(work[b:])) + 1e-9


def test_segments_cover_every_iteration_once():
    import random

    rng = random.Random(3)
    for _ in range(50):
        total = rng.randrange(1, 40)
        jobs = rng.randrange(1, 6)
        res = {i for i in range(total) if rng.random() < 0.6}
        work = [rng.uniform(0.1, 2) for _ in range(total)]
        pseudo = [rng.uniform(0, 0.5) for _ in range(total)]
        segs = partition(total, jobs, res, work, pseudo)
        assert segs[0][0] == 0 and segs[-1][1] == total and len(segs) <= jobs
        for (s, e), (s2, _) in zip(segs, segs[1:]):
            assert s < e == s2 and s2 - 1 in res


def test_iteration_checkpoints_let_late_segments_start_without_the_prefix():
    """Where pseudoresuming an iteration costs as much as replaying it, a
    second worker cannot finish sooner, and there is one segment; restoring
    an iteration checkpoint costs almost nothing, and the split is even.
    An iteration checkpoint is a start even where the blocks were not all
    checkpointed."""
    work, pseudo = [1.0] * 10, [1.0] * 10
    assert partition(10, 2, set(range(10)), work, pseudo) == [[0, 10]]
    assert partition(10, 2, set(), work, pseudo, restart={5: 0.01}) == [[0, 5], [5, 10]]
    four = partition(10, 4, set(), work, pseudo, restart={s: 0.01 for s in range(1, 10)})
    assert len(four) == 4 and max(e - s for s, e in four) == 3
    assert [s for s, _ in four[1:]] == [e for _, e in four[:-1]] and four[-1][1] == 10


def test_a_plan_is_typed_in_memory_and_json_only_on_disk(tmp_path):
    """A Plan built with fixed segments saves to plan.json's JSON form (string
    keys, lists) and loads back equal, with int keys and tuples again."""
    plan = Plan(store=str(tmp_path), script="/x/train.py", argv=("train.py", "--epochs", "3"),
                record="r1", replay_id="r2", segments=((0, 2), (2, 5)),
                probed=frozenset({"train.py:9"}), changed_end=frozenset(),
                files={"train.py": FileMap({10: 9, 11: None}, {10: 9}, {1, 2, 9})},
                checkpoints={("train.py:9", "[[\"L\",\"e\",0,0]]", 0): "a.flor",
                             ("train.py:9", "[[\"L\",\"e\",0,1]]", 0): None},
                ckpt_dir="/c", main_loop="e", main_run=0, iterations=5, epsilon=0.1,
                c=1.38, hands_free=None, resume={1: "it1.flor"}, ended=True)
    path = str(tmp_path / "plan.json")
    plan.save(path)
    data = json.loads(read(path))
    assert data["segments"] == [[0, 2], [2, 5]] and data["resume"] == {"1": "it1.flor"}
    assert data["files"]["train.py"] == {"lines": {"10": 9, "11": None}, "sites": {"10": 9},
                                         "present": [1, 2, 9]}
    assert data["checkpoints"][1] == ["train.py:9", "[[\"L\",\"e\",0,1]]", 0, None]
    assert "threads" not in data  # optional fields left out when unset
    assert Plan.load(path) == plan


def test_a_hands_free_plan_carries_its_compiled_instrumented_code(tmp_path, monkeypatch):
    """The process that plans a hands-free replay compiles the instrumented
    script once and saves the code beside plan.json: a worker loads it and
    runs it (line numbers kept) instead of instrumenting the script again;
    a worker of another Python (another bytecode magic) compiles it anew."""
    import importlib.util

    script = tmp_path / "train.py"
    script.write_text("x = 0\nfor e in range(2):\n    for i in range(3):\n"
                      "        x += i\n    print(e, x)\n")
    code = compile("raise ValueError('from the planner')", str(script), "exec")
    plan = Plan(store=str(tmp_path), script=str(script), argv=("train.py",), record="r1",
                replay_id="r2", segments=((0, 2),), probed=frozenset(),
                changed_end=frozenset(), files={}, checkpoints={}, ckpt_dir="/c",
                main_loop="train.py:2", main_run=0, iterations=2, epsilon=0.1, c=1.38,
                hands_free={"hindsight": [], "other": [], "blocks": []},
                changed_functions=frozenset({"step"}), instrumented=code)
    path = str(tmp_path / "run" / "plan.json")
    plan.save(path)
    assert json.loads(read(path))["changed_functions"] == ["step"]
    loaded = Plan.load(path)
    assert loaded == plan and loaded.code().co_consts == code.co_consts
    with monkeypatch.context() as m:  # a worker of another Python
        m.setattr(importlib.util, "MAGIC_NUMBER", b"\0\0\r\n")
        again = Plan.load(path).code()  # compiled here from the script itself
    assert again.co_filename == str(script) and "from the planner" not in again.co_consts
    manual = dataclasses.replace(plan, hands_free=None, instrumented=None)
    manual.save(str(tmp_path / "m" / "plan.json"))
    assert Plan.load(str(tmp_path / "m" / "plan.json")).code() is None  # runs the script


def test_a_step_loop_without_blocks_splits_at_an_iteration_checkpoint_in_the_middle():
    """Every iteration of a loop without blocks is resumable, but getting past
    one costs as much as replaying it: a later start is cheaper only at an
    iteration checkpoint.  The split may not take the furthest start the
    first worker can reach (it left the second worker 1 iteration of 3000)."""
    total = 3000
    work = pseudo = [1.0] * total
    restart = {s: 5.0 for s in range(974, total, 20)}
    segs = partition(total, 2, set(range(total)), work, pseudo, restart)
    times = [sum(work[s:e]) + (restart[s] if s else 0) for s, e in segs]
    assert len(segs) == 2 and max(times) <= 1.02 * total / 2, segs
    four = partition(total, 4, set(range(total)), work, pseudo, restart)
    times = [sum(work[s:e]) + (restart[s] if s else 0) for s, e in four]
    # the first segment cannot end before the first checkpoint; the rest share
    assert four[0] == [0, 974] and min(times[1:]) >= 0.95 * max(times[1:]), four


def test_the_least_busy_worker_is_as_busy_as_the_busiest_allows():
    import random

    rng = random.Random(5)
    for _ in range(30):
        total = rng.randrange(20, 200)
        jobs = rng.randrange(2, 5)
        work = [rng.uniform(0.5, 1.5) for _ in range(total)]
        segs = partition(total, jobs, set(range(total)), work, [0.0] * total)
        times = [sum(work[s:e]) for s, e in segs]
        assert len(segs) == jobs and min(times) >= max(times) - 3.0, (segs, times)


def _record(started=100.0, finished=130.0, flor_s=2.0, startup_s=4.0):
    from flor.runinfo import RecordInfo

    return {"started": started, "finished": finished,
            "info": RecordInfo(flor_seconds=flor_s, startup_s=startup_s)}


def test_re_running_costs_the_record_less_flor_s_own_work():
    from flor.replay.estimate import closing_line, rerun_seconds

    rec = _record()
    assert rerun_seconds(rec) == 28.0
    assert rerun_seconds(_record(finished=None)) is None
    assert rerun_seconds(_record(finished=101.0)) is None  # flor's own time is all of it
    resumed = _record()
    resumed["info"].resumed = [3]  # its time holds the pause before the resume
    assert rerun_seconds(resumed) is None and closing_line("R", 7.0, resumed) is None
    line = closing_line("R", 7.0, rec)
    assert "re-running the script would take about 28.0 s" in line and line.endswith("4.0x")


def test_the_expected_replay_counts_each_workers_start_and_the_queue():
    """A 30 s record: 4 s to the main loop, 20 s in it, 4 s after it (and 2 s
    of flor's).  Every segment's worker pays the start; the last one what
    comes after the loop; segments go to free workers in order."""
    from flor.replay.estimate import planning_notes, replay_seconds
    from flor.replay.segments import Costs

    rec, costs = _record(), Costs(10, [2.0] * 10, [2.0] * 10, {5: 0.5})
    assert replay_seconds(rec, 20.0, [[0, 10]], costs, 1) == 4 + 20 + 4
    assert replay_seconds(rec, 20.0, [[0, 5], [5, 10]], costs, 2) == 4 + 0.5 + 10 + 4
    assert replay_seconds(rec, 20.0, [[0, 5], [5, 10]], costs, 1) == 4 + 10 + 4 + 0.5 + 10 + 4
    # Re-running takes 28 s: a probe that runs every block is not faster ...
    (note,) = planning_notes(rec, 20.0, [[0, 10]], [[0, 10]], costs, 1)
    assert "expected to take about 28.0 s, and re-running the script about 28.0 s" in note
    # ... and a second worker saves nothing where getting to its start costs
    # as much as the segment before it.
    dear = Costs(10, [2.0] * 10, [2.0] * 10, {5: 10.0})
    notes = planning_notes(rec, 20.0, [[0, 5], [5, 10]], [[0, 10]], dear, 2)
    assert any(n.startswith("2 workers are not expected to finish sooner") for n in notes)
    cheap = Costs(10, [0.2] * 10, [0.2] * 10, {5: 0.1})
    assert planning_notes(rec, 20.0, [[0, 5], [5, 10]], [[0, 10]], cheap, 2) == []


def test_a_local_replay_starts_only_the_workers_that_pay():
    """The same 30 s record: a second worker is started only when it is
    expected to save more than GAIN of the replay's time."""
    from flor.replay.estimate import ALL_JOBS_ENV, planning_notes, workers_that_pay
    from flor.replay.segments import Costs

    rec, one, two = _record(), [[0, 10]], [[0, 5], [5, 10]]
    # 28 s on one worker, 18.5 s on two: both start.
    restored = Costs(10, [2.0] * 10, [2.0] * 10, {5: 0.5})
    assert workers_that_pay(rec, 20.0, {1: one, 2: two}, restored) == (2, None)
    # Getting to the second segment costs as much as the first: 28 s either way.
    dear = Costs(10, [2.0] * 10, [2.0] * 10, {5: 10.0})
    chosen, why = workers_that_pay(rec, 20.0, {1: one, 2: two}, dear)
    assert chosen == 1 and why.startswith("replaying on 1 worker of the 2 --jobs allows: "
                                          "about 28.0 s expected, against 28.0 s on 2")
    assert f"{ALL_JOBS_ENV}=1 starts all 2" in why
    # 10 s against 9.1 s: the second worker's start eats most of its share.
    short = Costs(10, [0.2] * 10, [0.2] * 10, {5: 0.1})
    assert workers_that_pay(rec, 2.0, {1: one, 2: two}, short)[0] == 1
    # A 6 s main loop before 18 s of work after it: 28, 25 and 23.8 s on
    # 1, 2 and 3 workers; the third saves less than GAIN.
    three = [[0, 4], [4, 7], [7, 10]]
    flat = Costs(10, [0.6] * 10, [0.0] * 10)
    assert workers_that_pay(rec, 6.0, {1: one, 2: two, 3: three}, flat)[0] == 2
    # The planner chose: planning_notes does not compare with one worker again.
    notes = planning_notes(rec, 20.0, two, None, dear, 2)
    assert notes and not any("not expected to finish sooner" in n for n in notes)
    # No estimate (the record did not finish): every worker asked for.
    assert workers_that_pay(_record(finished=None), 20.0, {1: one, 2: two}, dear) == (2, None)
