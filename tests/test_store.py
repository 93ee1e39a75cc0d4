"""The run store's database carries a schema version: flor creates its
tables only in a new database, keeps using its own older stores, and leaves
a database of another program or another schema untouched with an error
that names it."""
import json
import os
import sqlite3

import pytest

from flor.errors import StoreError
from flor.store import SCHEMA_VERSION, Store

pytestmark = pytest.mark.unit  # in-process: `make check` runs these


def _tables(path):
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def test_a_new_store_records_its_schema_version(tmp_path):
    st = Store(str(tmp_path / ".flor"))
    assert st.runs() == []
    row = st.db.execute("SELECT version FROM flor_schema").fetchall()
    assert [tuple(r) for r in row] == [(SCHEMA_VERSION,)]
    st.close()
    assert Store(str(tmp_path / ".flor")).runs() == []  # opened again: still one version row
    assert len(Store(str(tmp_path / ".flor")).db.execute(
        "SELECT * FROM flor_schema").fetchall()) == 1


def test_an_empty_database_file_is_no_store_yet(tmp_path):
    # A record killed while it made the store leaves an empty flor.db: the
    # store lists no runs, and the next record makes it.
    root = tmp_path / ".flor"
    root.mkdir()
    (root / "flor.db").write_bytes(b"")
    assert not Store(str(root), create=False).exists()
    with pytest.raises(StoreError, match="no flor run store"):
        Store(str(root), create=False).runs()
    st = Store(str(root))
    assert st.runs() == [] and st.exists()  # (made on first use)
    assert (root / "flor.db").stat().st_size > 0 and not Store(str(root), create=False).runs()


def test_a_database_of_another_program_is_refused_and_left_alone(tmp_path):
    root = tmp_path / ".flor"
    root.mkdir()
    db = root / "flor.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO runs (name) VALUES ('theirs')")
    with pytest.raises(StoreError, match=r"flor\.db is not a flor store .*runs.*FLOR_DIR"):
        Store(str(root)).runs()
    assert _tables(db) == {"runs"}
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT name FROM runs").fetchall() == [("theirs",)]


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    st = Store(str(tmp_path / ".flor"))
    st.runs()
    st.db.execute("UPDATE flor_schema SET version = ?", (SCHEMA_VERSION + 1,))
    st.close()
    with pytest.raises(StoreError, match=rf"schema version {SCHEMA_VERSION + 1}; this flor "
                                         rf"reads schema version {SCHEMA_VERSION}"):
        Store(str(tmp_path / ".flor")).runs()


def _old_store(root, version):
    """A store as an older flor wrote it: version 1 (or, with None, before
    the version table) had output rows without their context and location."""
    from flor.store import ddl

    root.mkdir()
    with sqlite3.connect(root / "flor.db") as conn:
        for statement in ddl():
            if version is not None or "flor_schema" not in statement:
                conn.execute(statement.replace(", ctx TEXT, loc TEXT", ""))
        if version is not None:
            conn.execute("INSERT INTO flor_schema VALUES (?)", (version,))
        conn.execute("INSERT INTO runs (run_id, kind, script) VALUES ('r1', 'record', 'a.py')")
        conn.execute("INSERT INTO output VALUES ('r1', 0, 1, 'stdout', NULL, NULL, NULL, 'hi')")


@pytest.mark.parametrize("version", [None, 1])
def test_an_older_store_is_brought_up_to_this_schema(tmp_path, version):
    root = tmp_path / ".flor"
    _old_store(root, version)
    st = Store(str(root))
    assert [r["run_id"] for r in st.runs()] == ["r1"]
    assert st.db.execute("SELECT version FROM flor_schema").fetchone()[0] == SCHEMA_VERSION
    (row,) = st.rows("output", "r1")
    assert row["text"] == "hi" and row["ctx"] is None and row["loc"] is None
    st.add_output([("r1", 0, 2, "stdout", None, None, None, "again", "[]", "a.py:3")])
    assert [r["text"] for r in st.run_rows("output", "r1")] == ["hi", "again"]


@pytest.mark.parametrize("content", ['[]', 'null', '{"HOST": 5e8}',
                                     '{"HOST": {"write_bytes_per_s": "5e8"}}',
                                     '{"HOST": {"write_bytes_per_s": -1}}', '{"HOST": ', ''])
def test_a_calibration_file_of_another_shape_is_measured_again(tmp_path, content):
    import json
    import socket

    from flor.store import Layout

    root = tmp_path / ".flor"
    root.mkdir()
    (root / "calibration.json").write_text(content.replace("HOST", socket.gethostname()))
    lay = Layout(str(root))
    assert lay.calibration(write_bytes_per_s=lambda: 7.0, copy_bytes_per_s=lambda: 9.0) == {
        "write_bytes_per_s": 7.0, "copy_bytes_per_s": 9.0}
    mine = json.loads((root / "calibration.json").read_text())[socket.gethostname()]
    assert mine["write_bytes_per_s"] == 7.0 and mine["copy_bytes_per_s"] == 9.0


def test_a_calibration_of_an_older_flor_keeps_its_write_bandwidth(tmp_path):
    import json
    import socket

    from flor.store import Layout

    root = tmp_path / ".flor"
    root.mkdir()
    host = socket.gethostname()
    (root / "calibration.json").write_text(json.dumps(
        {host: {"write_bytes_per_s": 5e8, "measured": 1.0}, "other": {"x": 1}}))

    def never():
        raise AssertionError("measured again")

    cal = Layout(str(root)).calibration(write_bytes_per_s=never, copy_bytes_per_s=lambda: 9.0)
    assert cal == {"write_bytes_per_s": 5e8, "copy_bytes_per_s": 9.0}
    assert json.loads((root / "calibration.json").read_text())["other"] == {"x": 1}


def test_run_info_is_parsed_once_into_the_object_of_its_kind(tmp_path):
    """A run's info reads as its kind's typed object: a key an older flor
    did not write reads as its default, a key a newer flor wrote is kept
    and written back unchanged."""
    from flor.runinfo import PartInfo, RecordInfo, ReplayInfo
    st = Store(str(tmp_path / ".flor"))
    rec = st.new_run("record", None, ["train.py", "3"], None,
                     info='{"adaptive": false, "from_a_newer_flor": [1, 2]}')
    run = st.run(rec)
    assert isinstance(run["info"], RecordInfo) and run["argv"] == ["train.py", "3"]
    assert run["info"].adaptive is False and run["info"].fingerprint == 1  # not written: 1
    assert run["info"].extra == {"from_a_newer_flor": [1, 2]}
    run["info"].main_ended = True
    st.update_run(rec, info=run["info"], versions={"torch": "x"})
    again = st.run(rec)
    assert again["info"] == run["info"] and again["versions"] == {"torch": "x"}
    assert '"from_a_newer_flor": [1, 2]' in st.db.execute(
        "SELECT info FROM runs WHERE run_id = ?", (rec,)).fetchone()[0]
    # Only the keys the run stored (or set since) are written back, as before.
    stored = st.db.execute("SELECT info FROM runs WHERE run_id = ?", (rec,)).fetchone()[0]
    assert json.loads(stored) == {"adaptive": False, "main_ended": True,
                                  "from_a_newer_flor": [1, 2]}
    rep = st.new_run("replay", None, [], None, parent=rec, info=ReplayInfo(nparts=3))
    assert st.run(rep)["info"].to_dict() == {"nparts": 3}
    assert st.run(rep)["info"].nparts == 3 and st.run(rep)["info"].checks_passed is None
    st.set_part(rep, 1, "finished", 2.0, PartInfo(main_seen=True))
    st.set_part(rep, 0, "finished", 1.0)
    assert [(p["part"], p["info"].main_seen) for p in st.parts(rep)] == [(0, False), (1, True)]


def test_a_replay_part_database_commits_without_waiting_for_the_disk_until_it_finishes(
        tmp_path):
    """A part's own database is written at every flush of a replay worker:
    its commits do not sync (a killed worker's segment runs again into a new
    file) until the part says it finished; the store itself always syncs."""
    from flor.schema import OUTPUT

    store = Store(str(tmp_path / ".flor"))
    part = Store(str(tmp_path / ".flor"), db_file=str(tmp_path / "part-0.a0.db"))
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL, with WAL
    assert part.db.execute("PRAGMA journal_mode").fetchone()[0] == "truncate"
    assert part.db.execute("PRAGMA synchronous").fetchone()[0] == 0  # OFF
    part.durable()
    assert part.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.durable()
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1

    def row(ord_):
        return OUTPUT.Row(run_id="r", part=0, ord=ord_, stream=1, phase="main", top=None,
                          iter=None, text="x", ctx=None, loc=None)

    # Writes grouped in one transaction are one commit: all or nothing.
    with pytest.raises(RuntimeError):
        with part.transaction():
            part.add_output([row(1)])
            part.add_output([row(2)])
            raise RuntimeError("the worker stops mid-flush")
    assert part.rows("output", "r") == []
    with part.transaction():
        part.add_output([row(1)])
        part.add_output([row(2)])
    assert [r["ord"] for r in part.rows("output", "r")] == [1, 2]


def test_a_records_notable_decisions_leave_out_its_step_loops_ordinary_ones(tmp_path):
    # A record's summary reads these, not the decision of every step.
    from flor.schema import DECISIONS

    st = Store(str(tmp_path / ".flor"))
    cols = dict.fromkeys(DECISIONS.names)

    def row(block, checkpoint=0, reason="no checkpoint: M/C = 2 >= 1", run="r1"):
        return DECISIONS.Row(**dict(cols, run_id=run, block=block, checkpoint=checkpoint,
                                    reason=reason))

    it, other = "train.py:9 (iteration)", "train.py:30 (iteration)"
    rows = [row("train.py:12"), row(it), row(it, 1, "checkpoint: M/C = 0.1 < 1"), row(it),
            row(it, reason="no checkpoint: none holds x (whose position no checkpoint holds)"),
            row(it, reason="no checkpoint: none holds x (whose position no checkpoint holds)"),
            row(other, reason="no checkpoint: its state cannot be checkpointed: TypeError"),
            row(it), row("train.py:12", reason=None), row(it, 1, run="r2")]
    st.add_decisions(rows)
    got = st.notable_decisions("r1", "cannot be checkpointed", "whose position no checkpoint")
    # (and the last of each loop: rows[7] of train.py:9, rows[6] of train.py:30)
    assert [(d["block"], d["checkpoint"], d["reason"]) for d in got] == [
        (r.block, r.checkpoint, r.reason)
        for r in (rows[0], rows[2], rows[4], rows[6], rows[7], rows[8])]


def test_a_calibration_leaves_no_staging_buffer_behind(tmp_path):
    """Measuring the disk snapshots 32 MiB: its staging buffers are unmapped
    after it, and the pool forgets that request (it keeps up to twice the
    largest request free, which would hold 64 MiB for a run of small
    checkpoints)."""
    from flor import _core
    from flor.runtime.writes import calibration

    st = Store(str(tmp_path / ".flor"))
    os.makedirs(st.root, exist_ok=True)  # as a record's first run directory makes it
    speeds = calibration(st, adaptive=True)
    assert speeds.write_bps > 0 and os.path.isfile(tmp_path / ".flor" / "calibration.json")
    stats = _core.pool_stats()
    assert stats["free_bytes"] == 0 and stats["high_water"] == 0, stats
