"""Names, tags and notes of runs: given at record (the command line and
flor.label), changed by `flor tag`, shown by `flor runs` and `flor show`,
and a name accepted wherever a run id is.  Real processes and stores."""
import json

from conftest import flor, store, write_script

SCRIPT = """
import os
import subprocess
import sys
import torch

x = torch.zeros(2)
for epoch in range(3):
    for i in range(4):
        x += 1
    print("epoch", epoch, x.sum().item())
    if epoch == 1 and os.environ.get("TAG_IT"):  # tags the record while it runs
        subprocess.run([sys.executable, "-m", "flor", "tag", "latest", "while-running"],
                       check=True)
"""


def listed(d):
    return {r["run"]: r for r in json.loads(flor(d, "runs", "--json").stdout)}


def test_a_record_is_named_tagged_and_annotated_and_its_name_works_as_its_id(tmp_path):
    d = str(tmp_path)
    write_script(d, "t.py", SCRIPT)
    flor(d, "record", "--name", "base", "--tag", "lr1", "--tag", "small", "--note",
         "first try", "t.py", env={"TAG_IT": "1"})
    (rec,) = store(d).runs()
    row = listed(d)[rec["run_id"]]
    # `flor tag` while the record ran: its end kept the tag.
    assert (row["name"], row["tags"], row["note"]) == (
        "base", ["lr1", "small", "while-running"], "first try")
    table = flor(d, "runs").stdout.splitlines()
    assert table[0].split()[:2] == ["run", "name"]
    assert table[1].split()[:4] == [rec["run_id"], "base", "#lr1", "#small"]
    shown = flor(d, "show", "base").stdout
    assert f"run:                 {rec['run_id']}" in shown and "note:                first try" in shown
    assert "tags:                lr1 small while-running" in shown

    taken = flor(d, "record", "--name", "base", "t.py", check=False)
    assert taken.returncode == 2 and f"run {rec['run_id']} is named 'base' already" in taken.stderr
    assert "epoch" not in taken.stdout and len(store(d).runs()) == 1  # refused before it ran
    for bad in ("9lives", "latest", "a b", "x" * 65):
        proc = flor(d, "record", "--name", bad, "t.py", check=False)
        assert proc.returncode == 2 and "cannot name a run" in proc.stderr, (bad, proc.stderr)
    for bad in ("", "a b"):
        proc = flor(d, "record", "--tag", bad, "t.py", check=False)
        assert proc.returncode == 2 and "a tag is one word" in proc.stderr, proc.stderr
    assert len(store(d).runs()) == 1  # refused before the run was registered
    resumed = flor(d, "record", "--resume", "--tag", "x", "t.py", check=False)
    assert resumed.returncode == 2 and "flor tag RUN" in resumed.stderr

    rep = flor(d, "replay", "--run", "base", "t.py")
    assert "deferred checks passed" in rep.stderr
    (rep_id,) = [r["run_id"] for r in store(d).runs() if r["kind"] == "replay"]
    assert flor(d, "tag", "latest", "hindsight", "--name", "probe").stdout == \
        f"{rep_id} probe #hindsight\n"
    flor(d, "tag", "base", "--remove", "small", "--note", "")
    flor(d, "tag", "probe", "--name", "probe2")  # renamed: the old name is free
    rows = listed(d)
    assert rows[rec["run_id"]]["tags"] == ["lr1", "while-running"]
    assert "note" not in rows[rec["run_id"]] and rows[rep_id]["name"] == "probe2"
    assert flor(d, "tag", "probe", "x", check=False).returncode == 2  # no run has that name now
    clash = flor(d, "tag", "probe2", "--name", "base", check=False)
    assert clash.returncode == 2 and "named 'base' already" in clash.stderr
    flor(d, "rm", "probe2")
    assert [r["run_id"] for r in store(d).runs()] == [rec["run_id"]]


def test_the_manual_api_labels_the_record_and_not_its_replay(tmp_path):
    d = str(tmp_path)
    write_script(d, "m.py", """
        import flor

        flor.label(name="manual", tags="one", note="from the script")
        for epoch in flor.generator(range(2)):
            flor.log("e", epoch)
    """)
    proc = flor(d, "record", "m.py")
    assert proc.returncode == 0
    flor(d, "replay", "m.py")
    rows = list(listed(d).values())
    assert [(r["kind"], r.get("name"), r.get("tags"), r.get("note")) for r in rows] == [
        ("record", "manual", ["one"], "from the script"), ("replay", None, None, None)]
    again = flor(d, "record", "m.py", check=False)
    assert again.returncode != 0 and "named 'manual' already" in again.stderr
