"""A record keeps a bounded number of iteration checkpoints of each loop,
spread over it (flor/runtime/thinning.py): the files it removes are gone,
their decisions say so, and replay and resume start only from files kept."""
import copy
import math
import os
import random

import pytest

from conftest import flor, plain, runs, store, write_script
from flor.runtime.thinning import Thinning

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

STEP_LOOP = """
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
X = torch.randn(64, 8)
Y = X.sum(1, keepdim=True)
step = 0
while step < 30:
    i = (step * 8) % 64
    loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
print("final", round(loss.item(), 6))
"""


def _kept(points, limit):
    t = Thinning(limit)
    for n, i in enumerate(points):
        t.written("loop", 0, i, f"ck{i}", n)
    return [i for i, _, _ in t._kept[("loop", 0)]]


@pytest.mark.unit
@pytest.mark.parametrize("limit", [2, 5, 16, 64])
@pytest.mark.parametrize("shape", ["every", "random", "sparser later"])
def test_the_kept_checkpoints_stay_spread_over_the_loop(limit, shape):
    points = {"every": list(range(1000)),
              "random": sorted(random.Random(limit).sample(range(5000), 900)),
              "sparser later": [i * i for i in range(300)]}[shape]
    for end in (limit + 1, len(points) // 3, len(points)):  # at any moment
        kept = _kept(points[:end], limit)
        assert len(kept) == limit and kept == sorted(kept)
        assert kept[-1] == points[end - 1]  # the newest stays: record --resume starts there
        gaps = [b - a for a, b in zip([-1] + kept, kept)]
        had = max(b - a for a, b in zip([-1] + points[:end], points[:end]))
        assert max(gaps) <= max(2 * (points[end - 1] + 1) / limit, had), (end, kept)


@pytest.mark.unit
@pytest.mark.parametrize("limit", [2, 3, 8])
def test_a_checkpoint_from_due_on_buys_a_start_point(limit):
    """Thinning.due(): the record does not ask the rule below it; a
    checkpoint from it on never takes the newest kept one's place."""
    rng = random.Random(limit)
    t, at = Thinning(limit), 0
    for n in range(200):
        at += rng.randint(1, 30)
        t.written("loop", 0, at, f"ck{at}", n)
        kept = [i for i, _, _ in t._kept[("loop", 0)]]
        due = t.due("loop", 0)
        if len(kept) < limit:
            assert due == 0
            continue
        assert due > at
        for x in range(at + 1, at + 80):
            trial = copy.deepcopy(t)
            trial.written("loop", 0, x, f"ck{x}", n + 1)
            if at not in [i for i, _, _ in trial._kept[("loop", 0)]]:  # displaced
                assert x < due, (kept, x, due)


@pytest.mark.unit
@pytest.mark.parametrize("limit", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("every", [1, 7, 70])
@pytest.mark.parametrize("grid", [False, True])
def test_a_loop_checkpointed_whenever_due_writes_fewer_as_it_runs(limit, every, grid):
    """A rule that can checkpoint `every` iterations after its last one (or,
    `grid`, only at multiples of `every`), asked only where one is due:
    each one due is about 1 + 2 / limit times as far into the loop as the
    one before, so the record writes about limit + ln(n / n0) / ln(1 + 2 /
    limit) checkpoints in n iterations (n0: where the loop reached its
    limit), not n / every; and at every moment the largest gap (the
    iterations since the newest kept one included) is at most twice an
    even spread's, in whole iterations, plus what the rule waits once one
    is due (every - 1)."""
    t, last, written, n = Thinning(limit), None, 0, 100_000
    reached = None
    for i in range(n):
        can = i % every == 0 if grid else last is None or i - last >= every
        if can and i >= t.due("loop", 0):
            t.written("loop", 0, i, f"ck{i}", written)
            written, last = written + 1, i
        kept = [p for p, _, _ in t._kept[("loop", 0)]]
        if len(kept) < limit:
            continue
        reached = reached or i
        gaps = [b - a for a, b in zip([-1] + kept, kept + [i])]
        assert max(gaps) <= math.ceil(2 * (i + 1) / limit) + every - 1, (i, kept)
    assert written <= limit + math.log(n / reached) / math.log(1 + 2 / limit) + 1, \
        (written, reached)
    assert written < n / every / 2


class _Mat:
    """What Thinning.collect uses of a Materializer: a directory of real files."""

    def __init__(self, d, referred=()):
        self.d, self.referred, self.asked = d, set(referred), []

    def path_for(self, name):
        return os.path.join(self.d, name + ".flor")

    def remove(self, name):
        self.asked.append(name)
        if name in self.referred:
            return False
        os.unlink(self.path_for(name))
        return True


@pytest.mark.unit
def test_a_file_goes_once_it_and_a_newer_one_are_written(tmp_path):
    """A kill at any moment finds the newest finished checkpoint on disk."""
    t = Thinning(1)
    mat = _Mat(str(tmp_path), referred={"ck1"})
    for n in range(3):
        open(mat.path_for(f"ck{n}"), "w").close()
        t.written("loop", 0, n, f"ck{n}", n)
    t.collect(mat, done=1)  # ck0 is written, ck1 (which displaced it) is not yet
    assert mat.asked == [] and t.pending()
    t.collect(mat, done=2)
    assert mat.asked == ["ck0"] and t.take_removed() == ["ck0"]
    t.collect(mat, done=3)
    assert mat.asked == ["ck0", "ck1"] and t.take_removed() == []  # referred to: it stays
    assert os.path.exists(mat.path_for("ck1")) and os.path.exists(mat.path_for("ck2"))
    assert not t.pending()


@pytest.mark.unit
def test_a_file_whose_newer_checkpoint_failed_to_write_stays(tmp_path):
    t = Thinning(2)
    mat = _Mat(str(tmp_path))
    for n in range(6):
        if n < 3:  # the later writes fail (a full disk): their files never appear
            open(mat.path_for(f"ck{n}"), "w").close()
        t.written("loop", 0, n, f"ck{n}", n)
    t.collect(mat, done=6)
    t.collect(mat, done=6, final=True)
    # ck0 went once ck2 was written; ck2, displaced by ck3 (failed), stays.
    assert sorted(os.listdir(tmp_path)) == ["ck1.flor", "ck2.flor"]
    assert t.take_removed() == ["ck0"]


@pytest.mark.unit
def test_a_resumed_record_spreads_its_own_from_where_it_resumed():
    t = Thinning(3)
    t.resumed_at("loop", 0, 44)
    for n, i in enumerate(range(45, 80)):
        t.written("loop", 0, i, f"ck{i}", n)
    kept = [i for i, _, _ in t._kept[("loop", 0)]]
    assert kept[-1] == 79 and kept[0] >= 50, kept  # not next to the restored iteration


def _iteration_rows(st, run_id):
    return [r for r in st.rows("decisions", run_id, "ORDER BY rowid")
            if r["block"].endswith(" (iteration)")]


def test_a_record_keeps_the_bound_and_replays_exactly_from_what_it_kept(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", STEP_LOOP)
    rec = flor(d, "record", "--no-adaptive", "--iteration-checkpoints", "4", "train.py")
    st = store(d)
    (run,) = runs(st, "record")
    rows = _iteration_rows(st, run["run_id"])
    kept = [r for r in rows if r["checkpoint"]]
    removed = [r for r in rows if "removed later" in r["reason"]]
    # --no-adaptive checkpoints every iteration; all but the kept ones were removed.
    assert len(kept) + len(removed) == len(rows) >= 30
    assert 4 <= len(kept) <= 5, [r["top_iter"] for r in kept]  # the first may be referred to
    assert kept[-1]["top_iter"] == max(r["top_iter"] for r in rows)
    assert all(r["file"] is None for r in removed)
    ckpt = st.layout.ckpt_dir(run["run_id"])
    assert sorted(os.listdir(ckpt)) == sorted(r["file"] for r in kept)
    assert f"{len(kept)} iteration checkpoints" in rec.stderr

    with open(os.path.join(d, "train.py")) as f:
        src = f.read()
    with open(os.path.join(d, "train.py"), "w") as f:
        f.write(src.replace("    step += 1\n", "    print('loss', step, round(loss.item(), 6))\n"
                            "    step += 1\n"))
    expected = plain(d, "train.py").stdout
    starts = {r["top_iter"] + 1 for r in kept} - {30}
    gone = min({r["top_iter"] + 1 for r in removed} - starts)
    for at in (str(gone), ",".join(str(s) for s in sorted(starts)[:2])):
        rep = flor(d, "replay", "--jobs", "2", "--check", "strict", "train.py",
                   env={"FLOR_SEGMENTS": at})
        assert rep.stdout == expected, (at, rep.stderr)
        assert "deferred checks passed" in rep.stderr, rep.stderr
        assert "cannot be used" not in rep.stderr and "ran again" not in rep.stderr


def test_the_bound_must_be_a_whole_number(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", STEP_LOOP)
    bad = flor(d, "record", "--iteration-checkpoints", "0", "train.py", check=False)
    assert bad.returncode == 2 and "at least 1" in bad.stderr
    bad = flor(d, "record", "train.py", env={"FLOR_ITERATION_CHECKPOINTS": "many"}, check=False)
    assert bad.returncode == 2 and "FLOR_ITERATION_CHECKPOINTS" in bad.stderr


def test_a_step_loop_asks_the_rule_at_few_of_its_iterations(tmp_path):
    """A record does not ask the adaptive rule where it cannot say yes
    (runtime/charge.py Waits): with an epsilon so small that it never can,
    a loop of 2000 steps makes a few dozen decisions, each counting every
    iteration before it; the replay of a probe in the loop is exact."""
    d = str(tmp_path)
    write_script(d, "train.py", STEP_LOOP.replace("while step < 30:", "while step < 2000:"))
    rec = flor(d, "record", "--epsilon", "1e-7", "train.py")
    assert "flor: the main loop train.py:9 was never checkpointed, so replay workers reach " \
           "their segments by running the iterations before them" in rec.stderr, rec.stderr
    st = store(d)
    (run,) = runs(st, "record")
    rows = _iteration_rows(st, run["run_id"])
    assert 5 <= len(rows) <= 40 and not any(r["checkpoint"] for r in rows), len(rows)
    assert all(r["n"] == r["top_iter"] + 1 for r in rows)
    assert all("of flor's own at" in r["reason"] for r in rows[1:])
    with open(os.path.join(d, "train.py")) as f:
        src = f.read()
    with open(os.path.join(d, "train.py"), "w") as f:
        f.write(src.replace("    step += 1\n", "    if step % 250 == 0:\n"
                            "        print('loss', step, round(loss.item(), 6))\n"
                            "    step += 1\n"))
    rep = flor(d, "replay", "train.py")
    assert rep.stdout == plain(d, "train.py").stdout, rep.stderr
