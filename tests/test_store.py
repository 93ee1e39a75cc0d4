"""The run store's database carries a schema version: flor creates its
tables only in a new database, keeps using its own older stores, and leaves
a database of another program or another schema untouched with an error
that names it."""
import sqlite3

import pytest

from flor.errors import StoreError
from flor.store import SCHEMA_VERSION, Store


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


def test_a_store_written_before_the_version_table_is_kept(tmp_path):
    st = Store(str(tmp_path / ".flor"))
    run = st.new_run("record", "/x/train.py", ["train.py"], None)
    st.db.execute("DROP TABLE flor_schema")
    st.close()
    again = Store(str(tmp_path / ".flor"))
    assert [r["run_id"] for r in again.runs()] == [run]
    assert again.db.execute("SELECT version FROM flor_schema").fetchone()[0] == SCHEMA_VERSION
