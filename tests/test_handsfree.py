"""Hands-free mode end to end: unmodified scripts recorded with
`python -m flor record`, then replayed after adding hindsight statements.

Each script in tests/scripts/handsfree is recorded once; then a statement is
added inside its inner (training) loop, and, separately, one in its epoch
loop.  Every replay must print exactly what a plain `python` run of the
edited script prints, and its deferred checks must pass."""
import json
import os
import re
import shutil

import pytest

from conftest import ROOT, block_stats, edit, flor, plain, read, runs, store, values, write_script

HF = os.path.join(ROOT, "tests", "scripts", "handsfree")

GRAD = 'print(f"  grad {%s[0].weight.grad.norm().item():.6f}")'
WSUM = 'print(f"  wsum {%s[0].weight.sum().item():.6f}")'

# script, args, (inner anchor, statement), (epoch anchor, statement, after)
CASES = {
    "module_level.py": ([], ("loss.backward()", GRAD % "net"),
                        ("acc = (net(X)", WSUM % "net", True)),
    "main_argparse.py": (["--epochs", "3"], ("loss.backward()", GRAD % "model"),
                         ("best = max(best, acc)", WSUM % "model", True)),
    "functions.py": ([], ("loss.backward()", GRAD % "model"),
                     ("val_acc = evaluate(", WSUM % "net", True)),
    "early_stop.py": ([], ("loss.backward()", 'print(f"  loss {loss.item():.6f}")'),
                      ("epoch += 1", WSUM % "model", False)),
    "scheduler_dropout.py": ([], ("loss.backward()", GRAD % "net"),
                             ("sched.step()", 'print(f"  lr {opt.param_groups[0][\'lr\']:.6f}")',
                              True)),
}


def _printed_by(stmt, output):
    """The lines of `output` that the print statement `stmt` wrote."""
    prefix = re.match(r'print\(f"([^{]*)\{', stmt).group(1)
    return [l for l in output.splitlines() if l.startswith(prefix)]


def _line_of(path, text):
    return next(i for i, l in enumerate(read(path).splitlines(), 1) if l.strip() == text)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hands_free_record_and_hindsight_replay(tmp_path, name):
    args, (inner_at, inner), (epoch_at, epoch_stmt, after) = CASES[name]
    d = str(tmp_path)
    path = os.path.join(d, name)
    shutil.copy(os.path.join(HF, name), path)
    original = read(path)
    assert "flor" not in original

    # Every block checkpointed, whatever the rule would decide on this
    # machine: what is skipped below must not depend on its timings.
    rec = flor(d, "record", "--no-adaptive", name, *args)
    assert rec.stdout == plain(d, name, *args).stdout
    st = store(d)
    (run,) = runs(st, "record")
    assert run["info"].hands_free is True
    assert os.path.isfile(os.path.join(st.layout.run_dir(run["run_id"]), "instrumented.py"))
    summary = json.loads(read(os.path.join(st.layout.run_dir(run["run_id"]), "handsfree.json")))
    assert summary["blocks"], summary

    # A statement in the inner loop: its block is stepped into, in 2 workers.
    edit(path, inner_at, inner)
    want = plain(d, name, *args).stdout
    assert "grad" in want or "  loss" in want
    rep = flor(d, "replay", "--jobs", "2", name, *args)
    assert rep.stdout == want
    assert "stepping into changed blocks" in rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr
    assert "WARNING" not in rep.stderr
    replay_id = runs(st, "replay")[-1]["run_id"]
    line = _line_of(path, inner)
    stored = values(st, replay_id, f"stdout@{name}:new:{line}")
    assert [v for _, _, v in stored] == _printed_by(inner, want)

    # A statement in the epoch loop: every block is skipped (restored).
    with open(path, "w") as f:
        f.write(original)
    edit(path, epoch_at, epoch_stmt, after=after)
    want = plain(d, name, *args).stdout
    rep = flor(d, "replay", name, *args)
    assert rep.stdout == want
    assert "no block changed: every block is skipped" in rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr
    replay_id = runs(st, "replay")[-1]["run_id"]
    for b in summary["blocks"]:  # each block checkpointed at every run of it: each run skipped
        replayed, recorded = block_stats(st, replay_id, b["key"]), block_stats(st, run["run_id"], b["key"])
        assert replayed["skips"] == recorded["n"] >= 1 and replayed["n"] == 0, \
            (b["key"], replayed, recorded)
    line = _line_of(path, epoch_stmt)
    stored = values(st, replay_id, f"stdout@{name}:new:{line}")
    assert [v for _, _, v in stored] == _printed_by(epoch_stmt, want)


def test_state_the_analysis_cannot_see_is_reported(tmp_path, monkeypatch):
    """A module-level counter changed by a helper of another module is not in
    the block's side-effect set: the deferred checks must say so."""
    # The helper module stands for one flor does not analyse (an installed
    # library's): the project is the script alone.
    monkeypatch.setenv("FLOR_PROJECT_ROOT", "none")
    d = str(tmp_path)
    write_script(d, "helpers.py", """
        COUNT = 0


        def bump():
            global COUNT
            COUNT += 1
    """)
    write_script(d, "train.py", """
        import torch
        import helpers

        w = torch.zeros(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for epoch in range(3):
            for step in range(4):
                opt.zero_grad()
                loss = ((w - 1) ** 2).sum()
                loss.backward()
                opt.step()
                helpers.bump()
            print(f"epoch {epoch} steps {helpers.COUNT} w {w.sum().item():.6f}")
    """)
    # Every epoch's block restored, whatever the rule would decide here.
    flor(d, "record", "--no-adaptive", "train.py")
    warn = flor(d, "replay", "train.py")
    assert warn.returncode == 0
    assert "deferred checks FAILED" in warn.stderr
    assert ("train.py:13 (printed) at iteration 1 of the loop at train.py:6: recorded "
            "'epoch 1 steps 8 w 2.496684', replayed 'epoch 1 steps 0 w 2.496684'") in warn.stderr
    assert ("likely cause (train.py:13): the side-effect set of the block at train.py:7 may "
            "be missing `helpers.COUNT`") in warn.stderr
    strict = flor(d, "replay", "--check=strict", "train.py", check=False)
    assert strict.returncode == 1 and "deferred checks FAILED" in strict.stderr


def test_other_changes_warn_and_strict_refuses(tmp_path):
    d = str(tmp_path)
    shutil.copy(os.path.join(HF, "module_level.py"), os.path.join(d, "train.py"))
    flor(d, "record", "train.py")
    path = os.path.join(d, "train.py")
    text = read(path).replace("lr=0.2", "lr=0.25")
    with open(path, "w") as f:
        f.write(text)
    edit(path, "loss.backward()", "print(loss.item())")
    strict = flor(d, "replay", "--strict", "train.py", check=False)
    assert strict.returncode == 2
    assert "--strict: the script changed in ways other than hindsight statements" in strict.stderr
    assert "line 12: changed: opt = torch.optim.SGD(net.parameters(), lr=0.25" in strict.stderr
    assert not runs(store(d), "replay")
    warn = flor(d, "replay", "train.py")
    assert "WARNING: the script changed in ways other than hindsight statements" in warn.stderr
    assert "hindsight statement at line 21: print(loss.item())" in warn.stderr
    # The values differ because of the change, and the likely cause names it
    # first (it blamed nondeterminism outside flor's blocks alone).
    assert "deferred checks FAILED" in warn.stderr, warn.stderr
    assert ("likely cause: the script changed in ways other than hindsight statements (line "
            "12, listed above): where such a change alters what the training computes, a "
            "plain run of the edited script differs from the record too") in warn.stderr, \
        warn.stderr


def test_probes_written_with_helper_lines_and_guards_replay_under_strict(tmp_path):
    """A probe as people write it: a helper function and a helper line
    whose new names only added prints read, behind an `if` every few steps;
    and a per-layer loop at the epoch's end.  --strict accepts them, and the
    replay prints what a plain run of the edited script prints."""
    d = str(tmp_path)
    shutil.copy(os.path.join(HF, "module_level.py"), os.path.join(d, "train.py"))
    flor(d, "record", "train.py")
    path = os.path.join(d, "train.py")
    text = read(path).replace("seen = 0\n", (
        "seen = 0\n"
        "def grad_norm(model):\n"
        "    total = 0.0\n"
        "    for p in model.parameters():\n"
        "        total += p.grad.norm().item() ** 2\n"
        "    return total ** 0.5\n"))
    with open(path, "w") as f:
        f.write(text)
    edit(path, "loss.backward()", "if i % 128 == 0:")
    edit(path, "if i % 128 == 0:", "    gn = grad_norm(net)")
    edit(path, "gn = grad_norm(net)", 'print(f"  gn {gn:.6f}")')
    edit(path, "acc = (net(X)", "for name, w in net.named_parameters():")
    edit(path, "for name, w in net.named_parameters():", '    print(f"  {name} {w.norm().item():.6f}")')
    rep = flor(d, "replay", "--strict", "train.py")
    assert "WARNING" not in rep.stderr
    assert "hindsight statement at line 14: def grad_norm(model):" in rep.stderr
    assert "hindsight statement at line 27: gn = grad_norm(net)" in rep.stderr
    assert rep.stdout == plain(d, "train.py").stdout
    assert rep.stdout.count("  gn ") == 9 and rep.stdout.count("  0.weight ") == 3
    assert "deferred checks passed" in rep.stderr


def test_tracebacks_keep_the_users_line_numbers(tmp_path):
    d = str(tmp_path)
    write_script(d, "boom.py", """
        total = 0
        for epoch in range(3):
            for i in range(4):
                total += i
                if epoch == 1 and i == 2:
                    raise ValueError("bad batch")
    """)
    proc = flor(d, "record", "boom.py", check=False)
    assert proc.returncode == 1
    assert 'boom.py", line 6, in <module>' in proc.stderr
    assert 'raise ValueError("bad batch")' in proc.stderr
    assert "ValueError: bad batch" in proc.stderr


def test_flor_skip_comment_leaves_a_loop_alone(tmp_path):
    d = str(tmp_path)
    write_script(d, "s.py", """
        acc = []
        for epoch in range(3):
            for i in range(2):  # flor: skip
                acc.append(i)
            for j in range(2):
                acc.append(-j)
            print(len(acc))
    """)
    flor(d, "record", "s.py")
    st = store(d)
    (run,) = runs(st, "record")
    summary = json.loads(read(os.path.join(st.layout.run_dir(run["run_id"]), "handsfree.json")))
    assert [b["key"] for b in summary["blocks"]] == ["s.py:5"]
    assert summary["left_alone"] == [[3, "# flor: skip"]]
    rep = flor(d, "replay", "s.py")
    assert rep.stdout == "4\n8\n12\n" and "deferred checks passed" in rep.stderr


IDIOMS = os.path.join(HF, "idioms")
# script: (record options, replay options, anchor, added statement, after anchor)
IDIOM_CASES = {
    # the functions use module globals they never assign
    "globals_in_main.py": (["--no-adaptive"], [], "history.append(loss.item())",
                           'print("  loss", loss.item())', True),
    # the hindsight statement reads a variable the block had as loop-scoped
    "reads_loop_variable.py": (["--no-adaptive"], [], "sched.step()",
                               "print('  last loss', loss.item())",
                               False),
    # weights updated through the loop variable of model.parameters()
    "manual_sgd.py": (["--no-adaptive"], [], 'print(f"epoch {epoch} loss',
                      'print("  weight", model.weight.sum().item())', True),
    # a nested function changes the enclosing function's optimizer
    "closure.py": (["--no-adaptive"], [], "total = run_epoch()",
                   'print("  w", model.weight.sum().item())', True),
    # an augmented assignment to a parameter attribute, in place
    "inplace_weight.py": (["--no-adaptive"], [], 'print(f"epoch {epoch} loss',
                          'print("  w", model.weight.sum().item())', True),
    # a counter read before it is assigned in the block, two workers
    "warmup_counter.py": (["--no-adaptive"], ["--jobs", "2"], "step += 1",
                          'print("  batch", i, loss.item())', False),
    # a class attribute (directly and through a classmethod), a namespace's
    # attribute, and dicts changed through a local alias (by a constant key
    # and a variable one), in a function the block calls
    "shared_counters.py": (["--no-adaptive"], [], 'print(f"epoch {epoch} loss',
                           'print("  seen", Meter.updates, Meter.resets, CFG.examples, '
                           'STATS["batches"], PARITY)',
                           True),
    # a model made in the first training step (ema = copy.deepcopy(model)):
    # that execution's checkpoint cannot bind ema, so replay runs it
    "lazy_ema.py": (["--no-adaptive"], [], 'print(f"epoch',
                    'print("  w", round(float(model[0].weight.sum()), 6))', False),
    # optimizers stepped in comprehensions: the weights they change are state
    "comprehension_steps.py": (["--no-adaptive"], [], 'print(f"epoch',
                               'print("  w", round(models[0].weight.sum().item(), 6))', False),
    # the gradients the batch loop leaves, read after it by the hindsight
    # statement only: the record's checkpoints do not hold them, so the
    # block runs again, and no worker starts from an iteration checkpoint
    "grads_after_block.py": (["--no-adaptive"], ["--jobs", "2"], 'print(f"epoch',
                             'print(f"  grad {model[2].weight.grad.norm().item():.6f}")',
                             False),
    # a tensor attribute (no buffer) that the model's forward reassigns:
    # the checkpoints hold it with the module's int and float attributes
    "tensor_attribute.py": (["--no-adaptive"], [], 'print(f"epoch',
                            'print(f"  center {model.center.norm().item():.6f} '
                            'steps {model.steps}")', False),
    # forward hooks that keep statistics on the trainer (a bound method, a
    # lambda, a closure a factory makes): what they change is state of the
    # blocks that call the model, two workers
    "forward_hooks.py": (["--no-adaptive"], ["--jobs", "2"], 'print(f"epoch',
                         'print(f"  w {self.model[2].weight.norm().item():.6f}")', False),
    # a trainer class of the script: the block changes self through a method
    "trainer_class.py": (["--no-adaptive"], [], "self.log.append(total)",
                         'print("  w", self.model.weight.sum().item())', True),
}


@pytest.mark.parametrize("name", sorted(IDIOM_CASES))
def test_training_idioms_replay_like_a_plain_run(tmp_path, name):
    """Idioms a review found mishandled: each replay must print what a plain
    run of the edited script prints, with the deferred checks passing."""
    rec_opts, rep_opts, anchor, stmt, after = IDIOM_CASES[name]
    d = str(tmp_path)
    path = os.path.join(d, "train.py")
    shutil.copy(os.path.join(IDIOMS, name), path)
    rec = flor(d, "record", *rec_opts, "train.py")
    assert rec.stdout == plain(d, "train.py").stdout
    edit(path, anchor, stmt, after=after)
    want = plain(d, "train.py").stdout
    rep = flor(d, "replay", *rep_opts, "train.py")
    assert rep.stdout == want
    assert "deferred checks passed" in rep.stderr, rep.stderr


def test_forced_segments_never_pass_over_a_block_whose_gradients_are_now_read(tmp_path):
    """The FLOR_SEGMENTS seam bypasses the planner: a segment start that
    would restore, to pass over it, a block whose gradients the hindsight
    statement now reads (its checkpoints do not hold them) is refused with
    a message naming the seam (the worker crashed on grad None)."""
    d = str(tmp_path)
    path = os.path.join(d, "train.py")
    shutil.copy(os.path.join(IDIOMS, "grads_after_block.py"), path)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(path, 'print(f"epoch', 'print(f"  grad {model[2].weight.grad.norm().item():.6f}")',
         after=False)
    rep = flor(d, "replay", "--jobs", "2", "train.py", check=False,
               env={"FLOR_ALL_JOBS": "1", "FLOR_SEGMENTS": "2"})
    assert rep.returncode == 2, rep.stderr
    assert "FLOR_SEGMENTS: a segment cannot start at iteration 2" in rep.stderr, rep.stderr
    assert "Traceback" not in rep.stderr and rep.stdout == ""


@pytest.mark.parametrize("name, probe", [
    ("aliased_state.py", 'print("  best", self.best_state["weight"].sum().item(), '
                         'w.sum().item(), views[0].sum().item())'),
    ("aliased_globals.py", 'print("  w", model.weight.sum().item(), '
                           'best["weight"].sum().item() if best else None)')])
def test_tensors_that_share_the_weights_memory_follow_them_after_a_restore(tmp_path, name,
                                                                          probe):
    """best_state = model.state_dict() (no copy), w = model.weight.data in
    the batch loop, and views of it kept in a list (by a trainer, and at
    the top level) follow the weights as they train.  A restore put them
    back as copies, which stopped following the live weights: replays
    printed other values than the plain run, with the checks passing."""
    d = str(tmp_path)
    path = os.path.join(d, "train.py")
    shutil.copy(os.path.join(IDIOMS, name), path)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(path, 'print(f"epoch', probe, after=False)
    want = plain(d, "train.py").stdout
    for opts, env in (([], None), (["--jobs", "2"], {"FLOR_ALL_JOBS": "1", "FLOR_SEGMENTS": "3"})):
        rep = flor(d, "replay", *opts, "train.py", env=env)
        assert rep.stdout == want, (opts, rep.stdout, want)
        assert "deferred checks passed" in rep.stderr, rep.stderr


def test_a_list_shuffled_in_place_is_carried_to_a_later_segment(tmp_path):
    """The training function shuffles the epoch's order in place
    (random.shuffle(order)): the main loop carries the list, so a worker
    that starts from an iteration checkpoint trains on the recorded order
    (it used the order of the script's start: other values, checks failing)."""
    d = str(tmp_path)
    path = os.path.join(d, "train.py")
    shutil.copy(os.path.join(IDIOMS, "shuffled_order.py"), path)
    flor(d, "record", "--no-adaptive", "train.py")
    edit(path, "total += loss.item()", 'print(f"  batch {i} {loss.item():.6f}")', after=True)
    want = plain(d, "train.py").stdout
    rep = flor(d, "replay", "--jobs", "2", "train.py",
               env={"FLOR_ALL_JOBS": "1", "FLOR_SEGMENTS": "3"})
    assert "in segments [0, 3), [3, 6)" in rep.stderr, rep.stderr
    assert rep.stdout == want
    assert "deferred checks passed" in rep.stderr, rep.stderr


def test_a_gan_kept_in_dicts_resumes_a_worker_from_an_iteration_checkpoint(tmp_path):
    """Models called as items of a dict (models["G"](z)) whose forward
    counts its calls, and a loop variable (m) that names one of them: a
    restored block keeps the counter, and the second worker restores and
    verifies the iteration checkpoint (m names the restored model again)."""
    d = str(tmp_path)
    path = os.path.join(d, "train.py")
    shutil.copy(os.path.join(IDIOMS, "gan_dict.py"), path)
    rec = flor(d, "record", "--no-adaptive", "train.py")
    assert rec.stdout == plain(d, "train.py").stdout
    edit(path, "lg.backward()", 'print("  lg", round(lg.item(), 6))', after=True)
    want = plain(d, "train.py").stdout
    rep = flor(d, "replay", "--jobs", "2", "train.py",
               env={"FLOR_SEGMENTS": "2", "FLOR_ALL_JOBS": "1"})
    assert rep.stdout == want
    assert "deferred checks passed" in rep.stderr, rep.stderr
    st = store(d)
    parts = st.parts(runs(st, "replay")[-1]["run_id"])
    assert [p["info"].resumed_from is not None for p in parts] == [False, True], rep.stderr


def test_a_hands_free_script_gets_the_globals_plain_python_gives_it(tmp_path):
    # dir(__builtins__) is the builtins module's names under plain python,
    # a dict's methods if flor ran the script with the builtins dict.
    d = str(tmp_path)
    write_script(d, "globs.py", (
        "import random\n"
        "print(type(__builtins__).__name__, len(dir(__builtins__)) > 100)\n"
        "print(__name__, __package__, __spec__, __cached__, type(__loader__).__name__)\n"
        "print(sorted(k for k in globals() if k.startswith('__') and k != '__flor__'))\n"
        "random.seed(len(dir(__builtins__)))\n"
        "w = 0.0\n"
        "for epoch in range(3):\n"
        "    for step in range(4):\n"
        "        w += random.random()\n"
        "    print(epoch, round(w, 6))\n"))
    want = plain(d, "globs.py").stdout
    assert want.startswith("module True\n__main__ None None None SourceFileLoader\n"), want
    assert flor(d, "record", "globs.py").stdout == want
    assert flor(d, "replay", "globs.py").stdout == want
