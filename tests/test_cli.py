"""The command line: help, where flor's options go, the script's failures,
runs that replay must not pick, the recorded arguments, managing runs, and
every kind of store flor cannot use.  Real processes, a real training
script (examples/train_digits.py on scikit-learn's digits)."""
import hashlib
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys

import pytest

from conftest import ROOT, edit, flor, store

EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
ARGS = ["--epochs", "2", "--limit", "200", "--width", "4"]
COMMANDS = ("record", "replay", "merge", "runs", "show", "tag", "rm", "prune", "plot", "export")


@pytest.fixture
def d(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "train.py")
    return str(tmp_path)


def runs_json(d, *extra):
    return json.loads(flor(d, "runs", "--json", *extra).stdout)


def test_every_command_has_help_with_its_options_and_environment(tmp_path):
    top = flor(str(tmp_path), "--help")
    for cmd in COMMANDS:
        assert cmd in top.stdout
    for cmd, options in {"record": ["--epsilon", "--no-adaptive", "--resume", "--force",
                                    "--name", "--tag", "--note"],
                         "tag": ["--name", "--note", "--remove"],
                         "replay": ["--jobs", "--backend", "--threads", "--run", "--part",
                                    "--parts", "--check", "--tolerance", "--strict",
                                    "--args-differ-ok", "FLOR_REPLAY_CORES"],
                         "runs": ["--script", "--status", "--json"], "rm": ["--dry-run"],
                         "prune": ["--keep"], "plot": ["--out"], "export": ["--tensorboard"]
                         }.items():
        for flag in ("--help", "-h"):
            proc = flor(str(tmp_path), cmd, flag)
            assert proc.stdout.startswith(f"usage: flor {cmd}")
            assert all(o in proc.stdout for o in options), (cmd, proc.stdout)
            assert "FLOR_DIR" in proc.stdout
    assert not os.path.exists(tmp_path / ".flor")
    bad = flor(str(tmp_path), "replay", "--jobs", "zero", "train.py", check=False)
    assert bad.returncode == 2 and "--jobs" in bad.stderr and "Traceback" not in bad.stderr
    # Settings read at the first checkpoint (of GPU state) are checked before the script runs.
    (tmp_path / "ok.py").write_text("print('ran')\n")
    for var, value in (("FLOR_MATERIALIZER", "forks"), ("FLOR_CUDA_COPY", "stage")):
        bad = flor(str(tmp_path), "record", "ok.py", env={var: value}, check=False)
        assert bad.returncode == 2 and f"{var} must be" in bad.stderr, bad.stderr
        assert "ran" not in bad.stdout and not os.path.exists(tmp_path / ".flor")


def test_the_flor_console_script():
    exe = os.path.join(os.path.dirname(sys.executable), "flor")
    proc = subprocess.run([exe, "record", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: flor record")


def test_flor_options_at_the_very_end_are_flor_s(d):
    flor(d, "record", "train.py", *ARGS, "--no-adaptive")
    (rec,) = runs_json(d)
    assert rec["args"] == ARGS and rec["checkpoints"] == 2  # adaptivity off: every epoch
    reasons = {r["reason"].split(":")[0] for r in store(d).rows("decisions", rec["run"])}
    assert reasons == {"checkpoint"}
    proc = flor(d, "replay", "train.py", *ARGS, "--jobs", "2", "--check=strict")
    assert "deferred checks passed" in proc.stderr
    # `SCRIPT -- ARGS`: everything after -- is the script's, flor's options too
    failed = flor(d, "replay", "--args-differ-ok", "train.py", "--", *ARGS, "--jobs", "2",
                  check=False)
    assert failed.returncode == 2
    assert "unrecognized arguments: --jobs 2" in failed.stderr


@pytest.mark.unit
def test_where_flor_options_end_and_the_script_s_begin(d, monkeypatch):
    from flor.cli import build_parser, parse

    monkeypatch.chdir(d)
    parser = build_parser()
    o = parse(parser, ["replay", "train.py", "--epochs", "2", "--", "--jobs", "2"])
    assert o.jobs == 1 and o.args == ["--epochs", "2", "--", "--jobs", "2"]  # after --: the script's
    o = parse(parser, ["replay", "--run", "train.py", "train.py", "--jobs", "2"])
    assert (o.run, o.script, o.jobs, o.args) == ("train.py", "train.py", 1, ["--jobs", "2"])
    o = parse(parser, ["replay", "--jobs", "3", "train.py", "--epochs", "2", "--jobs=2"])
    assert o.jobs == 3 and o.args == ["--epochs", "2", "--jobs=2"]  # options first: the rest
    o = parse(parser, ["replay", "train.py", "--epochs", "2", "--jobs=2", "--strict"])
    assert o.jobs == 2 and o.strict and o.args == ["--epochs", "2"]
    o = parse(parser, ["record", "train.py", "-h"])
    assert o.args == ["-h"]  # the script's help
    o = parse(parser, ["replay", "train.py", "--"])
    assert o.args == [] and o.explicit_args  # explicitly none
    assert not parse(parser, ["replay", "train.py"]).explicit_args


def _tree(root):
    """Every file under `root` with its bytes and modification time."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[path] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def test_a_record_keeps_the_git_version_of_its_script_and_never_writes_the_repository(d):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=flor", "-c", "user.email=flor@test",
                               *args], cwd=d, check=True, capture_output=True, text=True).stdout
    git("init", "-q", "-b", "work")
    with open(os.path.join(d, "README"), "w") as f:
        f.write("digits\n")
    git("add", "train.py", "README")
    git("commit", "-q", "-m", "the script")
    commit = git("rev-parse", "HEAD").strip()
    flor(d, "record", "train.py", *ARGS)  # clean: the store is flor's, not an untracked file
    clean = runs_json(d)[0]
    info = json.loads(flor(d, "show", clean["run"], "--json").stdout)["info"]
    assert info["code"] == {"root": os.path.realpath(d), "commit": commit, "branch": "work",
                            "dirty": False, "untracked": 0}
    edit(os.path.join(d, "train.py"), "import argparse", "import math")
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("lr sweep\n")
    later = os.stat(os.path.join(d, "README")).st_mtime + 60
    os.utime(os.path.join(d, "README"), (later, later))  # a stale index: git diff rewrites it
    before = _tree(os.path.join(d, ".git"))
    # GIT_DIR as a git hook has it, pointing at another repository.
    other = os.path.join(d, "other.git")
    subprocess.run(["git", "init", "-q", "--bare", other], check=True)
    flor(d, "record", "train.py", *ARGS, env={"GIT_DIR": other})
    assert _tree(os.path.join(d, ".git")) == before  # read only: the index is not refreshed
    run = runs_json(d)[-1]["run"]
    assert run != clean["run"]
    shown = json.loads(flor(d, "show", run, "--json").stdout)
    assert shown["info"]["code"] == {"root": os.path.realpath(d), "commit": commit,
                                     "branch": "work", "dirty": True, "untracked": 2,
                                     "diff": "code.diff"}
    with open(os.path.join(shown["directory"], "code.diff")) as f:
        assert f.read() == git("diff", "HEAD") and "+import math" in git("diff", "HEAD")
    assert (f"code:                {commit[:12]} on work in {os.path.realpath(d)}, with "
            "uncommitted changes") in flor(d, "show", run).stdout


def test_runs_are_named_by_a_unique_prefix_of_their_id_or_latest(d):
    flor(d, "record", "train.py", *ARGS)
    flor(d, "record", "train.py", *ARGS)
    first, second = [r["run"] for r in runs_json(d)]
    shown = json.loads(flor(d, "show", "latest", "--json").stdout)
    assert shown["run"] == second
    assert json.loads(flor(d, "show", first[:-2], "--json").stdout)["run"] == first
    common = os.path.commonprefix([first, second])
    both = flor(d, "show", common, check=False)
    assert both.returncode == 2 and "Traceback" not in both.stderr
    assert f"{common!r} is the start of 2 run ids ({first}, {second})" in both.stderr
    assert flor(d, "rm", "--dry-run", second[:-1]).stdout == f"would delete {second}\n"
    assert flor(d, "show", "nothing-like-it", check=False).returncode == 2
    # replay --run latest: the latest record of the script replayed, not of another.
    shutil.copy(os.path.join(d, "train.py"), os.path.join(d, "other.py"))
    flor(d, "record", "other.py", *ARGS)
    flor(d, "replay", "--run", "latest", "train.py")
    assert runs_json(d)[-1]["parent"] == second


def test_a_script_s_failure_is_shown_with_its_status(d):
    flor(d, "record", "train.py", *ARGS)
    proc = flor(d, "replay", "--args-differ-ok", "train.py", "--jobs", "2", *ARGS, check=False)
    assert proc.returncode == 2  # argparse's status, passed on
    assert "the script exited with status 2" in proc.stderr
    assert "train.py: error: unrecognized arguments: --jobs 2" in proc.stderr
    assert "flor replay --jobs 2 train.py" in proc.stderr  # where flor's options go
    # a failure before the main loop is not retried
    assert "running it again" not in proc.stderr


def test_a_help_run_is_marked_empty_and_never_replayed(d):
    flor(d, "record", "train.py", *ARGS)
    helped = flor(d, "record", "train.py", "--help")
    assert "usage: train.py" in helped.stdout and "replay never picks it" in helped.stderr
    rec, empty = runs_json(d)
    assert empty["status"] == "empty" and rec["status"] == "finished"
    assert [r["run"] for r in runs_json(d, "--status", "empty")] == [empty["run"]]
    proc = flor(d, "replay", "train.py")
    assert f"replaying run {rec['run']}" in proc.stderr
    flor(d, "rm", rec["run"])
    only_empty = flor(d, "replay", "train.py", check=False)
    assert only_empty.returncode == 2
    assert empty["run"] in only_empty.stderr and "--run" in only_empty.stderr


def test_replay_reuses_the_recorded_arguments_and_refuses_others(d):
    rec = flor(d, "record", "train.py", *ARGS)
    same = flor(d, "replay", "train.py")  # no ARGS: the recorded ones
    assert same.stdout == rec.stdout and "deferred checks passed" in same.stderr
    other = flor(d, "replay", "train.py", "--epochs", "3", "--limit", "200", "--width", "4",
                 check=False)
    assert other.returncode == 2
    assert "--epochs 2 --limit 200 --width 4" in other.stderr  # the recorded ones
    assert "--epochs 3 --limit 200 --width 4" in other.stderr  # and these
    assert "--args-differ-ok" in other.stderr
    assert len(runs_json(d, "--kind", "replay")) == 1  # nothing was replayed
    ok = flor(d, "replay", "--args-differ-ok", "train.py", "--epochs", "3", "--limit", "200",
              "--width", "4")
    assert "arguments differ from the record's" in ok.stderr
    assert runs_json(d, "--kind", "replay")[-1]["args"][:3] == ["--epochs", "3", "--limit"]


def test_runs_filters_json_and_merged_durations(d):
    flor(d, "record", "train.py", *ARGS)
    edit(os.path.join(d, "train.py"), "loss.backward()", 'flor.log("loss", loss)')
    flor(d, "replay", "--part", "0/2", "train.py")
    flor(d, "replay", "--part", "1/2", "train.py")
    flor(d, "merge")
    rows = runs_json(d)
    (merged,) = [r for r in rows if r["kind"] == "replay"]
    assert merged["status"] == "finished" and merged["seconds"] > 0.2
    assert merged["checks_passed"] is True and merged["parent"] == rows[0]["run"]
    assert runs_json(d, "--script", "other.py") == []
    assert [r["kind"] for r in runs_json(d, "--script", "train.py", "--kind", "record")] \
        == ["record"]
    header, *lines = flor(d, "runs").stdout.splitlines()
    at = header.index("kind")
    assert [line[at:at + 6] for line in lines] == ["record", "replay"]  # columns line up
    shown = json.loads(flor(d, "show", merged["run"], "--json").stdout)
    assert shown["run"] == merged["run"] and "loss" in shown["names"]
    assert "status:" in flor(d, "show", rows[0]["run"]).stdout


def test_rm_and_prune_delete_rows_and_files_together(d):
    for _ in range(3):
        flor(d, "record", "train.py", *ARGS)
    flor(d, "record", "train.py", "--help")
    first, second, third, empty = (r["run"] for r in runs_json(d))
    flor(d, "replay", "--run", first, "train.py")
    st = store(d)
    dry = flor(d, "prune", "--keep", "1", "--dry-run")
    assert all(r in dry.stdout for r in (first, second, empty)) and third not in dry.stdout
    assert len(st.runs()) == 5  # a dry run deletes nothing
    flor(d, "prune", "--keep", "1")
    assert [r["run_id"] for r in store(d).runs()] == [third]
    for rid in (first, second, empty):
        assert not os.path.exists(st.layout.run_dir(rid))
        assert not store(d).rows("decisions", rid) and not store(d).rows("logs", rid)
    assert sorted(os.listdir(os.path.join(d, ".flor", "runs"))) == [third]
    flor(d, "rm", third)
    assert store(d).runs() == [] and os.listdir(os.path.join(d, ".flor", "runs")) == []
    missing = flor(d, "rm", "nope", check=False)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


def test_checkpoint_counts_are_files_that_exist(d):
    flor(d, "record", "--no-adaptive", "train.py", *ARGS)
    (rec,) = runs_json(d)
    ckpt = store(d).layout.ckpt_dir(rec["run"])
    assert rec["checkpoints"] == 2
    os.unlink(os.path.join(ckpt, sorted(os.listdir(ckpt))[0]))
    assert runs_json(d)[0]["checkpoints"] == 1
    assert json.loads(flor(d, "show", rec["run"], "--json").stdout)["checkpoints_missing"] == 1


# -- stores flor cannot use ------------------------------------------------------

def clean_failure(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_a_store_path_that_is_a_file(d):
    path = os.path.join(d, "notadir")
    open(path, "w").close()
    for cmd in (["runs"], ["record", "train.py", *ARGS], ["replay", "train.py"]):
        proc = flor(d, *cmd, env={"FLOR_DIR": path}, check=False)
        clean_failure(proc, path, "FLOR_DIR")
    assert os.path.getsize(path) == 0


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_damaged_store_is_named_and_left_alone(d):
    root = os.path.join(d, ".flor")
    os.makedirs(root)
    db = os.path.join(root, "flor.db")
    with open(db, "wb") as f:
        f.write(b"these are not the bytes of a database" * 200)
    before = digest(db)
    for cmd in (["runs"], ["record", "train.py", *ARGS], ["replay", "train.py"]):
        clean_failure(flor(d, *cmd, check=False), db, "damaged")
    # the manual API, run as a plain script
    proc = subprocess.run([sys.executable, "train.py", *ARGS], cwd=d, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, FLOR_DIR=root))
    clean_failure(proc, db, "damaged")
    assert digest(db) == before and sorted(os.listdir(root)) == ["flor.db"]


def test_another_program_s_database_is_not_touched(d):
    root = os.path.join(d, ".flor")
    os.makedirs(root)
    db = os.path.join(root, "flor.db")
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE people (name TEXT)")
        c.execute("INSERT INTO people VALUES ('ada')")
    c.close()
    before = digest(db)
    for cmd in (["runs"], ["record", "train.py", *ARGS], ["replay", "train.py"]):
        clean_failure(flor(d, *cmd, check=False), "not a flor store", "people")
    assert digest(db) == before  # not even its journal mode
    assert sorted(os.listdir(root)) == ["flor.db"]


def read_only(root, argv):
    """`argv` with `root` read-only: a read-only bind mount in a mount
    namespace of its own for root (whom permission bits do not stop), the
    permission bits for anyone else."""
    if os.geteuid() != 0:
        os.chmod(root, 0o555)
        return argv
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"root here cannot make a mount namespace: {probe.stderr.decode()}")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, root, *argv]


def test_a_read_only_store(d):
    root = os.path.join(d, "store")
    os.mkdir(root)
    env = dict(os.environ, FLOR_DIR=root)
    env.pop("FLOR_MODE", None)
    for cmd in (["record", "train.py", *ARGS], ["runs"], ["replay", "train.py"]):
        proc = subprocess.run(read_only(root, [sys.executable, "-m", "flor", *cmd]), cwd=d,
                              env=env, capture_output=True, text=True, timeout=120)
        if cmd[0] == "runs":
            assert proc.returncode == 0 and "no runs" in proc.stdout, proc.stderr
        else:
            clean_failure(proc, root)
    assert os.listdir(root) == []


def test_a_read_only_store_can_still_be_listed(d):
    root = os.path.join(d, ".flor")
    flor(d, "record", "train.py", *ARGS)
    (rec,) = runs_json(d)
    env = dict(os.environ, FLOR_DIR=root)
    env.pop("FLOR_MODE", None)
    for cmd in (["runs"], ["show", rec["run"]]):
        proc = subprocess.run(read_only(root, [sys.executable, "-m", "flor", *cmd]), cwd=d,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and rec["run"] in proc.stdout, proc.stderr


def test_a_database_with_no_flor_tables_is_not_made_a_store(d):
    root = os.path.join(d, ".flor")
    os.makedirs(root)
    db = os.path.join(root, "flor.db")
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA user_version = 7")
        c.execute("CREATE VIEW v AS SELECT 1")
    c.close()
    before = digest(db)
    for cmd in (["runs"], ["record", "train.py", *ARGS]):
        clean_failure(flor(d, *cmd, check=False), "not a flor store")
    assert digest(db) == before


def test_a_rank_of_a_data_parallel_record_is_deleted_with_its_record(d):
    from flor.store import Store

    st = Store(os.path.join(d, ".flor"))
    leader = st.new_run("record", "train.py", ["train.py"], "", status="finished",
                        info=json.dumps({"world_size": 2, "rank": 0, "group": "g"}))
    rank1 = st.new_run("record", "train.py", ["train.py"], "", run_id=leader + "-rank1",
                       status="finished",
                       info=json.dumps({"world_size": 2, "rank": 1, "group": leader}))
    refused = flor(d, "rm", rank1, check=False)
    clean_failure(refused, f"flor rm {leader}")
    flor(d, "rm", leader)
    assert store(d).runs() == []


def test_read_only_commands_create_no_store(d):
    for cmd in (["runs"], ["runs", "--json"], ["prune"], ["replay", "train.py"],
                ["show", "x"], ["merge"], ["plot", "loss"]):
        flor(d, *cmd, check=False)
    assert not os.path.exists(os.path.join(d, ".flor"))


def _small_files(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the child's own: writes fail EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_calibration_that_cannot_write_never_stops_training(d):
    """Files over 1 MiB cannot be written (as on a nearly full disk): the
    32 MiB calibration fails, and so do the checkpoints; training goes on."""
    env = dict(os.environ, FLOR_DIR=os.path.join(d, ".flor"))
    env.pop("FLOR_MODE", None)
    proc = subprocess.run([sys.executable, "-m", "flor", "record", "train.py", *ARGS,
                           "--width", "32"], cwd=d, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=_small_files(1 << 20))
    assert proc.returncode == 0, proc.stderr
    assert "final test accuracy" in proc.stdout
    assert proc.stderr.count("could not measure how fast this machine writes") == 1
    assert "0 checkpoints" in proc.stderr  # none of the failed writes is counted
    (rec,) = runs_json(d)
    assert rec["status"] == "finished" and rec["checkpoints"] == 0
    assert not [f for f in os.listdir(os.path.join(d, ".flor")) if f.startswith("calibrat")]


def test_an_adaptive_record_calibrates_once_per_store(d):
    flor(d, "record", "train.py", *ARGS)
    with open(os.path.join(d, ".flor", "calibration.json")) as f:
        (cal,) = json.load(f).values()
    assert cal["write_bytes_per_s"] > 0 and cal["copy_bytes_per_s"] > 0
    (rec,) = runs_json(d)
    first = store(d).rows("decisions", rec["run"], "ORDER BY rowid")[0]
    assert first["bandwidth"] == cal["write_bytes_per_s"]


def test_a_part_prints_only_its_own_output(d):
    # Epochs long enough that a second part pays on any machine (the split
    # weighs the measured compute against restoring a checkpoint).
    args = ["--epochs", "2", "--limit", "800", "--width", "4"]
    flor(d, "record", "--no-adaptive", "train.py", *args)
    edit(os.path.join(d, "train.py"), "loss.backward()", 'print("batch loss", loss.item())')
    p0 = flor(d, "replay", "--part", "0/2", "train.py")
    p1 = flor(d, "replay", "--part", "1/2", "train.py")
    assert "training on" in p0.stdout and "epoch 0:" in p0.stdout
    assert "epoch 1:" not in p0.stdout and "final test accuracy" not in p0.stdout
    # part 1 pseudoresumes through epoch 0 (or restores it) and shows none of it
    assert "training on" not in p1.stdout and "epoch 0:" not in p1.stdout
    assert "epoch 1:" in p1.stdout and "final test accuracy" in p1.stdout
    assert p0.stdout + p1.stdout == flor(d, "merge").stdout


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf"])
def test_a_bad_flor_epsilon_is_refused_naming_it(d, value):
    bad = flor(d, "record", "train.py", *ARGS, env={"FLOR_EPSILON": value}, check=False)
    assert bad.returncode == 2 and "FLOR_EPSILON must be a number above 0" in bad.stderr
    assert repr(value) in bad.stderr
