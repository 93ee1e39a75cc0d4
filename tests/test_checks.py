"""Deferred checks that cannot pass vacuously: state fingerprints catch a
wrong replay even when the script prints nothing, a check that compared
nothing says so, and lines that differ only where they read the clock are
set apart."""
import json
import os

import pytest

from conftest import edit, flor, plain, read, runs, store, write_script

ACCUM = """
    import torch
    import helpers
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X = torch.randn(32, 4)
    Y = X.sum(1, keepdim=True)
    for it in range(4):
        for micro in range(2):
            part = slice(16 * micro, 16 * (micro + 1))
            loss = ((model(X[part]) - Y[part]) ** 2).mean()
            loss.backward()
        helpers.apply(opt)
"""


def _accum_stepping_elsewhere(d):
    """ACCUM, with the optimizer stepped in another module."""
    write_script(d, "helpers.py", """
        def apply(opt):
            opt.step()
            opt.zero_grad()
    """)
    write_script(d, "accum.py", ACCUM)


def test_fingerprints_catch_gradients_the_analysis_could_not_see(tmp_path, monkeypatch):
    """The optimizer steps in another module, so the analysis takes the
    micro-step block's gradients for dead and does not checkpoint them:
    replay restores the block, the step finds no gradients, and the model
    stops training.  Nothing is printed, yet the checks fail and name the
    block."""
    # The helper module stands for one flor does not analyse (an installed
    # library's): the project is the script alone.
    monkeypatch.setenv("FLOR_PROJECT_ROOT", "none")
    d = str(tmp_path)
    _accum_stepping_elsewhere(d)
    rec = flor(d, "record", "--no-adaptive", "accum.py")
    assert rec.stdout == ""
    edit(os.path.join(d, "accum.py"), "helpers.apply(opt)", 'print("iteration", it)')
    rep = flor(d, "replay", "accum.py")
    assert rep.stdout == plain(d, "accum.py").stdout  # the printed lines are right...
    assert "deferred checks FAILED" in rep.stderr, rep.stderr  # ...the state is not
    assert ("  the state at the end of iteration 0 of the loop at accum.py:9 differs from "
            "the record's") in rep.stderr
    assert ("likely cause: the state at the end of iteration 0 of the loop at accum.py:9 "
            "differs from the record's, though every block that ran again in it ended as "
            "in record: the block restored in it (accum.py:10) may not hold everything it "
            "changes, such as gradients") in rep.stderr
    assert "random state" not in rep.stderr  # torch is seeded; numpy and random are unused
    assert "GPU" not in rep.stderr  # a CPU record


def test_a_gpu_record_without_deterministic_algorithms_is_named_as_a_cause(tmp_path, monkeypatch):
    """The record notes whether it ran CUDA kernels (tests/test_cuda.py
    checks that on a GPU) and whether torch was asked for deterministic
    algorithms; where values differ, the checks name an undeterministic
    GPU record and the two ways out.  Here a CPU record whose replay
    differs (the case above) is marked as such a record."""
    # The helper module stands for one flor does not analyse (an installed
    # library's): the project is the script alone.
    monkeypatch.setenv("FLOR_PROJECT_ROOT", "none")
    d = str(tmp_path)
    _accum_stepping_elsewhere(d)
    flor(d, "record", "--no-adaptive", "accum.py")
    st = store(d)
    rec = runs(st, "record")[0]
    info = rec["info"]
    assert info.cuda is False and info.deterministic is False
    info.cuda = True
    st.update_run(rec["run_id"], info=info)
    edit(os.path.join(d, "accum.py"), "helpers.apply(opt)", 'print("iteration", it)')
    rep = flor(d, "replay", "accum.py")
    assert "deferred checks FAILED" in rep.stderr, rep.stderr
    assert ("likely cause: the record ran on a GPU without deterministic algorithms"
            in rep.stderr), rep.stderr
    assert "--tolerance REL" in rep.stderr and "use_deterministic_algorithms(True)" in rep.stderr


def test_gradients_read_after_the_block_are_restored(tmp_path):
    d = str(tmp_path)
    write_script(d, "helpers.py", "")
    write_script(d, "accum.py", ACCUM.replace("helpers.apply(opt)",
                                              "opt.step()\n        opt.zero_grad()"))
    flor(d, "record", "--no-adaptive", "accum.py")
    edit(os.path.join(d, "accum.py"), "opt.zero_grad()", 'print(model.weight.sum().item())')
    rep = flor(d, "replay", "accum.py")
    assert rep.stdout == plain(d, "accum.py").stdout
    assert "deferred checks passed: 0 logged values and 4 state fingerprints" in rep.stderr


def test_a_check_that_compared_nothing_is_not_a_pass(tmp_path):
    d = str(tmp_path)
    write_script(d, "quiet.py", """
        total = 0
        for epoch in range(3):
            total += epoch
    """)
    flor(d, "record", "quiet.py")
    edit(os.path.join(d, "quiet.py"), "total += epoch", "print(total)")
    rep = flor(d, "replay", "quiet.py")
    assert "deferred checks compared nothing" in rep.stderr and "passed" not in rep.stderr
    assert flor(d, "replay", "--check", "strict", "quiet.py", check=False).returncode == 1


def test_fingerprints_left_uncompared_are_not_counted_as_compared(tmp_path):
    """Under --tolerance, the fingerprints of the blocks that ran again are
    not compared: a replay whose only values are those compared nothing."""
    d = str(tmp_path)
    write_script(d, "train.py", """
        import torch
        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(3):
            for i in range(2):
                opt.zero_grad()
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
    """)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(os.path.join(d, "train.py"), "opt.step()", 'print("step", i)')
    rep = flor(d, "replay", "--tolerance", "1e-6", "--check", "strict", "train.py", check=False)
    assert "state fingerprints were not compared (--tolerance)" in rep.stderr, rep.stderr
    assert "deferred checks compared nothing" in rep.stderr and rep.returncode == 1, rep.stderr


def test_lines_that_differ_only_where_they_read_the_clock_are_set_apart(tmp_path):
    d = str(tmp_path)
    write_script(d, "timed.py", """
        import time
        start = time.perf_counter()
        w = 0.0
        for epoch in range(3):
            for step in range(200):
                w += 0.001 * (1 - w)
            elapsed = time.perf_counter() - start
            print(f"epoch {epoch} elapsed {elapsed * 1000:.3f}ms")
            print(f"epoch {epoch} w {w:.6f}")
    """)
    flor(d, "record", "--no-adaptive", "timed.py")
    edit(os.path.join(d, "timed.py"), "elapsed = time", 'print("w", w)')
    rep = flor(d, "replay", "--check", "strict", "timed.py")
    assert ("deferred checks passed: 0 logged values and 3 printed lines of unchanged "
            "statements equal the record's; 3 printed lines differ only in fields that read "
            "the clock (not compared)") in rep.stderr, rep.stderr


def test_a_line_that_reads_the_clock_is_compared_in_its_other_fields(tmp_path, monkeypatch):
    """The replay is wrong (the optimizer steps in another module, so the
    restored block lacks the gradients) and the line that shows it also
    prints the time: its weight field is compared, only its time is not."""
    # The helper module stands for one flor does not analyse (an installed
    # library's): the project is the script alone.
    monkeypatch.setenv("FLOR_PROJECT_ROOT", "none")
    d = str(tmp_path)
    _accum_stepping_elsewhere(d)
    src = read(os.path.join(d, "accum.py")).replace(
        "import torch\n", "import time\nimport torch\nt0 = time.time()\n", 1)
    with open(os.path.join(d, "accum.py"), "w") as f:
        f.write(src + '    print(f"it {it} w {model.weight.sum().item():.6f} '
                      'time {time.time() - t0:.6f}")\n')
    flor(d, "record", "--no-adaptive", "accum.py")
    edit(os.path.join(d, "accum.py"), "helpers.apply(opt)", 'print("iteration", it)')
    rep = flor(d, "replay", "accum.py")
    assert "deferred checks FAILED" in rep.stderr, rep.stderr
    assert "(printed) at iteration 0 of the loop at accum.py:11: recorded 'it 0 w " \
        in rep.stderr, rep.stderr
    assert "differ only in fields that read the clock" not in rep.stderr, rep.stderr


@pytest.mark.unit
def test_clock_fields_are_told_apart_in_print_arguments_and_f_strings():
    import ast

    from flor.replay.clock import clock_fields_only as _clock_fields_only

    def clock_only(src, rec, rep):
        stmt = ast.parse(src).body[0]
        return _clock_fields_only(stmt, {"dt"}, json.dumps(rec), json.dumps(rep), 0.0)

    assert clock_only('print("loss", loss, "time", dt)', "loss 1.5 time 3.2", "loss 1.5 time 9.9")
    assert not clock_only('print("loss", loss, "time", dt)', "loss 1.5 time 3", "loss 1.6 time 9")
    assert clock_only('print(dt, loss, sep=", ")', "3.2, 1.5", "4.1, 1.5")
    assert clock_only('log.info(f"loss {loss:.2f} took {time.time() - t0:.1f}s")',
                      "loss 1.50 took 3.2s", "loss 1.50 took 4.0s")
    assert not clock_only('log.info(f"loss {loss:.2f} took {time.time() - t0:.1f}s")',
                          "loss 1.50 took 3.2s", "loss 1.51 took 3.2s")
    # str.format and % (the PyTorch examples' own lines)
    fmt = 'print("| epoch {:3d} | time: {:5.2f}s | loss {:5.2f}".format(epoch, dt, loss))'
    assert clock_only(fmt, "| epoch   1 | time:  0.29s | loss  5.51",
                      "| epoch   1 | time:  0.01s | loss  5.51")
    assert not clock_only(fmt, "| epoch   1 | time:  0.29s | loss  5.51",
                          "| epoch   1 | time:  0.29s | loss  5.52")
    assert clock_only('print("loss %.2f time %.1f%%" % (loss, dt))',
                      "loss 1.50 time 3.2%", "loss 1.50 time 4.0%")
    assert not clock_only('print("loss %.2f time %.1f" % (loss, dt))',
                          "loss 1.50 time 3.2", "loss 1.51 time 3.2")
    # Padded fields, logger arguments, + of strings; a value that differs
    # beside a clock field never shifts into it.
    line = 'print(f"{epoch:5d} {last:.4f} {time.time() - t0:.2f}")'
    assert not clock_only(line, "    3 0.7793 0.00", "    3 0.0000 0.00")
    assert clock_only(line, "    3 0.7793 0.01", "    3 0.7793 2.50")
    assert clock_only('print("%5d %8.3f %8.4f" % (epoch, dt, loss))',
                      "    3    0.012   1.2345", "    3    0.020   1.2345")
    assert clock_only('log.info("epoch %d took %.2fms", epoch, dt)',
                      "epoch 3 took 1.20ms", "epoch 3 took 9.90ms")
    assert clock_only('print("epoch " + str(e) + " took " + str(time.time() - t0))',
                      "epoch 3 took 1.2", "epoch 3 took 9.9")
    assert not clock_only('print("epoch", e, "status", s, dt)', "epoch 3 status ok fine 1.2",
                          "epoch 3 status ok bad 9.9")
    # Fields it cannot tell apart: the line is compared whole.
    assert not clock_only('print(line(loss, dt))', "loss 1.50 time 3.2", "loss 1.50 time 4.0")
    assert not clock_only('print(line(loss, time.time()))', "loss 1.50 time 3.2",
                          "loss 1.50 time 4.0")
    assert clock_only('print("ms/batch", elapsed * 1000 / args.log_interval)',
                      "ms/batch 3.2", "ms/batch 4.0")


@pytest.mark.unit
def test_the_trainers_printed_speed_metrics_are_clock_fields():
    from flor.replay.clock import speed_metrics_only

    def only(rec, rep):
        return speed_metrics_only(json.dumps(rec), json.dumps(rep), 0.0)

    # As the Trainer prints its logs (values as strings), and as a script
    # prints the dict evaluate() returns.
    assert only("{'eval_loss': '2.3', 'eval_runtime': '0.2078', 'epoch': '1'}",
                "{'eval_loss': '2.3', 'eval_runtime': '0.2036', 'epoch': '1'}")
    assert only("{'train_runtime': 9.8, 'train_samples_per_second': 568.7, 'train_loss': 2.07}",
                "{'train_runtime': 0.9, 'train_samples_per_second': 6289.0, 'train_loss': 2.07}")
    # Any other value that differs, another key, or no speed metric: compared.
    assert not only("{'eval_loss': '2.3', 'eval_runtime': '0.2'}",
                    "{'eval_loss': '2.4', 'eval_runtime': '0.3'}")
    assert not only("{'eval_loss': '2.3', 'eval_runtime': '0.2'}",
                    "{'eval_loss': '2.3', 'eval_runtime': '0.3', 'x': 1}")
    assert not only("{'loss': 2.3, 'grad_norm': 0.6}", "{'loss': 2.3, 'grad_norm': 0.7}")
    assert not only("took 0.2 s", "took 0.3 s")


def test_large_logged_arrays_are_stored_as_files_and_compared(tmp_path):
    d = str(tmp_path)
    write_script(d, "acts.py", """
        import os
        import numpy as np
        import torch
        import flor
        torch.manual_seed(0)
        w = torch.randn(300, 300)
        for epoch in flor.generator(range(3)):
            if flor.SkipBlock.step_into("train"):
                w = w * 0.9 + 0.01
            w = flor.SkipBlock.end(w)
            flor.log("w", w * float(os.environ.get("SCALE", "1")))
            flor.log("h", np.full((40, 40), epoch, dtype=np.int16))
    """)
    flor(d, "record", "acts.py")
    st = store(d)
    rec = runs(st, "record")[0]["run_id"]
    files = sorted(os.listdir(os.path.join(st.layout.run_dir(rec), "values")))
    assert len(files) == 6 and all(f.endswith(".flor") for f in files)
    edit(os.path.join(d, "acts.py"), 'flor.log("h"', 'print(epoch)')
    rep = flor(d, "replay", "acts.py")
    assert "deferred checks passed: 6 logged values" in rep.stderr, rep.stderr
    bad = flor(d, "replay", "acts.py", env={"SCALE": "2"})
    assert ("'w' at iteration 1 of the loop at acts.py:7: recorded an array of float32 "
            "[300, 300], replayed an array of float32 [300, 300]") in bad.stderr, bad.stderr
    import flor as flor_api

    old, os.environ["FLOR_DIR"] = os.environ.get("FLOR_DIR"), os.path.join(d, ".flor")
    try:
        df = flor_api.dataframe("w", "h", run=rec)
    finally:
        os.environ["FLOR_DIR"] = old
    assert tuple(df["w"][0].shape) == (300, 300) and df["h"][2].dtype.name == "int16"
    assert int(df["h"][2].sum()) == 2 * 1600


BIG_STATE = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(2048, 2048)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(2, 2048)
    for warmup in range(1):
        for step in range(2):
            opt.zero_grad()
            model(x[step:step + 1]).square().mean().backward()
            opt.step()
    basis = torch.linalg.svd(torch.randn(2000, 2000))  # set-up between the loops
    for epoch in range(60):
        for step in range(2):
            opt.zero_grad()
            loss = model(x[step:step + 1]).square().mean()
            loss.backward()
            opt.step()
        print("epoch", epoch, round(loss.item(), 6))
"""


def _fingerprinted(st, run_id, loop="train.py:13"):
    return sorted(json.loads(r["iter"])[0] for r in st.logs(run_id)
                  if r["name"] == "state@iteration" and r["loc"] == loop)


def test_state_fingerprints_stay_within_the_records_overhead_budget(tmp_path):
    """A fingerprint reads all 32 MiB of the model and its momentum, a share
    of an iteration's time far above a quarter of the overhead bound
    (1/60): an adaptive record takes one at a loop's first iteration, then
    where it fits 1/60 of that loop's time since; the replay takes and
    compares those alone (none under --tolerance); --no-adaptive takes one
    at every iteration."""
    d = str(tmp_path)
    write_script(d, "train.py", BIG_STATE)
    flor(d, "record", "train.py")
    flor(d, "record", "--no-adaptive", "train.py")
    st = store(d)
    adaptive, every = (r["run_id"] for r in runs(st, "record"))
    sampled = _fingerprinted(st, adaptive)
    # Each loop has its own budget: neither the set-up nor the warm-up loop
    # before it earns the main loop fingerprints.
    assert sampled[0] == 0 and 1 not in sampled and len(sampled) < 30, sampled
    assert _fingerprinted(st, adaptive, "train.py:7") == [0]
    assert _fingerprinted(st, every) == list(range(60))
    edit(os.path.join(d, "train.py"), 'print("epoch"',
         'print("norm", round(model.weight.norm().item(), 4))', after=False)
    rep = flor(d, "replay", "--run", adaptive, "train.py")
    assert rep.stdout == plain(d, "train.py").stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr
    replay = runs(st, "replay")[-1]["run_id"]
    assert _fingerprinted(st, replay) == sampled  # only where the record has one
    assert _fingerprinted(st, replay, "train.py:7") == [0]
    taken = len(sampled) + 1  # and the warm-up loop's
    assert f"{taken} state fingerprints" in rep.stderr, rep.stderr
    rep = flor(d, "replay", "--run", adaptive, "--check", "strict", "--tolerance", "1e-6",
               "train.py")
    assert _fingerprinted(st, runs(st, "replay")[-1]["run_id"]) == []  # never compared...
    assert "deferred checks passed" in rep.stderr, rep.stderr  # ...nor missed
    assert f"{taken} state fingerprints were not compared (--tolerance)" in rep.stderr, \
        rep.stderr


@pytest.mark.unit
def test_an_attribute_set_from_the_clock_is_the_clocks_and_its_object_is_not():
    import ast

    from flor.replay.clock import clock_names, reads_clock

    lib = ast.parse("import time\n"
                    "class T:\n"
                    "    def step(self):\n"
                    "        tnow = time.time()\n"
                    "        self.iter_dt = tnow - self.iter_time\n"
                    "        self.iter_time = tnow\n"
                    "        self.loss = compute()\n")
    tainted = clock_names(lib)
    assert {".iter_dt", ".iter_time", "tnow"} <= tainted and "self" not in tainted

    def reads(src):
        return reads_clock(ast.parse(src).body[0], src, tainted)

    # The script prints what the module computed, through its own name.
    assert reads('print(f"iter_dt {trainer.iter_dt * 1000:.2f}ms")')
    assert not reads('print(f"loss {trainer.loss:.5f}")')
