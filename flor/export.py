"""Results people look at: a plot of one value over the runs of a script,
and every value as TensorBoard event files or in an MLflow tracking store.

Both take the runs that flor.dataframe reads (flor/frames.py) and draw or
write numbers only: a value logged as a number (a one-element tensor is
one), not a list or a large array, and the numbers of printed lines
(flor/printed.py): ``stdout@train.py:24/loss`` for `loss 0.23`, and the
statement's own name for a line with one number it does not name.  A
replay logs again what its record logged, and its deferred checks compare
the two: where the replayed record is among the runs and has the name
too, the replay's values of it are left out, so a replay adds only its
hindsight values.

The step of a value is its iteration of the main loop when the name is
logged once per iteration; for a name logged deeper (in every batch, in a
nested flor.generator) it is the value's position in the run, in
iteration order: 0, 1, 2, ... (a global step).

matplotlib, tensorboard and mlflow are optional: ``pip install
matplotlib``, ``pip install tensorboard``, ``pip install mlflow``.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import warnings
from dataclasses import dataclass

from .context import PRINTED, STATE, TB
from .errors import FlorError, note
from .frames import Values, script_args, select_runs
from .printed import field_name as printed_field
from .printed import fields as printed_fields
from .printed import unnamed as printed_unnamed
from .printed import split as split_printed

__all__ = ["Series", "series", "plot_figure", "plot", "export_tensorboard", "export_mlflow",
           "mlflow_key"]


@dataclass
class Series:
    """One run's numeric values of a name, by step."""

    run: dict
    steps: list
    values: list
    label: str = ""


def _number(value) -> bool:
    return isinstance(value, (int, float))


def _numeric(rows, name) -> list:
    """The rows of `name` with a number: a printed statement's lines hold
    theirs as text (flor/printed.py), where a line has one number that it
    does not name (a line that names it is a field's value)."""
    if name.startswith(PRINTED) and split_printed(name)[1] is None:
        rows = [r[:3] + (printed_unnamed(r[3]),) + r[4:] for r in rows]
    return [r for r in rows if _number(r[3])]


def _steps(rows, flat: bool) -> list:
    """The step of each (run, vec, seq, value, loc) row of one run."""
    if not flat:
        return [vec[0] for _, vec, _, _, _ in rows]
    order = sorted(range(len(rows)), key=lambda i: (rows[i][1], rows[i][2]))
    steps = [0] * len(rows)
    for step, i in enumerate(order):
        steps[i] = step
    return steps


def _replayed(values: Values, name) -> set:
    """Replays whose record is among the runs and has `name` too."""
    has = {row[0] for row in values.rows.get(name, ())}
    return {r["run_id"] for r in values.runs
            if r["kind"] == "replay" and r["run_id"] in has and r["parent"] in has}


def _by_run(values: Values, name) -> dict:
    out: dict = {}
    for row in values.rows.get(name, ()):
        out.setdefault(row[0], []).append(row)
    return out


def _flat(values: Values, name) -> bool:
    """Whether the name's steps are positions (True) or main-loop
    iterations (False, for a name logged once per iteration)."""
    return values.level(name) != 1 or values.depth(name) != 1


def series(store, name, runs=None, script=None) -> tuple[list[Series], bool]:
    """(the numeric values of `name`, one Series per run that has any,
    labelled with the run id and the arguments that differ between them;
    whether the steps are positions rather than main-loop iterations)."""
    selected = select_runs(store, script, runs=runs)
    values = Values(store, selected, [name], printed=True)
    if name not in values.rows:
        raise FlorError(f"no values named {name!r} in the runs "
                        f"{', '.join(r['run_id'] for r in selected)}; flor.names() lists them")
    skip, by_run, is_flat = _replayed(values, name), _by_run(values, name), _flat(values, name)
    out = []
    for run in selected:
        rows = _numeric(by_run.get(run["run_id"], ()), name)
        if rows and run["run_id"] not in skip:
            out.append(Series(run, _steps(rows, is_flat), [float(r[3]) for r in rows]))
    if not out:
        fields = list(dict.fromkeys(f for rows in by_run.values() for r in rows
                                    if isinstance(r[3], str) for f in printed_fields(r[3])))
        hint = (f"; its lines name the numbers {', '.join(fields)}: plot one of them, "
                f"{printed_field(name, fields[-1])!r} for example" if fields else "")
        raise FlorError(f"{name!r} has no numeric values to draw (a number, or a tensor "
                        "of one element, logged with flor.log; a printed line with one "
                        f"number it does not name){hint}")
    _label(out, store)
    return out, is_flat


def _label(out: list[Series], store):
    args = {s.run["run_id"]: script_args(s.run, store) for s in out}
    keys = list(dict.fromkeys(k for a in args.values() for k in a))
    differ = [k for k in keys if len({repr(a.get(k)) for a in args.values()}) > 1]
    for s in out:
        mine = args[s.run["run_id"]]
        parts = [f"{k}={mine[k]}" if k in mine else f"{k}=(default)" for k in differ]
        if s.run["kind"] != "record":
            parts.append(s.run["kind"])
        s.label = s.run["run_id"] + (f" ({', '.join(parts)})" if parts else "")


# -- plot ---------------------------------------------------------------------

def plot_figure(store, name, runs=None, script=None):
    """A matplotlib Figure of `name` over its steps, one line per run (see
    `plot`).  Drawn on the Agg canvas: no window, and pyplot's state and
    backend are left alone."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise FlorError("plotting needs matplotlib, an optional dependency: "
                        "pip install matplotlib") from None
    out, is_flat = series(store, name, runs, script)
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in out:
        ax.plot(s.steps, s.values, marker="o" if len(s.steps) <= 50 else None,
                markersize=3, label=s.label)
    ax.set_xlabel("step (values in iteration order)" if is_flat
                  else "iteration of the main loop")
    ax.set_ylabel(name)
    script_name = out[0].run["script_name"] or ""
    ax.set_title(f"{name} ({script_name})" if script_name else name)
    ax.legend(fontsize="small")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    return fig


def plot(store, name, runs=None, script=None, out=None) -> str:
    """Write a PNG of `name` over the runs of `script` (default: the
    script of the latest run; `runs`: run ids instead), one line per run
    labelled with its id and the arguments that differ between the runs;
    x is the main-loop iteration for a value logged once per iteration,
    else the value's position in the run.  `out`: the file (default
    ``NAME.png`` in the working directory).  Returns its path."""
    fig = plot_figure(store, name, runs, script)
    if out is None:
        out = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") + ".png"
    path = os.path.abspath(out)
    fig.savefig(path, dpi=100)
    return path


# -- TensorBoard --------------------------------------------------------------

def _with_records(store, selected) -> list:
    """The runs, the records of their replays and the finished replays of
    their records, oldest first: a replay's values are written beside its
    record's, and a record's are its own and its replays' hindsight values,
    which a directory or an MLflow run written again must not lose."""
    ids = {r["run_id"] for r in selected}
    added = []
    for r in selected:
        if r["kind"] == "replay" and r["parent"] and r["parent"] not in ids:
            record = store.run(r["parent"])
            if record is not None:
                ids.add(record["run_id"])
                added.append(record)
    records = {r["run_id"] for r in selected + added if r["kind"] == "record"}
    added += [r for r in store.runs() if r["kind"] == "replay" and r["parent"] in records
              and r["run_id"] not in ids and r["status"] == "finished"]
    return sorted(selected + added, key=lambda r: r["started"] or 0) if added else selected


def export_tensorboard(store, out_dir, runs=None, script=None) -> list[str]:
    """Write the numeric values of the runs (as in `plot`) as TensorBoard
    event files, one directory per record under `out_dir` (named by its
    run id), tag = the name (a TensorBoard value's own tag, without
    ``tb:``), step as in `plot`.  Event files already in a directory are
    replaced.  A replay's values are written in its record's directory
    (the record is exported with it, and a record with its finished
    replays): its hindsight values are a run's values, beside the ones it
    logged when it trained.  Values that are not
    numbers (lists, large arrays) are skipped, with a note naming them; of
    printed lines, their named numbers are written
    (``stdout@train.py:24/loss``), and a line's one number under the
    statement's name where it names none.  Says so when nothing was
    written.  Returns the directories written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise FlorError("exporting to TensorBoard needs torch and tensorboard: "
                        "pip install tensorboard") from None
    selected = _with_records(store, select_runs(store, script, runs=runs))
    targets, skipped = _scalars(store, selected)
    written = []
    for run_id, scalars in targets.items():
        if not scalars:
            continue
        directory = os.path.join(os.path.abspath(out_dir), run_id)
        for old in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
            os.remove(old)
        writer = SummaryWriter(log_dir=directory)
        try:
            for (tag, step), value in scalars.items():
                writer.add_scalar(tag, value, global_step=step)
        finally:
            writer.close()
        written.append(directory)
    _say_skipped("TensorBoard", skipped, bool(written))
    return written


def _say_skipped(what, skipped, numeric: bool, rest=""):
    if skipped:
        note(f"{what} export: values that are not numbers skipped: "
             f"{', '.join(sorted(skipped))}")
    if not numeric:
        note(f"{what} export: the runs hold no numeric values (numbers logged with "
             f"flor.log, or printed); none was written{rest}")


def _scalars(store, selected) -> tuple[dict, set]:
    """({training run id: {(tag, step): value}}, the names of values that
    are not numbers) of the runs `selected` (with their replays' records):
    a replay's values go beside its record's, one training run each with
    its hindsight values (a later replay's value of a tag and step replaces
    an earlier one's)."""
    values = Values(store, selected, None, printed=True, fields=True)
    names = [n for n in values.rows if not n.startswith(STATE)]
    per_name = {n: (_by_run(values, n), _replayed(values, n), _flat(values, n)) for n in names}
    skipped: set = set()
    targets: dict[str, dict] = {}
    for run in selected:
        run_id = run["run_id"]
        target = targets.setdefault(
            run["parent"] if run["kind"] == "replay" and run["parent"] else run_id, {})
        for name, (by_run, replayed, is_flat) in per_name.items():
            rows = by_run.get(run_id, ())
            if not rows or run_id in replayed:
                continue
            numeric = _numeric(rows, name)
            if len(numeric) < len(rows) and not name.startswith(PRINTED):
                skipped.add(name)
            # a value the script wrote to TensorBoard keeps its own tag
            tag = name[len(TB):] if name.startswith(TB) else name
            for step, r in zip(_steps(numeric, is_flat), numeric):
                target[(tag, step)] = float(r[3])
    return targets, skipped


# -- MLflow -------------------------------------------------------------------

#: What MLflow refuses in a metric's, parameter's or tag's name, and how long
#: a name and a parameter's or tag's value may be.
_MLFLOW_NAME = re.compile(r"[^\w\-. :/]")
_MLFLOW_KEY_MAX, _MLFLOW_VALUE_MAX = 250, 6000
#: A training run's status as MLflow says it (a run still going is left RUNNING).
_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
#: The tags flor owns on an MLflow run: set to what they are now at each
#: export, and removed when the run no longer has them.
_FLOR_TAGS = ("flor.", "mlflow.note.content", "mlflow.source.git.")


def mlflow_key(name: str) -> str:
    """A flor name as an MLflow key: MLflow allows letters, digits,
    ``_ - . : /`` and spaces, and a key that reads as a path must not climb
    or have empty parts, so the ``@`` of a printed statement's name becomes
    ``/`` (``stdout/train.py:24/loss``), any other character ``_``, and
    ``.``, ``..`` and empty parts between slashes go."""
    key = _MLFLOW_NAME.sub("_", name.replace("@", "/", 1))
    key = "/".join(part for part in key.split("/") if part.strip() not in ("", ".", ".."))
    return key[:_MLFLOW_KEY_MAX].rstrip("/ ") or "_"


def _mlflow_keys(names, what: str) -> dict:
    """{flor name: its MLflow key}, one key per name: a name whose key
    another name has already is told apart by a count (``acc_``,
    ``acc__2``), with a note."""
    out, taken = {}, {}
    for name in sorted(names):
        key = base = mlflow_key(name)
        n = 1
        while key in taken:
            n += 1
            key = f"{base[:_MLFLOW_KEY_MAX - 8]}__{n}"
        if n > 1:
            note(f"MLflow export: the {what} {name!r} is {key!r} there ({taken[base]!r} is "
                 f"{base!r})")
        taken[key] = name
        out[name] = key
    return out


def export_mlflow(store, uri, runs=None, script=None) -> list[tuple[str, str, int]]:
    """Write the runs to the MLflow tracking store at `uri` (``sqlite:///
    mlflow.db``, a tracking server's ``http://...``, a file store): one
    MLflow run per training run, in the experiment named after its script,
    with its name (else its id), tags, note, git commit and status, its
    configuration as parameters and its numeric values (as `export_
    tensorboard` writes them: a replay's hindsight values under its
    record's run) as metrics, keys as `mlflow_key` makes them.  A run
    written before (tag ``flor.run_id``) is found again: it gets the values
    it lacks (steps a run went on to, a later replay's names) and its name,
    tags and status as they are now; where a value it has differs from the
    store's now (a hindsight statement corrected and replayed again), it is
    deleted and written anew.  Returns (flor run id, MLflow run id, metric
    values written) for each training run."""
    if not uri or not uri.strip() or uri.rstrip("/") in ("sqlite:", "sqlite:/", "sqlite://"):
        raise FlorError(f"{uri!r} is not an MLflow tracking store to keep: give a file "
                        "(sqlite:///mlflow.db) or a server (http://host:5000)")
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise FlorError("exporting to MLflow needs mlflow: pip install mlflow") from None
    selected = _with_records(store, select_runs(store, script, runs=runs))
    targets, skipped = _scalars(store, selected)
    keys = _mlflow_keys({tag for scalars in targets.values() for tag, _ in scalars}, "value")
    out: list = []
    with warnings.catch_warnings():  # its libraries' deprecations: nothing a user can change
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            _to_mlflow(MlflowClient(tracking_uri=uri), uri, store, selected, targets, keys,
                       (Metric, Param, RunTag), out)
        except (FlorError, NameError, AttributeError, TypeError, KeyError, IndexError):
            raise  # flor's refusals, and flor's own mistakes (a traceback)
        except Exception as e:  # noqa: BLE001 -- the store's, its driver's: said, not a traceback
            done = "".join(f"; {r} was written (MLflow run {m})" for r, m, _ in out)
            message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            raise FlorError(f"MLflow ({uri}): {message}{done}") from None
    _say_skipped("MLflow", skipped, any(targets.values()),
                 " (their parameters and tags were)")
    return out


def _to_mlflow(client, uri, store, selected, targets, keys, entities, out):
    Metric, Param, RunTag = entities
    experiments: dict = {}
    for run in selected:
        if run["run_id"] not in targets:  # a replay: its values are its record's
            continue
        exp = run["script_name"] or "flor"
        if exp not in experiments:
            experiments[exp] = _mlflow_experiment(client, exp, uri)
        stamp = int((run["started"] or 0) * 1000)
        values = {(keys[tag], step): value for (tag, step), value in targets[run["run_id"]].items()}
        params = _mlflow_params(run, store)
        tags = _mlflow_tags(run)
        mlrun, have = _mlflow_find(client, experiments[exp], run), {}
        if mlrun is not None:
            names = {k for k, _ in values}
            have = _mlflow_values(client, mlrun, names)
            gone = set(client.get_run(mlrun).data.metrics) - names
            if gone or any(not _same(have.get(at, value), value) for at, value in values.items()):
                why = (f"names flor no longer gives it ({', '.join(sorted(gone)[:3])}"
                       f"{', ...' if len(gone) > 3 else ''})" if gone else
                       "values changed since it was exported (a statement replayed again)")
                note(f"MLflow export: run {run['run_id']} has {why}; MLflow run {mlrun} is "
                     "deleted and written anew")
                client.delete_run(mlrun)
                mlrun, have = None, {}
        if mlrun is None:
            mlrun = client.create_run(experiments[exp], start_time=stamp, tags=tags,
                                      run_name=getattr(run["info"], "name", None) or
                                      run["run_id"]).info.run_id
            had_params: dict = {}
        else:
            had = client.get_run(mlrun).data
            had_params = had.params
            for k in had.tags:  # flor's tags the run no longer has (a tag removed)
                if k.startswith(_FLOR_TAGS) and k not in tags:
                    client.delete_tag(mlrun, k)
            tags["mlflow.runName"] = getattr(run["info"], "name", None) or run["run_id"]
        metrics = [Metric(k, value, stamp, step) for (k, step), value in values.items()
                   if (k, step) not in have]
        for i in range(0, len(metrics), 1000):  # MLflow's limits per batch
            client.log_batch(mlrun, metrics=metrics[i:i + 1000])
        new = [Param(k, v) for k, v in params.items() if k not in had_params]
        for i in range(0, len(new), 100):
            client.log_batch(mlrun, params=new[i:i + 100])
        items = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            client.log_batch(mlrun, tags=items[i:i + 100])
        status = _MLFLOW_STATUS.get(store.status(run))
        if status is not None:  # (an interrupted run's end is not known: its start)
            client.set_terminated(mlrun, status,
                                  end_time=int((run["finished"] or run["started"] or 0) * 1000))
        out.append((run["run_id"], mlrun, len(metrics)))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _mlflow_experiment(client, name, uri) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name)
    if found.lifecycle_stage != "active":
        raise FlorError(f"the MLflow experiment {name!r} at {uri} is deleted: restore it in "
                        "MLflow, or delete it for good, before exporting to it")
    return found.experiment_id


def _mlflow_find(client, experiment, run):
    """The MLflow run an earlier export made of flor's `run`, or None."""
    found = client.search_runs([experiment], filter_string=f"tags.`flor.run_id` = "
                               f"'{run['run_id']}'", max_results=1)
    return found[0].info.run_id if found else None


def _mlflow_values(client, mlrun, keys) -> dict:
    """{(key, step): value} of an MLflow run's metrics `keys`: the last
    value written at each step."""
    out = {}
    for key in keys:
        for m in sorted(client.get_metric_history(mlrun, key), key=lambda m: m.timestamp):
            out[(key, m.step)] = m.value
    return out


def _mlflow_tags(run) -> dict:
    """flor's tags on the MLflow run of `run`, as they are now."""
    info = run["info"]
    tags = {"flor.run_id": run["run_id"], "flor.script": run["script"] or "",
            "mlflow.source.name": run["script"] or ""}
    labels = getattr(info, "labels", None) or []
    tags.update((f"flor.tag.{key}", "") for key in _mlflow_keys(labels, "tag").values())
    if getattr(info, "note", None):
        tags["mlflow.note.content"] = info.note
    code = getattr(info, "code", None) or {}
    if code.get("commit"):
        tags["mlflow.source.git.commit"] = code["commit"]
        if code.get("branch"):
            tags["mlflow.source.git.branch"] = code["branch"]
        tags["flor.git.dirty"] = str(bool(code.get("dirty"))).lower()
    return {k: v[:_MLFLOW_VALUE_MAX] for k, v in tags.items()}


def _mlflow_params(run, store) -> dict:
    """The run's configuration (flor.dataframe's columns) as MLflow
    parameters: strings, JSON for what is not one."""
    config = script_args(run, store)
    keys = _mlflow_keys([str(k) for k in config], "parameter")
    return {keys[str(k)]: (v if isinstance(v, str) else json.dumps(v, default=repr))
            [:_MLFLOW_VALUE_MAX] for k, v in config.items()}
