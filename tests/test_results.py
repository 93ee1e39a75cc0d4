"""Results across runs: flor.dataframe and flor.dataframes (one frame per
loop level, the script's arguments as columns), flor.names, the plot and
the TensorBoard export.

The example is recorded twice with different learning rates, and the
second record is replayed with a hindsight flor.log in the batch loop and
a print added to the epoch loop, once for the module."""
import json
import os
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import flor
from flor.errors import FlorError
from flor.export import export_mlflow, export_tensorboard, mlflow_key, plot, plot_figure
from flor.frames import dataframes, names_frame, script_args, select_runs
from flor.store import Store

from conftest import ROOT, edit, flor as flor_cli, read, runs, store, values, write_script

EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
ARGS = ["--epochs", "2", "--limit", "200", "--width", "4"]
GRAD = 'flor.log("grad_norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))'
PRINT = 'print("acc", val_acc)'


def line_of(text):
    return next(n for n, line in enumerate(read(EXAMPLE).splitlines(), 1) if text in line)


EPOCH_PRINT = line_of('print(f"epoch {epoch}')


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("results"))
    script = os.path.join(d, "train.py")
    shutil.copy(EXAMPLE, script)
    flor_cli(d, "record", "--no-adaptive", "train.py", *ARGS)
    flor_cli(d, "record", "--no-adaptive", "train.py", *ARGS, "--lr", "0.01")
    edit(script, "loss.backward()", GRAD)
    edit(script, 'flor.log("val_acc", val_acc)', PRINT)
    flor_cli(d, "replay", "train.py", *ARGS, "--lr", "0.01")
    st = store(d)
    rec1, rec2 = (r["run_id"] for r in runs(st, "record"))
    (rep,) = (r["run_id"] for r in runs(st, "replay"))
    line = next(n for n, text in enumerate(read(script).splitlines(), 1) if PRINT in text)
    # The added print is named by its function and text, not its line.
    (printed,) = {r["name"] for r in st.logs(rep) if r["name"].startswith("stdout@")} - \
        {r["name"] for r in st.logs(rec2)}
    assert re.fullmatch(r"stdout@train\.py:main~[0-9a-f]{8}", printed), printed
    return SimpleNamespace(dir=d, store=st, rec1=rec1, rec2=rec2, rep=rep, printed=printed,
                           at_line=f"stdout@train.py:new:{line}")


@pytest.fixture
def here(results, monkeypatch):
    """flor's functions read the results' store, from their directory."""
    monkeypatch.setenv("FLOR_DIR", os.path.join(results.dir, ".flor"))
    monkeypatch.chdir(results.dir)
    return results


def stored(r, run_id, name):
    return [v for _, _, v in values(r.store, run_id, name)]


# --- arguments ---------------------------------------------------------------

def test_the_command_line_becomes_columns():
    record = {"kind": "record", "script_name": "train.py", "argv": [
        "train.py", "--epochs", "4", "--lr=1e-3", "--batch-size", "8", "data.csv",
        "--neg", "-1", "--tag", "a", "--tag", "b", "--name", "x1", "--verbose"]}
    assert script_args(record) == {"epochs": 4, "lr": 1e-3, "batch_size": 8, "neg": -1,
                                   "tag": ("a", "b"), "name": "x1", "verbose": True,
                                   "arg0": "data.csv"}
    # A replay stores its arguments without the script; `--` ends the options.
    replay = {"kind": "replay", "script_name": "train.py",
              "argv": ["--fast", "--x", "0.5", "--", "--y"]}
    assert script_args(replay) == {"fast": True, "x": 0.5, "arg0": "--y"}


# --- frames --------------------------------------------------------------------

def test_dataframe_has_every_finished_run_of_the_script_with_its_arguments(here):
    r = here
    df = flor.dataframe("val_acc")  # no script: the latest run's
    # The arguments argparse parsed, defaults included, in the order it has them.
    assert list(df.columns) == ["run", "kind", "epochs", "batch_size", "lr", "width", "limit",
                                "seed", "threads", "iteration", "val_acc"]
    assert list(df["run"]) == [r.rec1] * 2 + [r.rec2] * 2 + [r.rep] * 2
    assert list(df["kind"]) == ["record"] * 4 + ["replay"] * 2
    assert list(df["epochs"]) == [2] * 6 and list(df["iteration"]) == [0, 1] * 3
    assert list(df["lr"]) == [1e-3] * 2 + [0.01] * 4  # the first run took the default
    assert list(df["batch_size"]) == [64] * 6 and list(df["limit"]) == [200] * 6
    for run_id in (r.rec1, r.rec2, r.rep):
        assert list(df[df["run"] == run_id]["val_acc"]) == stored(r, run_id, "val_acc")
    assert df.equals(flor.dataframe("val_acc", script="train.py"))
    assert df.equals(flor.dataframe("val_acc", script=os.path.join(r.dir, "train.py")))
    one = flor.dataframe("val_acc", run=r.rec1)
    assert list(one["run"]) == [r.rec1] * 2 and list(one["lr"]) == [1e-3] * 2
    assert list(flor.dataframe("val_acc", runs=[r.rep, r.rec2])["run"]) == [r.rec2] * 2 + [r.rep] * 2
    with pytest.raises(LookupError, match="flor.names"):
        flor.dataframe("val_accuracy")


def test_one_frame_per_loop_level(here):
    r = here
    frames = flor.dataframes("val_acc", "grad_norm")
    assert sorted(frames) == [1, 2]
    epochs, batches = frames[1], frames[2]
    # Per-epoch values are not padded with NaN in rows of per-batch ones.
    assert list(epochs.columns)[-2:] == ["iteration", "val_acc"] and len(epochs) == 6
    assert epochs["val_acc"].notna().all()
    # Per-batch values: only the replay has them; seq numbers them in an epoch.
    assert list(batches.columns)[-3:] == ["iteration", "seq", "grad_norm"]
    assert set(batches["run"]) == {r.rep} and set(batches["kind"]) == {"replay"}
    assert list(batches["grad_norm"]) == stored(r, r.rep, "grad_norm")
    assert len(batches) == 2 * 3  # 2 epochs of 3 batches (180 images, 64 a batch)
    assert list(batches["seq"]) == [0, 1, 2] * 2 and list(batches["lr"]) == [0.01] * 6
    with pytest.raises(ValueError, match=r"level 1: val_acc; level 2: grad_norm.*"
                                         r"pass level=1 or level=2.*flor.dataframes"):
        flor.dataframe("val_acc", "grad_norm")
    with pytest.raises(ValueError, match="level=1 or level=2"):
        flor.dataframe()  # every logged name
    assert flor.dataframe("val_acc", "grad_norm", level=2).equals(batches)
    assert list(flor.dataframe(level=1).columns)[-2:] == ["val_acc", "val_loss"]
    with pytest.raises(ValueError, match="at level 0"):
        flor.dataframe("val_acc", level=0)


def test_printed_lines_are_values_when_named(here):
    r = here
    df = flor.dataframe(r.printed)
    assert list(df["run"]) == [r.rep] * 2
    assert [v.startswith("acc ") for v in df[r.printed]] == [True, True]
    numbers = flor.dataframe(f"{r.printed}/acc")  # the number the lines name
    assert list(numbers[f"{r.printed}/acc"]) == stored(r, r.rec2, "val_acc")
    with pytest.raises(LookupError, match="no values named"):
        flor.dataframe(f"{r.printed}/loss")
    assert not [c for c in flor.dataframe(level=1).columns if c.startswith("stdout@")]
    # The name by its line in the edited file, as replays named it before,
    # still finds the same lines and numbers.
    old = flor.dataframe(r.at_line, f"{r.at_line}/acc")
    assert list(old[r.at_line]) == list(df[r.printed])
    assert list(old[f"{r.at_line}/acc"]) == list(numbers[f"{r.printed}/acc"])


def test_frames_of_nested_generators_leave_out_other_ranks_and_unfinished_runs(tmp_path):
    st = Store(str(tmp_path / ".flor"))
    script = str(tmp_path / "t.py")

    def run(status="finished", rank=None, scale=1, batches=3):
        info = json.dumps({"rank": rank} if rank is not None else {})
        argv = ["t.py", "--scale", str(scale)] + ([] if batches else ["--no-batches"])
        run_id = st.new_run("record", script, argv, "", status=status, info=info)
        rows, ord_ = [], 0
        for i in range(2):
            for j in range(batches):
                ord_ += 1
                rows.append((run_id, 0, ord_, None, None, None, "loss", json.dumps([i, j]), 0,
                             json.dumps(scale * (i + j)), "t.py:9"))
            ord_ += 1
            rows.append((run_id, 0, ord_, None, None, None, "acc", json.dumps([i]), 0,
                         json.dumps(scale * i), "t.py:10"))
        st.add_logs(rows)
        return run_id

    a, _, _, _, b = run(), run(rank=1), run(status="failed"), run(status="running"), run(scale=2)
    c = run(scale=3, batches=0)
    assert [x["run_id"] for x in select_runs(st, script)] == [a, b, c]
    frames = dataframes(st, ("acc", "loss"), script=script)
    # Argument columns are those of the runs in the frame.
    assert list(frames[1].columns) == ["run", "kind", "scale", "no_batches", "iteration", "acc"]
    assert list(frames[1]["no_batches"].isna()) == [True] * 4 + [False] * 2
    assert list(frames[2].columns) == ["run", "kind", "scale", "iteration", "iteration_1", "loss"]
    assert list(frames[2]["iteration_1"]) == [0, 1, 2] * 4
    assert list(frames[2]["loss"]) == [0, 1, 2, 1, 2, 3] + [0, 2, 4, 2, 4, 6]
    assert list(frames[1]["scale"]) == [1, 1, 2, 2, 3, 3] and list(frames[1]["acc"]) == [
        0, 1, 0, 2, 0, 3]
    assert list(frames[2]["run"]) == [a] * 6 + [b] * 6


# --- names -----------------------------------------------------------------------

def test_names_of_runs_that_logged_nothing_is_an_empty_frame_with_its_columns(tmp_path):
    st = Store(str(tmp_path / ".flor"))
    st.new_run("record", str(tmp_path / "t.py"), ["t.py"], "", status="finished", info="{}")
    frame = names_frame(st, script=str(tmp_path / "t.py"))
    assert frame.empty and list(frame.columns) == [
        "name", "level", "kind", "values", "runs", "where", "source"]


def test_names_lists_levels_runs_and_statements(here):
    r = here
    frame = flor.names()
    assert list(frame.columns) == ["name", "level", "kind", "values", "runs", "where", "source"]
    by = {n["name"]: n for n in frame.to_dict("records")}
    assert by["val_acc"] == {"name": "val_acc", "level": 1, "kind": "log", "values": 6,
                             "runs": [r.rec1, r.rec2, r.rep], "where": "train.py:106",
                             "source": 'flor.log("val_acc", val_acc)'}
    assert by["grad_norm"]["level"] == 2 and by["grad_norm"]["runs"] == [r.rep]
    assert by["grad_norm"]["source"] == GRAD and by["grad_norm"]["values"] == 6
    added = by[r.printed]
    assert (added["kind"], added["level"], added["runs"], added["source"]) == (
        "printed", 1, [r.rep], PRINT)
    number = by[f"{r.printed}/acc"]  # "acc 0.88": a number it names
    assert (number["kind"], number["level"], number["runs"], number["source"]) == (
        "printed number", 1, [r.rep], PRINT)
    # A recorded statement of two lines, read from the record's kept source.
    epoch = by[f"stdout@train.py:{EPOCH_PRINT}"]
    assert epoch["source"].startswith('print(f"epoch {epoch}') and "\n" in epoch["source"]
    assert not [n for n in by if n.startswith("state@")]
    assert list(frame["level"]) == sorted(frame["level"])
    epoch = f"stdout@train.py:{EPOCH_PRINT}"
    one = flor.names(run=r.rec1)
    assert list(one[one["level"] == 1]["name"]) == [
        "val_acc", "val_loss", epoch, f"{epoch}/epoch", f"{epoch}/lr", f"{epoch}/val_acc",
        f"{epoch}/val_loss"]


# --- plot ----------------------------------------------------------------------

# matplotlib's C++ extension (ft2font, pybind11) raises C++ exceptions, which the
# AddressSanitizer runtime that `make test-asan` preloads into Python cannot
# unwind: the process aborts in ft2font before any of flor's code runs.  The
# plot is tested in the ordinary run; it exercises none of flor's C code.
MATPLOTLIB_UNDER_ASAN = pytest.mark.skipif(
    os.environ.get("FLOR_SANITIZED") == "1",
    reason="matplotlib's C++ exceptions abort under the preloaded ASan runtime")


@MATPLOTLIB_UNDER_ASAN
def test_plot_draws_one_line_per_run(here, tmp_path, monkeypatch):
    r = here
    path = plot(r.store, "val_acc", out=str(tmp_path / "acc.png"))
    assert path == str(tmp_path / "acc.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The replay logged val_acc again, as its record did: one line per training run.
    (ax,) = plot_figure(r.store, "val_acc").axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == [f"{r.rec1} (lr=0.001)",
                                                    f"{r.rec2} (lr=0.01)"]
    assert [list(line.get_ydata()) for line in lines] == [stored(r, r.rec1, "val_acc"),
                                                          stored(r, r.rec2, "val_acc")]
    assert ax.get_xlabel() == "iteration of the main loop"
    (ax,) = plot_figure(r.store, "grad_norm").axes
    (line,) = ax.get_lines()
    assert line.get_label() == f"{r.rep} (replay)" and list(line.get_xdata()) == list(range(6))
    assert ax.get_xlabel() == "step (values in iteration order)"
    monkeypatch.chdir(tmp_path)
    assert plot(r.store, "grad_norm", runs=[r.rep]) == str(tmp_path / "grad_norm.png")
    # The number a printed line names: `print("acc", val_acc)` in the replay
    # prints what the record (of the same arguments) logged.
    (ax,) = plot_figure(r.store, f"{r.printed}/acc").axes
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == stored(r, r.rec2, "val_acc")
    # A statement whose lines name their numbers has no value of its own.
    for name, fields in ((r.printed, "acc"),
                         (f"stdout@train.py:{EPOCH_PRINT}", "epoch, val_loss, val_acc, lr")):
        with pytest.raises(FlorError, match=f"its lines name the numbers {fields}: plot"):
            plot(r.store, name)
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(FlorError, match="pip install matplotlib"):
        plot(r.store, "val_acc")


# --- TensorBoard -------------------------------------------------------------------

def test_tensorboard_export_reads_back_as_stored(here, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = here
    out = str(tmp_path / "tb")
    for _ in range(2):  # exporting again replaces the event files
        dirs = export_tensorboard(r.store, out)
    assert dirs == [os.path.join(out, run_id) for run_id in (r.rec1, r.rec2)]
    epoch = f"stdout@train.py:{EPOCH_PRINT}"  # "epoch 0: val_loss 0.4321 val_acc 0.8800 lr ..."
    printed = sorted([f"{epoch}/{field}" for field in ("epoch", "lr", "val_acc", "val_loss")]
                     + [f"stdout@train.py:{line_of('training on')}/training",
                        f"stdout@train.py:{line_of('training on')}/testing",
                        f"stdout@train.py:{line_of('final test')}/test_accuracy"])
    # the replay (of rec2) adds its hindsight values to its record's, and only
    # those: "acc 0.88" is a named number
    expected = {r.rec1: (*printed, "val_acc", "val_loss"),
                r.rec2: tuple(sorted((*printed, "val_acc", "val_loss", "grad_norm",
                                      f"{r.printed}/acc")))}
    for directory in dirs:
        run_id = os.path.basename(directory)
        assert len([f for f in os.listdir(directory) if f.startswith("events.")]) == 1
        acc = EventAccumulator(directory)
        acc.Reload()
        assert sorted(acc.Tags()["scalars"]) == list(expected[run_id])
        for tag in ("val_acc", "val_loss", "grad_norm"):
            if tag in expected[run_id]:
                logger = r.rep if tag == "grad_norm" else run_id
                want = [(i, float(np.float32(v))) for i, v in enumerate(stored(r, logger, tag))]
                assert [(e.step, e.value) for e in acc.Scalars(tag)] == want
        want = [(i, float(np.float32(round(v, 4)))) for i, v in  # printed with 4 decimals
                enumerate(stored(r, run_id, "val_acc"))]
        assert [(e.step, e.value) for e in acc.Scalars(f"{epoch}/val_acc")] == want


# --- MLflow ------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # MLflow's libraries' own
def test_mlflow_export_reads_back_with_mlflows_client(here, tmp_path):
    """One MLflow run per record, its configuration as parameters, its
    values (a replay's hindsight values under its record's run) as metrics;
    exporting again adds nothing twice."""
    from mlflow.tracking import MlflowClient

    r = here
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = export_mlflow(r.store, uri)
    assert [(run_id, n > 0) for run_id, _, n in first] == [(r.rec1, True), (r.rec2, True)]
    again = export_mlflow(r.store, uri)  # found by flor's run id: nothing written twice
    assert [(run_id, mlrun, n) for run_id, mlrun, n in again] == \
        [(run_id, mlrun, 0) for run_id, mlrun, _ in first]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("train.py")  # (besides MLflow's Default)
    assert [e.name for e in client.search_experiments()] == ["train.py", "Default"]
    got = {m.data.tags["flor.run_id"]: m for m in client.search_runs([exp.experiment_id])}
    assert sorted(got) == sorted([r.rec1, r.rec2])
    epoch = mlflow_key(f"stdout@train.py:{EPOCH_PRINT}")
    assert epoch == f"stdout/train.py:{EPOCH_PRINT}"
    for run_id, mlrun in ((r.rec1, got[r.rec1]), (r.rec2, got[r.rec2])):
        assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == run_id
        record = r.store.run(run_id)
        assert mlrun.data.params == {k: v if isinstance(v, str) else json.dumps(v)
                                     for k, v in script_args(record, r.store).items()}
        assert mlrun.data.params["lr"] == ("0.01" if run_id == r.rec2 else "0.001")  # a default too
        history = client.get_metric_history(mlrun.info.run_id, "val_acc")
        assert [(m.step, m.value) for m in history] == list(enumerate(stored(r, run_id,
                                                                             "val_acc")))
        history = client.get_metric_history(mlrun.info.run_id, f"{epoch}/val_acc")
        assert [(m.step, m.value) for m in history] == [  # printed with 4 decimals
            (i, round(v, 4)) for i, v in enumerate(stored(r, run_id, "val_acc"))]
    # the replay's hindsight values, under its record's run, and only there
    history = client.get_metric_history(got[r.rec2].info.run_id, "grad_norm")
    assert [(m.step, m.value) for m in history] == list(enumerate(stored(r, r.rep,
                                                                         "grad_norm")))
    assert f"{mlflow_key(r.printed)}/acc" in got[r.rec2].data.metrics
    assert "grad_norm" not in got[r.rec1].data.metrics
    # A record asked for alone comes with its replay's hindsight values.
    alone = f"sqlite:///{tmp_path / 'alone.db'}"
    (only,) = export_mlflow(r.store, alone, runs=[r.rec2])
    assert only[0] == r.rec2
    assert "grad_norm" in MlflowClient(tracking_uri=alone).get_run(only[1]).data.metrics


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # MLflow's libraries' own
def test_mlflow_export_again_follows_the_store(tmp_path):
    """Exporting again: a corrected hindsight statement's values replace the
    old ones (the MLflow run is written anew), a name and tags follow `flor
    tag`, tags and names MLflow refuses as they are are made legal,
    colliding names are told apart, and names the store no longer has go."""
    from mlflow.tracking import MlflowClient

    d = str(tmp_path)
    write_script(d, "train.py", """
        import flor
        import torch

        w = torch.zeros(1)
        for epoch in flor.generator(range(3)):
            if flor.SkipBlock.step_into("inner"):
                for i in range(2):
                    w += 0.5
            w = flor.SkipBlock.end(w)
            flor.log("acc%", epoch / 10)
            flor.log("acc#", epoch / 5)
            flor.log("val/", float(w))
        """)
    flor_cli(d, "record", "--no-adaptive", "--name", "base", "--tag", "v1+aug", "train.py")
    edit(os.path.join(d, "train.py"), "w = flor.SkipBlock.end(w)", 'flor.log("w2", float(w * w))')
    flor_cli(d, "replay", "train.py")
    uri = f"sqlite:///{tmp_path / 'ml.db'}"
    env = {"FLOR_DIR": os.path.join(d, ".flor")}
    first = flor_cli(d, "export", "--mlflow", uri, env=env)
    assert "'acc%' is 'acc___2' there ('acc#' is 'acc_')" in first.stderr
    client = MlflowClient(tracking_uri=uri)

    def the_run():
        (run,) = client.search_runs([client.get_experiment_by_name("train.py").experiment_id])
        return run

    def history(run, key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    one = the_run()
    assert one.info.run_name == "base" and "flor.tag.v1_aug" in one.data.tags
    assert history(one, "acc_") == [(0, 0.0), (1, 0.2), (2, 0.4)]  # acc#
    assert history(one, "acc___2") == [(0, 0.0), (1, 0.1), (2, 0.2)]  # acc%
    assert history(one, "val") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert history(one, "w2") == [(0, 1.0), (1, 4.0), (2, 9.0)]

    # The hindsight statement corrected and replayed again; the run renamed
    # and its tag removed.
    src = read(os.path.join(d, "train.py")).replace("float(w * w)", "float(w * w * w)")
    with open(os.path.join(d, "train.py"), "w") as f:
        f.write(src)
    flor_cli(d, "replay", "train.py")
    flor_cli(d, "tag", "base", "ok", "--remove", "v1+aug", "--name", "renamed")
    again = flor_cli(d, "export", "--mlflow", uri, env=env)
    assert "values changed since it was exported" in again.stderr
    two = the_run()  # one active MLflow run of the record: the old one deleted
    assert two.info.run_id != one.info.run_id and two.info.run_name == "renamed"
    assert history(two, "w2") == [(0, 1.0), (1, 8.0), (2, 27.0)]
    assert "flor.tag.v1_aug" not in two.data.tags and "flor.tag.ok" in two.data.tags
    third = flor_cli(d, "export", "--mlflow", uri, env=env)  # nothing new: nothing written
    assert third.stdout.strip().endswith(f"MLflow run {two.info.run_id}, 0 metric values "
                                         "written")
    # The replays deleted: a name the store no longer gives the record goes.
    st = store(d)
    flor_cli(d, "rm", *(r["run_id"] for r in runs(st, "replay")))
    fourth = flor_cli(d, "export", "--mlflow", uri, env=env)
    assert "names flor no longer gives it (w2)" in fourth.stderr
    assert "w2" not in the_run().data.metrics and history(the_run(), "val") == history(two, "val")
    for bad in ("", "sqlite:///"):
        proc = flor_cli(d, "export", "--mlflow", bad, env=env, check=False)
        assert proc.returncode == 2 and "is not an MLflow tracking store" in proc.stderr
    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a database")
    proc = flor_cli(d, "export", "--mlflow", f"sqlite:///{garbage}", env=env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


@MATPLOTLIB_UNDER_ASAN
def test_plot_and_export_from_the_command_line(results, tmp_path):
    import matplotlib.image

    r = results
    env = {"FLOR_DIR": os.path.join(r.dir, ".flor")}
    png = str(tmp_path / "acc.png")
    proc = flor_cli(str(tmp_path), "plot", "val_acc", "--script", "train.py", "--out", png,
                    env=env)
    assert proc.stdout.strip() == png
    assert matplotlib.image.imread(png).ndim == 3  # a readable image
    one = flor_cli(str(tmp_path), "plot", "grad_norm", "--run", r.rep, env=env)
    assert os.path.isfile(one.stdout.strip())
    out = str(tmp_path / "tb")
    proc = flor_cli(str(tmp_path), "export", "--tensorboard", out, "--run", r.rec1, "--run",
                    r.rep, env=env)
    # the replay's values with its record's (rec2, exported with it)
    assert proc.stdout.split() == [os.path.join(out, r.rec1), os.path.join(out, r.rec2)]
    for argv in (["plot", "no_such_value"], ["plot", "val_acc", "--run", "nosuch"],
                 ["export", "--tensorboard", out, "--run", "nosuch"],
                 ["export", "--mlflow", "nosuch://x"],
                 ["plot", "val_acc", "--script", "nosuch.py"]):
        bad = flor_cli(str(tmp_path), *argv, env=env, check=False)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr


def test_a_printed_number_some_lines_lack_stays_on_the_lines_that_printed_it(tmp_path,
                                                                            monkeypatch):
    """A field is aligned with its statement's lines (a gap where a line
    lacks it), and has its statement's level."""
    d = str(tmp_path)
    write_script(d, "train.py", """
        import torch
        w = torch.zeros(1)
        for epoch in range(2):
            for b in range(4):
                w += 1
                extra = f" acc {b / 10 + epoch}" if b % 2 else ""
                print(f"loss {b + 10 * epoch}{extra}")
    """)
    flor_cli(d, "record", "--no-adaptive", "train.py")
    monkeypatch.setenv("FLOR_DIR", os.path.join(d, ".flor"))
    line = "stdout@train.py:7"
    df = flor.dataframe(line, f"{line}/loss", f"{line}/acc")
    assert list(df["seq"]) == [0, 1, 2, 3] * 2 and list(df["iteration"]) == [0] * 4 + [1] * 4
    assert list(df[f"{line}/loss"]) == [0, 1, 2, 3, 10, 11, 12, 13]
    acc = list(df[f"{line}/acc"])
    assert [a for i, a in enumerate(acc) if i % 2] == [0.1, 0.3, 1.1, 1.3]
    assert all(np.isnan(a) for i, a in enumerate(acc) if i % 2 == 0)
    names = flor.names()
    assert list(names[names["name"].str.startswith(line)]["level"]) == [2, 2, 2]
