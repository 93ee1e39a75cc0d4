"""Replay treats the run store as data it verifies: a record's arguments,
main loop and stored sources are sealed under the user's key, and so is a
replay's plan with the compiled script beside it.  A change to any of them
after the fact is refused, naming the run (or the plan)."""
import json
import os
import sqlite3

import pytest

from conftest import edit, flor, plain, store, write_script
from flor import seal, trust
from flor.replay.plan import Plan


def _plan(tmp_path, code):
    return Plan(store=str(tmp_path), script=str(tmp_path / "train.py"), argv=("train.py",),
                record="r1", replay_id="r2", segments=((0, 2),), probed=frozenset(),
                changed_end=frozenset(), files={}, checkpoints={}, ckpt_dir="/c",
                main_loop="train.py:2", main_run=0, iterations=2, epsilon=0.1, c=1.38,
                hands_free={"hindsight": [], "other": [], "blocks": []}, instrumented=code)


@pytest.mark.unit
def test_a_plan_or_the_code_beside_it_changed_after_it_was_written_is_refused(tmp_path):
    trust.signing_key(create=True)
    path = str(tmp_path / "run" / "plan.json")
    _plan(tmp_path, compile("x = 1", "train.py", "exec")).save(path)
    assert Plan.load(path).record == "r1"
    with open(path) as f:
        data = json.load(f)
    data["argv"] = ["train.py", "--evil"]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(seal.Tampered, match="plan.json"):
        Plan.load(path)
    _plan(tmp_path, compile("x = 1", "train.py", "exec")).save(path)
    code = tmp_path / "run" / "instrumented.code"
    code.write_bytes(code.read_bytes() + b"\0")
    with pytest.raises(seal.Tampered):
        Plan.load(path)
    _plan(tmp_path, None).save(path)  # a plan whose seal was taken out
    with open(path) as f:
        data = json.load(f)
    del data["seal"]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(seal.Tampered):
        Plan.load(path)


SCRIPT = """
    import sys
    w = 0
    for epoch in range(3):
        for step in range(2):
            w += step + len(sys.argv)
        print(epoch, w)
"""


def test_a_record_whose_store_changed_after_it_is_refused(tmp_path):
    d = str(tmp_path)
    path = write_script(d, "train.py", SCRIPT)
    flor(d, "record", "train.py", "--lr", "1")
    st = store(d)
    run_id = st.records(path)[0]["run_id"]
    assert os.path.isfile(os.path.join(st.layout.run_dir(run_id), seal.SEAL_FILE))
    edit(path, "w += step", "print(step)")
    want = plain(d, "train.py", "--lr", "1").stdout
    assert flor(d, "replay", "train.py").stdout == want

    # An argument edited in flor.db: the script would run with it.
    db = sqlite3.connect(os.path.join(d, ".flor", "flor.db"))
    with db:
        db.execute("UPDATE runs SET argv = ? WHERE run_id = ?",
                   (json.dumps(["train.py", "--lr", "2"]), run_id))
    rep = flor(d, "replay", "--run", run_id, "train.py", "--lr", "2", check=False)
    assert rep.returncode == 2 and f"the seal of run {run_id} does not verify" in rep.stderr
    with db:
        db.execute("UPDATE runs SET argv = ? WHERE run_id = ?",
                   (json.dumps(["train.py", "--lr", "1"]), run_id))
    db.close()
    assert flor(d, "replay", "train.py").stdout == want

    # The recorded source replaced by the edited script: its change would go unseen.
    source = os.path.join(st.layout.run_dir(run_id), "source.py")
    with open(path) as f, open(source, "w") as g:
        g.write(f.read())
    rep = flor(d, "replay", "train.py", check=False)
    assert rep.returncode == 2 and "does not verify with your key" in rep.stderr, rep.stderr


def test_a_record_without_a_seal_is_refused_unless_the_store_is_trusted(tmp_path):
    """A seal taken out (or a record made before flor sealed runs) is
    refused where a key is here to verify it; FLOR_TRUST_STORE=1 replays it
    and says so."""
    d = str(tmp_path)
    path = write_script(d, "train.py", SCRIPT)
    flor(d, "record", "train.py")
    st = store(d)
    run_id = st.records(path)[0]["run_id"]
    os.remove(os.path.join(st.layout.run_dir(run_id), seal.SEAL_FILE))
    rep = flor(d, "replay", "train.py", check=False)
    assert rep.returncode == 2 and f"run {run_id} has no seal" in rep.stderr, rep.stderr
    rep = flor(d, "replay", "train.py", env={"FLOR_TRUST_STORE": "1"})
    assert "FLOR_TRUST_STORE=1: replay trusts the store" in rep.stderr, rep.stderr
