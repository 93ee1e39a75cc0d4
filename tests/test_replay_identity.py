"""Replay reproduces exactly what the edited script would do in a plain run,
whatever the shape of the program: loops run twice, blocks run several
times per iteration, changed end() calls, changed helpers in the script or
in another module, state outside state_dict(), explicit random generators.

Each case once replayed wrong values (or crashed) and was found in review."""
import os
import textwrap

import pytest

from flor.store import Store

from conftest import block_stats, edit, flor, plain, read, runs, store, values, write_script


def replay_matches_plain(d, script, *args, jobs=("1", "2"), env=None):
    """Replay with each job count; stdout must equal a plain run of the
    (edited) script and the deferred checks must pass."""
    expected = plain(d, script, *args, env=env).stdout
    for j in jobs:
        rep = flor(d, "replay", "--jobs", j, "--check", "strict", script, *args, env=env)
        assert rep.stdout == expected, (j, rep.stderr)
        assert "deferred checks passed" in rep.stderr
    return rep


def test_a_loop_run_twice_keeps_each_runs_checkpoints(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        w = torch.zeros(2)

        def stage(lr, n):
            global w
            for e in flor.generator(range(n)):
                if flor.SkipBlock.step_into():
                    w += lr
                w = flor.SkipBlock.end(w)
                print("iter", e, w.tolist())
                flor.log("w", w.sum())

        stage(1.0, 3)
        print("after stage 1", w.tolist())
        stage(100.0, 3)
        print("final", w.tolist())
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    edit(os.path.join(d, "s.py"), 'print("after stage 1"', 'flor.log("mid", w.sum())')
    replay_matches_plain(d, "s.py")
    st = store(d)
    assert [v for _, _, v in values(st, runs(st, "replay")[-1]["run_id"], "mid")] == [6.0]


def test_block_occurrences_survive_a_restored_enclosing_block(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        x = torch.zeros(1)
        for e in flor.generator(range(2)):
            for j in range(2):
                if flor.SkipBlock.step_into("A"):
                    if flor.SkipBlock.step_into("B"):
                        x += 1
                    x = flor.SkipBlock.end(x)
                    x += 10
                x = flor.SkipBlock.end(x)
            print(e, x.item())
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    st = store(d)
    rec = runs(st, "record")[0]["run_id"]
    # Remove the checkpoint of A's second execution in epoch 0: replay runs
    # that A, and its B must restore B's own second-execution checkpoint.
    a1 = next(r["file"] for r in st.rows("decisions", rec)
              if r["block"] == "A" and r["occurrence"] == 1 and r["top_iter"] == 0)
    os.unlink(os.path.join(st.layout.ckpt_dir(rec), a1))
    replay_matches_plain(d, "s.py", jobs=("1",))


def test_changed_end_call_never_restores_old_checkpoints(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        x = torch.zeros(1); y = torch.zeros(1)
        for e in flor.generator(range(4)):
            if flor.SkipBlock.step_into("A"):
                x += 1; y += 100
            y, x = flor.SkipBlock.end(y, x)
            print(e, x.item(), y.item())
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    path = os.path.join(d, "s.py")
    for old, new in (("y, x = flor.SkipBlock.end(y, x)", "x, y = flor.SkipBlock.end(x, y)"),
                     ("x, y = flor.SkipBlock.end(x, y)", "x, y, z = flor.SkipBlock.end(x, y, 0)")):
        text = read(path)  # before open(path, "w") empties the file
        assert old in text
        with open(path, "w") as f:
            f.write(text.replace(old, new))
        rep = replay_matches_plain(d, "s.py")
        assert "end() changed for: A" in rep.stderr


def test_a_changed_helper_function_probes_the_block_that_calls_it(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        x = torch.zeros(1)

        def train_epoch(x):
            for b in range(3):
                x += 1

        for e in flor.generator(range(3)):
            if flor.SkipBlock.step_into("train"):
                train_epoch(x)
            x = flor.SkipBlock.end(x)
            print(e, x.item())
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    edit(os.path.join(d, "s.py"), "x += 1", 'flor.log("batch_x", x)')
    rep = replay_matches_plain(d, "s.py")
    assert "changed functions: train_epoch" in rep.stderr
    st = store(d)
    assert [v for _, _, v in values(st, runs(st, "replay")[-1]["run_id"], "batch_x")] == \
        [float(i) for i in range(1, 10)]


@pytest.mark.unit
def test_a_changed_function_defined_inside_an_if_probes_its_callers():
    """A helper defined under `if`/`try`/`with` at module level is a function
    of the program like any other: changing it probes the blocks calling it."""
    from flor.program.source import changed_functions, manual_blocks, map_files

    def probed(old, new):
        affected = changed_functions({"s.py": old}, {"s.py": new})
        files = map_files({"s.py": old}, {"s.py": new})
        return affected, manual_blocks({"s.py": old}, {"s.py": new}, files, affected)[0]

    old = textwrap.dedent("""
        import flor
        try:
            import fast_ops
        except ImportError:
            def step(x):
                return x + 1
        for e in flor.generator(range(3)):
            if flor.SkipBlock.step_into("train"):
                x = step(0)
            x = flor.SkipBlock.end(x)
    """)
    new = old.replace("return x + 1", "print(x)\n        return x + 1")
    affected, blocks = probed(old, new)
    assert "step" in affected
    assert blocks == {"train"}
    assert probed(old, old) == (set(), set())


def test_blocks_in_another_module_are_compared_too(tmp_path):
    d = str(tmp_path)
    write_script(d, "lib.py", """
        import flor

        def step(x):
            if flor.SkipBlock.step_into():
                x += 1
            x = flor.SkipBlock.end(x)
            flor.log("x", x * 100)
            return x
    """)
    write_script(d, "s.py", """
        import torch, flor, lib
        x = torch.zeros(1)
        for e in flor.generator(range(3)):
            x = lib.step(x)
            print(e, x.item())
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    edit(os.path.join(d, "lib.py"), "x += 1", 'flor.log("inside", x)')
    edit(os.path.join(d, "lib.py"), "def step(x):", "# a line that moves the rest down")
    rep = replay_matches_plain(d, "s.py")
    assert "stepping into changed blocks: lib.py:" in rep.stderr
    st = store(d)
    r = runs(st, "replay")[-1]["run_id"]
    assert [v for _, _, v in values(st, r, "inside")] == [1.0, 2.0, 3.0]
    assert "3 logged values" in rep.stderr  # the moved x * 100 log, compared


def test_module_training_mode_is_restored(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        from torch import nn
        torch.manual_seed(0); torch.set_num_threads(1)
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 4); y = torch.randn(16, 1)
        for e in flor.generator(range(3)):
            if flor.SkipBlock.step_into("train"):
                model.train()
                for _ in range(5):
                    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()
            model, opt = flor.SkipBlock.end(model, opt)
            flor.log("train_loss", nn.functional.mse_loss(model(x), y))  # still in train()
            model.eval()
            print(e, round(model(x).sum().item(), 6))
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    replay_matches_plain(d, "s.py")


def test_a_modules_counter_outside_its_state_dict_is_restored(tmp_path):
    """The module's forward() counts its training steps and decays a rate
    in attributes (as an EMA or a warm-up schedule does), in another module
    of the project, where flor sees no assignment: a skipped block restores
    them with the weights, and so does an iteration checkpoint."""
    d = str(tmp_path)
    write_script(d, "netlib.py", """
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 1)
                self.updates, self.rate = 0, 1.0
            def forward(self, x):
                if self.training:
                    self.updates += 1
                    self.rate *= 0.9
                return self.fc(x) * (1 + 0.01 * self.updates) * self.rate
    """)
    write_script(d, "s.py", """
        import torch
        from netlib import Net
        torch.manual_seed(0); torch.set_num_threads(1)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        X, Y = torch.randn(32, 4), torch.randn(32, 1)
        for epoch in range(4):
            for i in range(0, 32, 8):
                loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
            print(epoch, model.updates, round(model.rate, 6), round(loss.item(), 6))
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    edit(f"{d}/s.py", "    print(epoch", '    print("w", round(model.fc.weight.sum().item(), 6))',
         after=False)
    replay_matches_plain(d, "s.py", env={"FLOR_SEGMENTS": "2"})


def test_an_explicit_generator_passed_to_end_is_restored_in_place(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        from torch.utils.data import DataLoader, TensorDataset
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        loader = DataLoader(TensorDataset(torch.arange(8.).unsqueeze(1)), batch_size=2,
                            shuffle=True, generator=g)
        w = torch.zeros(1)
        for e in flor.generator(range(4)):
            if flor.SkipBlock.step_into("train"):
                for i, (xb,) in enumerate(loader):
                    w += xb[0] * (i + 1)
            w, g = flor.SkipBlock.end(w, g)
            print(e, w.item())
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    edit(os.path.join(d, "s.py"), "w += xb[0]", 'flor.log("first", xb[0])')
    replay_matches_plain(d, "s.py")


def test_values_logged_before_and_after_the_main_loop(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import torch, flor
        w = torch.zeros(1)

        def report(tag):
            flor.log("w", w.sum())
            print(tag, w.item())

        report("before")
        for e in flor.generator(range(3)):
            if flor.SkipBlock.step_into("train"):
                w += 1
            w = flor.SkipBlock.end(w)
        report("after")
    """)
    flor(d, "record", "--no-adaptive", "s.py")
    rep = replay_matches_plain(d, "s.py")
    assert "2 logged values" in rep.stderr


def test_missing_and_different_values_fail_the_check(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import os, torch, flor
        for e in flor.generator(range(3)):
            if os.environ.get("SKIP") != "1": flor.log("kept", e)
            flor.log("v", e * float(os.environ.get("SCALE", "1")))
    """)
    flor(d, "record", "s.py")
    warn = flor(d, "replay", "s.py", env={"SKIP": "1", "SCALE": "2"})
    assert warn.returncode == 0
    assert "deferred checks FAILED: of 6 values the record logged, printed or fingerprinted, " \
        "2 differ and 3 were not logged again" in warn.stderr
    assert "s.py:3 'kept' at iteration 0 of the loop at s.py:2: recorded 0, not logged " \
        "by the replay" in warn.stderr
    assert "s.py:4 'v' at iteration 1 of the loop at s.py:2: recorded 1.0, replayed 2.0" \
        in warn.stderr
    strict = flor(d, "replay", "--check", "strict", "s.py", env={"SKIP": "1"}, check=False)
    assert strict.returncode == 1


def test_an_edited_main_loop_line_is_still_the_main_loop(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import sys, torch, flor
        x = torch.zeros(1)

        def epochs(n):
            for e in range(n):
                print(f"== fetching epoch {e}")
                yield e

        print("start")
        for e in flor.generator(epochs(4)):
            if flor.SkipBlock.step_into("A"):
                x += 1
                flor.log("x", x)
            x = flor.SkipBlock.end(x)
            print(e, x.item())
            print(f"stderr epoch {e}", file=sys.stderr)
        print("end")
        with open("side.txt", "a") as f:
            f.write("epilogue ran\\n")
    """)
    # One torch thread, so that two workers fit on two cores.
    flor(d, "record", "--no-adaptive", "s.py", env={"OMP_NUM_THREADS": "1"})
    os.unlink(os.path.join(d, "side.txt"))
    path = os.path.join(d, "s.py")
    text = read(path).replace("for e in flor.generator(epochs(4)):",
                              "for e in flor.generator(epochs(4)):  # the main loop")
    with open(path, "w") as f:
        f.write(text)
    edit(path, "x += 1", 'print("probe", e)')
    rep = flor(d, "replay", "--jobs", "2", "s.py", env={"FLOR_SEGMENTS": "2"})
    # Two segments: the edited line still names the main loop.
    assert "4 iterations in segments [0, 2), [2, 4)" in rep.stderr, rep.stderr
    # The code after the main loop ran once: in the worker with the last segment.
    assert read(os.path.join(d, "side.txt")).count("epilogue ran") == 1
    assert rep.stdout == plain(d, "s.py").stdout
    assert rep.stdout.count("== fetching epoch 0") == 1
    epochs = [line for line in rep.stderr.splitlines() if line.startswith("stderr epoch")]
    assert epochs == [f"stderr epoch {e}" for e in range(4)]


def test_flor_options_before_the_script_leave_its_own_alone(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import argparse, flor
        p = argparse.ArgumentParser()
        p.add_argument("--jobs", type=int, default=1)
        p.add_argument("--n", type=int, default=2)
        a = p.parse_args()
        print("script jobs =", a.jobs)
        for e in flor.generator(range(a.n)):
            if flor.SkipBlock.step_into("A"):
                pass
            flor.SkipBlock.end()
    """)
    flor(d, "record", "s.py", "--n", "2", "--jobs", "8")
    rep = flor(d, "replay", "--jobs", "1", "s.py", "--n", "2", "--jobs", "8")
    assert rep.stdout.startswith("script jobs = 8")
    assert "arguments differ" not in rep.stderr
    rep = flor(d, "replay", "s.py", "--", "--n", "2", "--jobs", "8")
    assert rep.stdout.startswith("script jobs = 8")


def test_binary_writes_to_stdout_are_captured(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        import sys, flor
        for e in flor.generator(range(2)):
            flor.log("e", e)
            sys.stdout.buffer.write(b"raw bytes\\n")
            sys.stdout.buffer.flush()
    """)
    rec = flor(d, "record", "s.py")
    assert rec.stdout == "raw bytes\n" * 2
    rep = flor(d, "replay", "s.py")
    assert rep.stdout == rec.stdout


def test_a_crashed_run_is_recorded_as_failed(tmp_path):
    import subprocess
    import sys

    d = str(tmp_path)
    write_script(d, "s.py", """
        import os, flor
        for e in flor.generator(range(3)):
            flor.log("v", e * 10)
            if e == 1 and os.environ.get("CRASH"):
                raise RuntimeError("a crash")  # (Ctrl-C leaves a run interrupted instead)
    """)
    flor(d, "record", "s.py")
    env = dict(os.environ, FLOR_DIR=os.path.join(d, ".flor"), CRASH="1")
    direct = subprocess.run([sys.executable, "s.py"], cwd=d, env=env, capture_output=True,
                            text=True, timeout=120)
    assert direct.returncode != 0
    rows = Store(os.path.join(d, ".flor")).runs()
    assert [r["status"] for r in rows] == ["finished", "failed"]
    assert "RuntimeError('a crash')" in rows[-1]["info"].error
    rep = flor(d, "replay", "s.py")
    assert f"the latest record of s.py, run {rows[-1]['run_id']}, failed; replaying run " \
        f"{rows[0]['run_id']}" in rep.stderr


@pytest.mark.unit
def test_store_writes_are_transactions(tmp_path):
    st = Store(str(tmp_path / ".flor"))
    try:
        with st.transaction():
            st.db.execute("INSERT INTO parts VALUES ('r', 0, 'x', 0, '{}')")
            raise RuntimeError("interrupted")
    except RuntimeError:
        pass
    assert st.rows("parts", "r") == []
    st.add_blockruns([("r", 0, "main", "b", "[]", 0, "skip")] * 3)
    assert len(st.rows("blockruns", "r")) == 3
    assert block_stats(st, "r", "b") == {"n": 0, "skips": 0, "steps": 0, "restores": 0}
