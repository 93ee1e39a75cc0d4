"""Queries over runs (flor/query.py): `flor runs --where/--sort` and
flor.dataframe(where=, sort=), by parameters, logged values and the
numbers in printed lines."""
import json
import os

import pytest

from flor.query import Query, QueryError, RunValues, SortKey

from conftest import flor, write_script

SCRIPT = """
import argparse
import flor

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--opt", default="sgd")
a = p.parse_args()
acc = 0.0
for epoch in flor.generator(range(3)):
    acc += a.lr
    flor.log("val_acc", acc)
    print(f"epoch {epoch} train loss {1 - acc:.3f}")
"""
# (--lr, --opt) of each record; val_acc ends at 3 * lr, train_loss at 1 - 3 * lr
RECORDS = [("0.1", None), ("0.05", None), ("0.3", None), ("0.2", "adam")]


@pytest.mark.unit
@pytest.mark.parametrize("text, says", [
    ("lr >", "does not parse"),
    ("__import__('os')", "a call is one of"),
    ("max(val_acc, 2) > 1", "a call is one of"),
    ("lr + 1 > 2", "is not a name, a value"),
    ("lr in (1, 2)", "only <, <=, >, >=, == and != compare"),
    ("val_acc[0] > 0", "is not a name, a value"),
    ("not " * 150 + "lr", "nests deeper than 100 levels"),
    ("-" * 3000 + "lr < 0", "nests deeper than 100 levels"),
    (123, "must be a string, not int"),
])
def test_an_expression_outside_the_syntax_is_refused_with_why(text, says):
    with pytest.raises(QueryError, match=says):
        Query(text)


@pytest.mark.unit
def test_a_sort_key_is_one_value():
    assert SortKey("-max(val_acc)").descending and not SortKey("model.depth").descending
    with pytest.raises(QueryError, match="not a name or an aggregate"):
        SortKey("lr > 1")
    with pytest.raises(QueryError, match="must be a string, not int"):
        SortKey(5)


class Run(RunValues):
    """A run's parameters and values given here, not read from a store."""

    def __init__(self, params, values):
        self._params, self._given = params, values

    def values(self, name):
        return self._given.get(name, [])


RUN = Run({"lr": 0.1, "model.depth": 3, "flag": True, "raw": "7", "opt": None},
          {"val_acc": [0.2, float("nan"), 0.5], "tag": ["a", "b", "c"]})


@pytest.mark.unit
@pytest.mark.parametrize("text, got", [
    ("model.depth == 3", True),
    ("lr < 1 < 2", True),
    ("not (nosuch < 1 < 0)", True),  # a false link decides, unknown or not
    ("not (1 < 0 < nosuch)", True),
    ("not (nosuch < 1 < 2)", "unknown"),
    ("nosuch > 1 or not (nosuch > 1)", "unknown"),
    ("not (nosuch > 1 and lr > 5)", True),
    ("count(tag) == 3 and count(nosuch) == 0", True),
    ("max(val_acc) == 0.5 and mean(val_acc) == 0.35", True),  # NaN is no number
    ("flag > 0 and flag == 1", True),
    ('raw > 8', "unknown"),  # a string and a number do not order
    ('raw == "7"', True),
    ("opt == None", True),
    ("lr > None", "unknown"),
])
def test_an_expression_is_evaluated_as_documented(text, got):
    assert Query(text).truth(RUN) is (None if got == "unknown" else got)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("query"))
    write_script(d, "train.py", SCRIPT)
    ids = {}
    for lr, opt in RECORDS:
        flor(d, "record", "train.py", "--lr", lr, *(["--opt", opt] if opt else []))
        runs = json.loads(flor(d, "runs", "--json").stdout)
        ids[(lr, opt)] = runs[-1]["run"]
    return d, ids


def listed(d, *argv):
    return [r["run"] for r in json.loads(flor(d, "runs", "--json", *argv).stdout)]


def test_runs_are_filtered_by_parameters_values_and_printed_numbers(recorded):
    d, ids = recorded
    lr = {k[0]: v for k, v in ids.items()}
    assert listed(d, "--where", "lr <= 0.1") == [lr["0.1"], lr["0.05"]]
    assert listed(d, "--where", 'opt == "adam" or lr < 0.06') == [lr["0.05"], lr["0.2"]]
    assert listed(d, "--where", "max(val_acc) > 0.5") == [lr["0.3"], lr["0.2"]]
    assert listed(d, "--where", "count(val_acc) == 3 and val_acc < 0.4") == [lr["0.1"],
                                                                            lr["0.05"]]
    assert listed(d, "--where", "train_loss < 0.2") == [lr["0.3"]]  # its last printed
    assert listed(d, "--where", "min(train_loss) < 0.5 < max(train_loss)") == [lr["0.3"],
                                                                               lr["0.2"]]
    # A name no run has makes the comparison unknown, and `not` of it too.
    assert listed(d, "--where", "not (nosuch > 1)") == []
    assert listed(d, "--where", "nosuch > 1 or lr > 0.25") == [lr["0.3"]]
    assert flor(d, "runs", "--where", "lr > 5").stdout.strip().endswith("matching")


def test_runs_are_sorted_by_a_value_or_an_aggregate(recorded):
    d, ids = recorded
    lr = {k[0]: v for k, v in ids.items()}
    assert listed(d, "--sort", "lr") == [lr["0.05"], lr["0.1"], lr["0.2"], lr["0.3"]]
    assert listed(d, "--sort=-last(val_acc)") == [lr["0.3"], lr["0.2"], lr["0.1"], lr["0.05"]]
    assert listed(d, "--sort", "min(train_loss)", "--where", "opt == 'sgd'") == [
        lr["0.3"], lr["0.1"], lr["0.05"]]
    # Runs without the value come last, in the order they were listed.
    assert listed(d, "--sort", "nosuch") == [lr["0.1"], lr["0.05"], lr["0.3"], lr["0.2"]]


def test_a_bad_query_is_a_usage_error_naming_it(recorded):
    d, _ = recorded
    got = flor(d, "runs", "--where", "lr >>> 1", check=False)
    assert got.returncode == 2 and "the query 'lr >>> 1' does not parse" in got.stderr


def test_dataframe_keeps_and_orders_the_runs_a_query_picks(recorded, monkeypatch):
    import flor as api

    d, ids = recorded
    lr = {k[0]: v for k, v in ids.items()}
    monkeypatch.setenv("FLOR_DIR", os.path.join(d, ".flor"))
    monkeypatch.chdir(d)
    df = api.dataframe("val_acc", where="lr >= 0.2", sort="-lr")
    assert list(dict.fromkeys(df["run"])) == [lr["0.3"], lr["0.2"]]
    assert list(df["val_acc"]) == pytest.approx([0.3, 0.6, 0.9, 0.2, 0.4, 0.6])
    frames = api.dataframes(where="opt == 'adam'")
    assert {run for f in frames.values() for run in f["run"]} == {lr["0.2"]}
    with pytest.raises(LookupError, match="no finished run of the script matches 'lr > 5'"):
        api.dataframe("val_acc", where="lr > 5")
