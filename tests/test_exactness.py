"""Exactness at every segment boundary, differentially: each script (the
hands-free and manual-API test scripts, and the loop shapes that once gave
wrong values in parallel replay, tests/loop_shapes.py) is recorded, then
replayed twice with its main loop split into segments of two iterations,
which start at the odd iterations in one replay (two workers) and at the
even ones in the other (three workers), the boundaries forced through
FLOR_SEGMENTS.  Every replay must print what a plain run prints, its
deferred checks (state fingerprints included) must pass, and every segment
that starts from an iteration checkpoint must verify all it puts back."""
import os
import shutil

import pytest

import loop_shapes
from conftest import ROOT, flor, plain, runs, store, write_script

SCRIPTS = os.path.join(ROOT, "tests", "scripts")
# script -> (arguments, files it needs beside it)
FILES = {
    "handsfree/digits_epochs.py": (["4"], []),
    "handsfree/early_stop.py": ([], []),
    "handsfree/functions.py": ([], []),
    "handsfree/main_argparse.py": (["--epochs", "3"], []),
    "handsfree/module_level.py": ([], []),
    "handsfree/outputs.py": (["--epochs", "4"], []),
    "handsfree/scheduler_dropout.py": ([], []),
    "handsfree/idioms/closure.py": ([], []),
    "handsfree/idioms/globals_in_main.py": ([], []),
    "handsfree/idioms/inplace_weight.py": ([], []),
    "handsfree/idioms/manual_sgd.py": ([], []),
    "handsfree/idioms/reads_loop_variable.py": ([], []),
    "handsfree/idioms/trainer_class.py": ([], []),
    "handsfree/idioms/warmup_counter.py": ([], []),
    "counted.py": ([], ["counting.py"]),
    "nested.py": ([], []),
    "whileloop.py": ([], []),
}
SHAPES = {
    "header_rebound": loop_shapes.HEADER_REBOUND,
    "callback_loop": loop_shapes.CALLBACK,
    "infinite_loader": loop_shapes.INFINITE_LOADER.replace("step >= 60", "step >= 5"),
    "iterator_in_block": loop_shapes.ITERATOR_IN_BLOCK,
    "tuple_targets": loop_shapes.TUPLE_TARGETS,
    "while_rebinds_its_condition": loop_shapes.WHILE_REBINDS_ITS_CONDITION,
    "generator_loader": loop_shapes.GENERATOR_LOADER,
    "loop_variable_after": loop_shapes.LOOP_VARIABLE_AFTER,
    "read_by_a_function": loop_shapes.READ_BY_A_FUNCTION,
    "sometimes_assigned": loop_shapes.SOMETIMES_ASSIGNED,
    "iterator_each_epoch": loop_shapes.ITERATOR_EACH_EPOCH,
    "sliced_generator": loop_shapes.SLICED_GENERATOR,
    "list_of_batches": loop_shapes.LIST_OF_BATCHES,
    "generator_main_loop": loop_shapes.GENERATOR_MAIN_LOOP,
    "gradient_accumulation": loop_shapes.GRADIENT_ACCUMULATION,
    "gradient_window": loop_shapes.GRADIENT_WINDOW,
    "gradient_accumulation_manual": loop_shapes.GRADIENT_ACCUMULATION_MANUAL,
}


def _setup(d, case):
    if case in SHAPES:
        if case == "callback_loop":
            write_script(d, "mylib.py", loop_shapes.TRAINER)
        write_script(d, "train.py", SHAPES[case])
        return []
    args, extra = FILES[case]
    shutil.copy(os.path.join(SCRIPTS, case), os.path.join(d, "train.py"))
    for f in extra:
        shutil.copy(os.path.join(SCRIPTS, f), os.path.join(d, f))
    return args


@pytest.mark.differential
@pytest.mark.parametrize("case", sorted(FILES) + sorted(SHAPES))
def test_every_segment_boundary_replays_exactly(tmp_path, case):
    d = str(tmp_path)
    args = _setup(d, case)
    flor(d, "record", "--no-adaptive", "train.py", *args)
    expected = plain(d, "train.py", *args).stdout
    n = runs(store(d), "record")[0]["iterations"]
    assert n >= 3, n
    # Two replays start a segment at every boundary between them: at the odd
    # iterations on two workers, at the even ones on three.  Each segment
    # but the first starts from its iteration checkpoint and replays on for
    # two iterations (one where the loop ends), its state checked as it goes.
    splits = [(2, ",".join(str(b) for b in range(1, n, 2))),
              (3, ",".join(str(b) for b in range(2, n, 2)))]
    for jobs, starts in splits:
        rep = flor(d, "replay", "--jobs", str(jobs), "--check", "strict", "train.py", *args,
                   env={"FLOR_SEGMENTS": starts})
        assert rep.stdout == expected, (starts, rep.stderr)
        assert "deferred checks passed" in rep.stderr, (starts, rep.stderr)
        assert f"replay: {n}/{n} iterations, " in rep.stderr, rep.stderr
        # Every segment that started from an iteration checkpoint verified all it put back.
        assert "ran again from its start" not in rep.stderr, (starts, rep.stderr)
        assert "could not verify" not in rep.stderr, (starts, rep.stderr)
