"""The static side-effect analysis of hands-free mode (the Flor paper's
Table 2 rules, loop-scoped filtering, the script's own functions), probe
detection, and the deferred checks' value comparison, on small snippets."""
import ast
import re
import textwrap

import pytest

from flor.program.analysis import Script, block_effects
from flor.program.instrument import instrument, uses_flor
from flor.program.probe import detect, is_log_like
from flor.program.frameworks import EPOCH_END, unfollowed
from flor.program.source import changed_functions, changed_outside
from flor.replay.checks import equal

pytestmark = pytest.mark.unit  # in-process: `make check` runs these


def effects(src, after="print(everything_read_after)"):
    """Effects of the first loop nested in the last top-level loop of src."""
    tree = ast.parse(textwrap.dedent(src) + "\n" + after)
    main = [n for n in tree.body if isinstance(n, (ast.For, ast.While))][-1]
    block = next(n for n in main.body if isinstance(n, (ast.For, ast.While, ast.Expr,
                                                         ast.Assign)))
    return block_effects(Script(tree), [block], tree)


def test_rule_1_method_call_assignment_adds_receiver_and_targets():
    e = effects("""
        for ep in range(2):
            for x in data:
                out = model.forward(x)
        """, "print(out)")
    assert e.rules == {"model": 1, "out": 1, "x": 3}
    assert e.paths == ["model", "out"] and e.dropped == ["x"]
    assert e.assigned == {"out", "x"}


def test_rule_2_function_call_assignment_adds_only_targets():
    e = effects("""
        for ep in range(2):
            for x in data:
                y = transform(model, x)
        """, "print(y)")
    assert e.paths == ["y"] and e.rules["y"] == 2 and "model" not in e.rules


def test_library_calls_that_change_their_first_argument_in_place():
    """random.shuffle(order) (also from a function of the script, as a
    parameter), a numpy Generator's shuffle, heapq and bisect change their
    argument; a call that only reads it (sorted) changes nothing."""
    e = effects("""
        import bisect, heapq, random
        from random import shuffle
        def train_epoch(order):
            random.shuffle(order)
        for ep in range(2):
            for x in data:
                train_epoch(order)
                rng.shuffle(idx)
                shuffle(extra)
                heapq.heappush(best, x)
                bisect.insort(seen, x)
                sorted(kept)
                other.heappush(notheap, x)
                pri, b = heapq.heappop(queue)
        """, "print(order, idx, extra, best, seen, kept, notheap, rng, other, queue, pri, b)")
    assert {"order", "idx", "extra", "best", "seen", "rng", "other", "queue"} <= set(e.paths)
    assert "kept" not in e.paths and "notheap" not in e.paths


def test_rule_3_plain_assignment_and_augmented_assignment():
    e = effects("""
        total = 0
        for ep in range(2):
            for x in data:
                total += x
                stats["n"] = x
                hist[ep] = x
                self_like.best = x
        """, "print(total, stats, hist, self_like)")
    assert e.paths == ["total", "stats['n']", "hist", "self_like.best"]
    # total += x and hist[ep] = x change in place (or rebind an int on restore)
    assert e.assigned == {"stats['n']", "self_like.best", "x"}


def test_rule_4_method_call_statement_adds_receiver():
    e = effects("""
        for ep in range(2):
            for x in data:
                optimizer.step()
                sched.net.train()
        """)
    assert e.paths == ["optimizer", "sched.net"] and e.rules["optimizer"] == 4
    assert not e.assigned - {"x"}


def test_rule_5_unknown_function_call_has_no_estimate():
    e = effects("""
        for ep in range(2):
            for x in data:
                clip_grads(model, 1.0)
        """)
    assert e.paths == [] and e.unknown == [4]


def test_rule_0_has_precedence_over_rule_1():
    e = effects("""
        for ep in range(2):
            for x in data:
                h = 0
                h = rnn.step(h)
        """, "print(h)")
    assert e.rules == {"h": 3, "x": 3}  # rnn is not added: h was already in the set


def test_imports_functions_and_classes_are_not_state():
    e = effects("""
        import torch
        import numpy as np
        def f(): pass
        for ep in range(2):
            for x in data:
                torch.manual_seed(x)
                np.random.shuffle(x)
                f.cache = 1
        """)
    assert e.paths == []


def test_a_class_attribute_of_the_script_is_state_and_the_class_is_not():
    e = effects("""
        class Counter:
            calls = 0
            seen = []
        def count(n):
            Counter.calls += n
        for ep in range(2):
            for x in data:
                Counter.seen.append(x)
                Counter.reset()
                count(1)
        """)
    assert e.paths == ["Counter.seen"]
    assert e.globals == ["Counter.calls"]


def test_changes_through_an_alias_count_for_what_it_names():
    e = effects("""
        STATS = {"batches": 0}
        def step(model, x):
            s = STATS
            s["batches"] += 1
            h = model.history
            h.append(x)
            n = STATS["batches"]
            n = n + 1
        for ep in range(2):
            for x in data:
                t = TOTALS
                t["n"] += 1
                step(net, x)
        """, "print(TOTALS)")
    assert sorted(e.paths) == ["TOTALS['n']", "net.history"]
    assert e.globals == ["STATS['batches']"]
    assert "t" in e.dropped


def test_loop_scoped_variables_are_removed_unless_read_after():
    e = effects("""
        for ep in range(2):
            for x in data:
                loss = crit(x)
                last = loss
        """, "print(last)")
    assert e.paths == ["last"] and set(e.dropped) == {"x", "loss"}


def test_a_variable_read_before_it_is_assigned_is_not_loop_scoped():
    """Its value comes from before the block (or the block's previous run)."""
    e = effects("""
        step = 0
        for ep in range(2):
            for x in data:
                lr = base * min(1.0, step / 20)
                step += 1
                delta = x - prev
                prev = x
        """)
    assert e.paths == ["step", "prev"] and set(e.dropped) == {"x", "lr", "delta"}


def test_changing_objects_through_the_loop_variable_counts_for_their_source():
    e = effects("""
        for ep in range(2):
            for x in data:
                for p, q in zip(ema.parameters(), model.parameters()):
                    p.mul_(0.9).add_(q, alpha=0.1)
                for g in opt.param_groups:
                    g["lr"] = 0.1
                for m in model.children():
                    print(m)
        """)
    assert e.paths == ["ema", "model", "opt"]


def test_a_closure_changes_the_enclosing_functions_names():
    tree = ast.parse(textwrap.dedent("""
        def main():
            model, opt = make()
            def run_epoch():
                for i in range(3):
                    opt.step()
            for epoch in range(3):
                run_epoch()
                print(model)
    """))
    fn = tree.body[0]
    loop = fn.body[2]
    e = block_effects(Script(tree), [loop.body[0]], fn)  # run_epoch: a def of fn
    assert e.paths == ["opt"] and e.globals == []


def test_a_variable_read_by_a_function_of_the_script_is_not_loop_scoped():
    e = effects("""
        def report():
            return seen
        for ep in range(2):
            for x in data:
                seen = x
        """)
    assert e.paths == ["seen"]


def test_called_function_mutating_arguments_and_assigning_globals():
    e = effects("""
        steps = 0
        def train(model, loader, opt, log=None):
            global steps
            model.train()
            for xb in loader:
                opt.step()
                steps += 1
            history.append(1)
            local = []
            local.append(2)
        for ep in range(2):
            train(net, loader, optimizer)
        """)
    assert e.paths == ["net", "optimizer"]
    assert e.globals == ["steps", "history"]
    assert e.calls == {"train"}


def test_called_functions_are_analysed_more_than_one_level_deep():
    e = effects("""
        def inner(o):
            o.step()
        def outer(opt):
            for i in range(3):
                inner(opt)
        for ep in range(2):
            r = outer(the_opt)
        """, "print(r)")
    assert e.paths == ["r", "the_opt"] and e.calls == {"inner", "outer"}


RECURSIVE = """
    def repackage_hidden(h):
        if isinstance(h, torch.Tensor):
            return h.detach()
        return tuple(repackage_hidden(v) for v in h)
    def walk(tree, out):
        for child in tree.children:
            walk(child, out)
        if tree.leaf:
            out.counts.append(1)
    def ping(a, b, n):
        if n:
            pong(a, b, n - 1)
    def pong(a, b, n):
        b.hits.append(n)
        ping(a, b, n)
    for ep in range(2):
        %s
    """


@pytest.mark.parametrize("call, paths", [
    ("hidden = repackage_hidden(hidden)", ["hidden"]),  # pure: word_language_model's
    ("walk(root_node, stats)", ["stats.counts"]),  # found only by recursing
    ("ping(x, y, 3)", ["y.hits"]),  # mutual recursion
])
def test_recursive_functions_are_analysed_to_a_fixpoint(call, paths):
    e = effects(textwrap.dedent(RECURSIVE) % call, "print(hidden, stats, y)")
    assert e.paths == paths


@pytest.mark.parametrize("src, reason", [
    ("""
        def f(opt):
            for i in range(2):
                opt.step()
        for ep in range(2):
            f(*args)
        """, "*args"),
    ("""
        def run():
            for ep in range(2):
                for x in data:
                    return x
        run()
        """, "return"),
    ("""
        for ep in range(2):
            for x in data:
                exec("y = 1")
        """, "exec"),
])
def test_the_analysis_gives_up_where_it_cannot_be_sound(src, reason):
    tree = ast.parse(textwrap.dedent(src))
    inst = instrument(textwrap.dedent(src), "s.py", lambda line: f"s.py:{line}")
    assert not inst.blocks
    assert any(reason in why for _, why in inst.left_alone), inst.left_alone
    assert tree is not None


def test_instrumentation_finds_main_loop_candidates_and_blocks():
    src = textwrap.dedent("""
        import torch

        def evaluate(model, data):
            for x in data:
                model(x)

        def main():
            for epoch in range(3):
                for x in data:
                    opt.step()
                acc = evaluate(model, data)
                print(acc)

        def batches():
            for x in data:
                yield x

        if __name__ == "__main__":
            main()
    """)
    inst = instrument(src, "s.py", lambda line: f"s.py:{line}")
    assert [(l.key, l.function) for l in inst.loops] == [("s.py:5", "evaluate"),
                                                         ("s.py:9", "main")]
    # opt is not bound in main(): never rebound there (a module global would
    # be set in the module's namespace, anything else restored in place)
    assert [(b.key, b.kind, b.owner, b.names, b.paths) for b in inst.blocks] == [
        ("s.py:10", "loop", "s.py:9", [], ["opt"]), ("s.py:12", "call", "s.py:9", ["acc"], [])]
    # What the main loop carries into its next iteration (iteration
    # checkpoints): opt, changed in place (it is not bound in main()).
    # `data` is what it loops over (held by no checkpoint, were it an iterator).
    assert [l.carried for l in inst.loops] == [[[], [], [], [], []],
                                               [[], ["opt"], [], [], ["data"]]]
    assert "__flor__.loop(range(3), 's.py:9', (), ('opt',), (), (), ('data',), False)" \
        in inst.text


def test_while_loops_become_tracked_for_loops():
    src = "i = 0\nwhile i < 3:\n    i += 1\nelse:\n    print('done', i)\n"
    inst = instrument(src, "w.py", lambda line: f"w.py:{line}")
    assert [l.key for l in inst.loops] == ["w.py:2"]
    ns = {}
    import io
    import contextlib

    import flor.runtime.handsfree as rt
    ns["__flor__"] = rt
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(inst.code, ns)
    assert out.getvalue() == "done 3\n" and ns["i"] == 3


def test_uses_flor():
    assert uses_flor("import flor\n") and uses_flor("from flor import log\n")
    assert not uses_flor("import torch\nflorish = 1\n")


@pytest.mark.parametrize("stmt, hindsight", [
    ("print(x)", True), ("flor.log('loss', loss)", True), ("logging.info('x %s', x)", True),
    ("logger.warning(x)", True), ("writer.add_scalar('loss', loss, step)", True),
    ("wandb.log({'loss': loss})", True), ("print(y := 3)", False), ("x = print(x)", False),
    ("optimizer.step()", False), ("model.train()", False), ("f(x)", False),
    # They change state: warned of, refused under --strict.
    ("print(w.mul_(0.5).norm())", False), ("logging.info('%s', opt.step())", False),
    ("optimizer.add_param_group({'params': [p]})", False), ("print(model.eval())", False),
    ("print(w.norm(), w.grad.abs().max())", True), ("print(x.float().mean())", True),
    # Accelerate's and Lightning's own printing (on the main process only).
    ("accelerator.print('loss', loss)", True), ("self.print(x)", True),
    ("accelerator.print(optimizer.step())", False),
])
def test_log_like_statements(stmt, hindsight):
    assert is_log_like(ast.parse(stmt).body[0]) is hindsight


def test_a_logging_name_of_the_script_s_own_code_is_not_a_log_call():
    from flor.program.probe import own_code

    own = own_code(ast.parse(textwrap.dedent("""
        class Meter:
            def print(self):
                print(self.total / self.n)
                self.total = self.n = 0

        def log_metrics(writer, m):
            m.reset()
    """)))
    # Receivers are not told apart: with a print method of its own in the
    # script, any .print() call may be that method.
    for stmt, hindsight in (("meter.print()", False), ("log_metrics(w, m)", False),
                            ("accelerator.print(x)", False), ("print(meter.total)", True),
                            ("logger.info(x)", True)):
        assert is_log_like(ast.parse(stmt).body[0], own) is hindsight, stmt


def test_probe_detection_steps_into_blocks_that_reach_a_changed_function():
    old = textwrap.dedent("""
        def train(model, data):
            for x in data:
                model.step(x)
        for epoch in range(3):
            train(net, data)
            for y in val:
                net.score(y)
    """)
    new = old.replace("        model.step(x)", "        model.step(x)\n        print(x)")
    inst = instrument(new, "s.py", lambda line: f"s.py:{line}")
    probe = detect(old, new, inst, changed_functions({"s.py": old}, {"s.py": new}))
    assert probe.probed == {"s.py:7"} and probe.other == []  # the call of train()
    assert probe.hindsight == [(5, "print(x)")]
    edited = new.replace("for y in val:", "for y in val[:2]:")
    probe = detect(old, edited, instrument(edited, "s.py", lambda line: f"s.py:{line}"),
                   changed_functions({"s.py": old}, {"s.py": edited}))
    assert probe.probed == {"s.py:7", "s.py:8"}
    assert probe.other == [(8, "changed: for y in val[:2]:")]


DCGAN = textwrap.dedent("""
    import torch
    from torch import nn

    class Generator(nn.Module):
        def __init__(self):
            super().__init__()
            self.main = nn.Sequential(nn.Linear(4, 8), nn.Tanh())

        def forward(self, z):
            return self.main(z)

    def main():
        netG = Generator()
        opt = torch.optim.SGD(netG.parameters(), lr=0.1)
        for epoch in range(3):
            for x in torch.randn(5, 8).split(1):
                loss = (netG(torch.randn(1, 4)) - x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            print(epoch)

    if __name__ == "__main__":
        main()
""")


def test_a_model_attribute_named_like_a_changed_function_is_no_call_of_it():
    """pytorch/examples' DCGAN: Generator.forward calls self.main(z), an
    nn.Sequential, and the script's main() holds the probe.  The forward
    does not call main(), so the batch loop (which runs the forward) is
    skipped."""
    new = DCGAN.replace("        print(epoch)", "        print(epoch)\n"
                        "        print(sum(p.norm() for p in netG.parameters()))")
    changed = changed_functions({"s.py": DCGAN}, {"s.py": new})
    assert changed == {"main"}
    probe = detect(DCGAN, new, instrument(new, "s.py", lambda line: f"s.py:{line}"), changed)
    assert probe.probed == set() and probe.other == []
    # Once the forward is edited, the batch loop is stepped into.
    edited = new.replace("return self.main(z)", "print(z.shape)\n        return self.main(z)")
    changed = changed_functions({"s.py": DCGAN}, {"s.py": edited})
    assert changed == {"main", "forward"}
    probe = detect(DCGAN, edited, instrument(edited, "s.py", lambda line: f"s.py:{line}"),
                   changed)
    assert probe.probed == {"s.py:18"}  # (a line further down now)


def test_the_call_graph_links_an_attribute_of_self_only_to_methods():
    old = textwrap.dedent("""
        class Trainer(Base):
            def fit(self):
                self.main()
            def step(self):
                super().update()
            def evaluate(self):
                self.model.update()
            def update(self):
                pass
        def main():
            pass
        def update():
            pass
        def run(t):
            t.main()
        def loop(t):
            update()
    """)
    def changed(edit_old, edit_new):
        return changed_functions({"s.py": old}, {"s.py": old.replace(edit_old, edit_new)})
    # The module's main(): fit's self.main() is no call of it; t.main() may be.
    assert changed("def main():\n    pass", "def main():\n    print(1)") == {"main", "run"}
    # The method update(): super().update() and self.model.update() may
    # reach it, and so may a bare update() (by simple names, as before).
    assert changed("    def update(self):\n        pass",
                   "    def update(self):\n        print(1)") == \
        {"update", "step", "evaluate", "loop"}
    assert changed("def update():\n    pass", "def update():\n    print(1)") == \
        {"update", "loop"}


def test_probe_detection_steps_into_the_block_whose_function_lost_a_statement():
    """A statement deleted at the end of train() changes train(), not the
    function defined after it."""
    old = textwrap.dedent("""
        def train(model, data):
            for x in data:
                model.step(x)
            model.count += 1

        def evaluate(model, data):
            for x in data:
                model.score(x)

        for epoch in range(3):
            train(net, data)
            evaluate(net, val)
    """)
    new = old.replace("    model.count += 1\n", "")
    inst = instrument(new, "s.py", lambda line: f"s.py:{line}")
    probe = detect(old, new, inst, changed_functions({"s.py": old}, {"s.py": new}))
    assert probe.probed == {"s.py:11"}  # the call of train(), not of evaluate()
    assert probe.other == [(6, "removed: model.count += 1")]


def test_an_added_statement_that_changes_state_is_not_a_hindsight_statement():
    old = "for e in range(3):\n    for x in data:\n        model.fit(x)\n"
    new = old + "        print(model.w.mul_(0.5).norm())\n"
    probe = detect(old, new, instrument(new, "s.py", lambda line: f"s.py:{line}"), set())
    assert probe.hindsight == []
    assert probe.other == [(4, "changes state (calls model.w.mul_()): "
                               "print(model.w.mul_(0.5).norm())")]


def test_value_comparison_is_exact_unless_a_tolerance_is_given():
    assert not equal(0.1 + 0.2, 0.3)
    assert equal(0.1 + 0.2, 0.3, 1e-9)
    assert not equal(1.0, 1.1, 1e-3)
    assert equal("loss 0.30000000000000004 acc 5", "loss 0.3 acc 5", 1e-9)
    assert not equal("loss 0.3 acc 5", "loss 0.3 acc 6", 1e-9)
    assert not equal("loss 0.3", "lost 0.3", 1e-9)
    assert equal([1.0, {"a": 2.0}], [1.0 + 1e-12, {"a": 2.0}], 1e-9)


def _grads(src):
    """{block line: gradients live} of the blocks in a hands-free script."""
    inst = instrument(textwrap.dedent(src), "s.py", lambda line: f"s.py:{line}")
    return {b.line: b.grads for b in inst.blocks}


def test_gradients_of_an_accumulation_block_are_live():
    assert _grads("""
        for it in range(10):
            for micro in range(4):
                model(x).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    """) == {3: True}


def test_gradients_cleared_before_they_are_read_are_dead():
    assert _grads("""
        def train(model, loader, optimizer):
            model.train()
            for x, y in loader:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()

        def evaluate(model, loader):
            for x, y in loader:
                model(x)

        for epoch in range(10):
            train(model, loader, optimizer)
            evaluate(model, loader)
            scheduler.step()
            lr_sched.step()
    """) == {14: False, 15: False}


def test_gradients_a_main_loop_accumulates_over_its_iterations_are_carried():
    # backward() every iteration, the optimizer every 4th: the gradients one
    # iteration leaves are read by the next, so its checkpoint holds them.
    src = """
        import torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for it in range(100):
            {}
            model(x).sum().backward()
            if (it + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
    """
    loops = instrument(textwrap.dedent(src.format("pass")), "s.py", lambda line: f"s.py:{line}").loops
    assert [(l.line, l.grads) for l in loops] == [(5, True)]
    # Accelerate's form: accumulate() decides when step() and zero_grad() act.
    acc = src.replace("model(x).sum().backward()", "accelerator.backward(model(x).sum())")
    loops = instrument(textwrap.dedent(acc.format("pass")), "s.py", lambda line: f"s.py:{line}").loops
    assert loops[0].grads
    # Cleared first: what an iteration leaves is never read.
    loops = instrument(textwrap.dedent(src.format("opt.zero_grad()")), "s.py",
                       lambda line: f"s.py:{line}").loops
    assert not loops[0].grads
    # A clear that may not run comes first: at a window's start only (as
    # Hugging Face's examples write it), or inside accumulate(), whose
    # optimizer acts only at a window's end.
    for first in ("if it % 4 == 0:\n                opt.zero_grad()",
                  "with accelerator.accumulate(model):\n                opt.zero_grad()"):
        loops = instrument(textwrap.dedent(src.format(first)), "s.py",
                           lambda line: f"s.py:{line}").loops
        assert loops[0].grads, first
    # The same window in a function of the script that the loop calls.
    helper = """
        import torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(step):
            if step % 4 == 0:
                opt.zero_grad()
            model(x).sum().backward()
            if (step + 1) % 4 == 0:
                opt.step()

        for it in range(100):
            train_step(it)
    """
    (loop,) = instrument(textwrap.dedent(helper), "s.py", lambda line: f"s.py:{line}").loops
    assert loop.carried and loop.grads
    # An epoch loop whose batch loop clears first: none carried.
    epochs = """
        import torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = [(torch.ones(1, 2), torch.ones(1))]
        for epoch in range(3):
            for x, y in loader:
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
            print(epoch)
    """
    (loop,) = instrument(textwrap.dedent(epochs), "s.py", lambda line: f"s.py:{line}").loops
    assert loop.carried and not loop.grads
    assert instrument(textwrap.dedent(epochs.replace("opt.zero_grad()", "pass")), "s.py",
                      lambda line: f"s.py:{line}").loops[0].grads


def test_a_step_is_an_optimizer_s_unless_its_receiver_is_a_scheduler():
    # `sched` is built as a scheduler; `opt` is not: its step reads them.
    src = """
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=10)
        for it in range(10):
            for micro in range(2):
                model(x).backward()
            {}.step()
            opt.zero_grad()
    """
    assert _grads(src.format("sched")) == {4: False}
    assert _grads(src.format("opt")) == {4: True}


def test_manual_api_blocks_whose_gradients_are_read_after_end():
    from flor.program.gradients import manual_gradients

    src = textwrap.dedent("""
        import flor
        for it in flor.generator(range(3)):
            if flor.SkipBlock.step_into("micro"):
                for m in range(2):
                    model(x).backward()
            model = flor.SkipBlock.end(model)
            optimizer.step()
            optimizer.zero_grad()
        for epoch in flor.generator(range(3)):
            if flor.SkipBlock.step_into():
                for b in data:
                    optimizer.zero_grad()
                    loss(b).backward()
                    optimizer.step()
            flor.SkipBlock.end(model, optimizer)
            scheduler.step()
    """)
    assert manual_gradients(src, "t.py") == {"micro"}


def test_methods_of_the_script_s_classes_are_analysed_with_self_as_the_receiver():
    """self.train_epoch() in fit(), and trainer.step() on a Trainer: the
    method's changes to self are changes to the receiver's attributes (not
    the whole object, which holds data loaders)."""
    src = textwrap.dedent("""
        class Base:
            def count(self):
                self.steps += 1
        class Trainer(Base):
            def train_epoch(self, epoch):
                self.model.train()
                for x, y in self.loader:
                    self.opt.zero_grad()
                    self.count()
                return 0.0
            def fit(self):
                for epoch in range(3):
                    loss = self.train_epoch(epoch)
                    print(loss)
        trainer = Trainer()
        for ep in range(2):
            trainer.train_epoch(ep)
        print(trainer)
    """)
    inst = instrument(src, "s.py", lambda line: f"s.py:{line}")
    blocks = {b.line: b for b in inst.blocks}
    assert set(blocks) == {14, 18}, inst.left_alone
    assert blocks[14].names == ["loss"] and blocks[14].kind == "call"
    assert blocks[14].paths == ["self.model", "self.opt", "self.steps"]
    assert blocks[18].paths == ["trainer.model", "trainer.opt", "trainer.steps"]


def test_what_a_loop_body_reads_before_it_assigns():
    """program/liveness.py: names read on some path before an assignment
    on that path; the header's targets and definite assignments are not."""
    from flor.program.liveness import exposed

    def live(src, bound=()):
        return exposed(ast.parse(textwrap.dedent(src)).body, set(bound))

    assert live("""
        x = x.to(device)
        total += (model(x) == y).sum()
        lr = get_lr(it)
        t0, dt = t1, t1 - t0
    """, bound={"x", "y"}) == {"device", "model", "total", "get_lr", "it", "t1", "t0"}
    # An assignment in one branch, a loop or a try is not definite.
    assert live("""
        if step % 10 == 0:
            lr = compute()
        else:
            lr = lr
        for k in range(3):
            acc = 0
        try:
            best = new()
        except ValueError:
            pass
        use(lr, acc, best, k)
    """) == {"step", "compute", "lr", "range", "new", "ValueError", "use", "acc", "best", "k"}
    # Comprehensions and lambdas have their own names; x += 1 reads x.
    assert live("""
        norms = [p.grad.norm() for p in params if p.grad is not None]
        f = lambda q: q + bias
        count += 1
    """) == {"params", "bias", "count"}


_LOOP = textwrap.dedent("""
    def total_grad_norm(model):
        return sum(float(p.grad.norm()) ** 2 for p in model.parameters())
    for epoch in range(3):
        for it, (x, y) in enumerate(data):
            loss = model(x, y)
            loss.backward()
            opt.step()
        print(epoch)
""")
_HOOKS = textwrap.dedent("""
    class Probe(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kw):
            print("epoch", state.epoch)
    trainer.train()
""")


def _shapes(old, new):
    """(hindsight lines, other lines) that detect() reports for an edit."""
    probe = detect(old, new, instrument(new, "s.py", lambda line: f"s.py:{line}"),
                   changed_functions({"s.py": old}, {"s.py": new}))
    return [t for _, t in probe.hindsight], [t for _, t in probe.other]


@pytest.mark.parametrize("old, anchor, added, hindsight", [  # added after anchor's line
    # A helper line whose new name only an added print reads.
    (_LOOP, "loss.backward()\n", ["gn = total_grad_norm(model)", "print(gn)"], True),
    # A guard around hindsight statements.
    (_LOOP, "loss.backward()\n", ["if it % 250 == 0:", "    print(total_grad_norm(model))"],
     True),
    # A helper that another helper, behind a guard, reads.
    (_LOOP, "opt.step()\n", ["seen_norm = total_grad_norm(model)", "print(seen_norm)",
                             "if it == 0:", "    first = seen_norm", "    print(first)"], True),
    # Loops over the model's own listings.
    (_LOOP, "opt.step()\n", ["<", "for _ in range(2):", "    print(epoch)",
                              "for name, w in model.named_parameters():", "    print(name)"], True),
    # A callback's new hook that only logs.
    (_HOOKS, 'print("epoch", state.epoch)\n', ["<",
        "def on_step_end(self, args, state, control, **kw):",
        "    if state.global_step % 10 == 0:", "        print(state.log_history[-1:])"], True),
    # Not probes: a name the script already uses, rebound ...
    (_LOOP, "loss.backward()\n", ["loss = loss * 2", "print(loss)"], False),
    # ... an existing statement wrapped in a guard ...
    (_LOOP, "loss.backward()\n", ["if it % 2 == 0:", "    opt.zero_grad()"], False),
    # ... a helper no added statement reads ...
    (_LOOP, "loss.backward()\n", ["_ = total_grad_norm(model)"], False),
    # ... a guard that returns from the script's own function ...
    ("def train(data):\n    for x in data:\n        fit(x)\n", "fit(x)\n",
     ["if x is None:", "    return"], False),
    # ... a helper that yields (the function becomes a generator) ...
    ("def train(data):\n    for x in data:\n        fit(x)\n", "fit(x)\n",
     ["v = yield x", "print(v)"], False),
    # ... an alias of training state changed in place, or an item of it ...
    (_LOOP, "loss.backward()\n", ["w = model.weight.data", "w *= 0.5", "print(w.sum())"],
     False),
    (_LOOP, "model.parameters())\n", ["<", "def f(o):", "    g = o.param_groups[0]", "    g['lr'] = 0.0",
                          "    return g['lr']"], False),
    # ... a loop over a data loader (it draws the shuffle's random numbers) ...
    (_LOOP, "opt.step()\n", ["<", "for bx, by in loader:", "    print(bx.shape)"], False),
    # ... a guard that draws a random number or advances an iterator ...
    (_LOOP, "loss.backward()\n", ["if random.random() < 0.01:", "    print(loss)"], False),
    (_LOOP, "loss.backward()\n", ["b = next(it)", "print(b)"], False),
    # ... a hook on the model, or a dunder call ...
    (_LOOP, "loss.backward()\n", ["h = model.register_forward_hook(show)", "print(h)"], False),
    (_LOOP, "loss.backward()\n", ["z = opt.param_groups[0].__setitem__('lr', 0.0)",
                                   "print(z)"], False),
    # ... a method that overrides a base class's, or a class attribute ...
    (_HOOKS, 'print("epoch", state.epoch)\n', ["<", "def zero_grad(self, set_to_none=True):",
                                                "    print('zg')"], False),
    (_HOOKS, 'print("epoch", state.epoch)\n', ["<", "def __setattr__(self, k, v):",
                                                "    print(k)"], False),
    (_HOOKS, 'print("epoch", state.epoch)\n', ["<", "call_super_init = True",
                                                "print(call_super_init)"], False),
    # ... a hook that returns a value, or changes state.
    (_HOOKS, 'print("epoch", state.epoch)\n', ["<",
        "def on_step_end(self, args, state, control, **kw):",
        "    control.should_stop = True", "    return control"], False),
    (_HOOKS, 'print("epoch", state.epoch)\n', ["<",
        "def on_step_end(self, args, state, control, **kw):",
        "    print(args.model.zero_grad())"], False),
])
def test_probe_lines_as_people_write_them(old, anchor, added, hindsight):
    at = old.index(anchor) + len(anchor)
    indent = re.match(r" *", old[old.rindex("\n", 0, at - 1) + 1:]).group(0)
    if added[0] == "<":  # at the anchor's enclosing level: a method beside its method
        indent, added = indent[4:], added[1:]
    new = old[:at] + "".join(indent + line + "\n" for line in added) + old[at:]
    got, other = _shapes(old, new)
    if hindsight:
        assert got == [line.strip() for line in added] and other == []
    else:
        assert other and not set(got) - {"print(loss)"}


@pytest.mark.parametrize("line", [
    "print(epoch, torch.rand(1).item())",
    "print(epoch, rs.randint(100))",
    "print(epoch, next(iter(loader)))",
    "logging.info('%s', history.pop())",
])
def test_a_print_that_draws_random_numbers_or_items_is_not_a_probe(line):
    """A plain run of the edited script draws them, and trains on other
    numbers from there on: the statement is another change (replay warns),
    not a hindsight statement whose replay prints the record's values."""
    new = _LOOP.replace("    print(epoch)\n", f"    print(epoch)\n    {line}\n")
    got, other = _shapes(_LOOP, new)
    assert got == [] and other == [f"added: {line}"], (got, other)
    fine = _LOOP.replace("    print(epoch)\n", "    print(epoch)\n    print(epoch, len(loader))\n")
    assert _shapes(_LOOP, fine) == (["print(epoch, len(loader))"], [])


def test_a_helper_that_other_code_reads_is_not_a_probe():
    """`gn` is added with its print, and an existing line is changed to
    read it: the helper feeds the script, not only the probe, and what
    reads the helper's new name is no probe either."""
    new = _LOOP.replace("        loss.backward()\n",
                        "        loss.backward()\n        gn = total_grad_norm(model)\n"
                        "        print(gn)\n").replace("print(epoch)", "print(epoch, gn)")
    got, other = _shapes(_LOOP, new)
    assert "added: gn = total_grad_norm(model)" in other and "changed: print(epoch, gn)" in other
    assert got == [] and "added: print(gn)" in other


def test_a_helper_function_and_a_loop_that_print_what_it_returns_are_a_probe():
    new = _LOOP.replace("for epoch", (
        "def layer_norms(m):\n    out = {}\n    for n, p in m.named_parameters():\n"
        "        out[n] = float(p.norm())\n    return out\nfor epoch")).replace(
        "    print(epoch)\n", "    print(epoch)\n    for name, w in layer_norms(model).items():\n"
        "        print(name, w)\n")
    assert _shapes(_LOOP, new) == ([
        "def layer_norms(m):", "out = {}", "for n, p in m.named_parameters():",
        "out[n] = float(p.norm())", "return out",
        "for name, w in layer_norms(model).items():", "print(name, w)"], [])
    # A helper function that changes what it is given is no probe, nor what calls it.
    bad = new.replace("out[n] = float(p.norm())", "p.data.zero_()")
    got, other = _shapes(_LOOP, bad)
    assert got == [] and "changes state (calls p.data.zero_()): def layer_norms(m):" in other
    assert "added: for name, w in layer_norms(model).items():" in other


def test_an_accumulator_of_numbers_is_a_probe_and_one_of_an_alias_is_not():
    new = _LOOP.replace("    for it, (x, y)", "    gsum = 0.0\n    for it, (x, y)").replace(
        "        opt.step()\n", "        opt.step()\n        gsum += float(loss)\n").replace(
        "    print(epoch)\n", "    print(epoch)\n    print(gsum)\n")
    assert _shapes(_LOOP, new) == (["gsum = 0.0", "gsum += float(loss)", "print(gsum)"], [])
    alias = new.replace("gsum = 0.0", "gsum = model.weight.data")
    got, other = _shapes(_LOOP, alias)
    assert "added: gsum += float(loss)" in other and "gsum += float(loss)" not in got


@pytest.mark.parametrize("helper, reader", [
    # It changes what it is given: an item of an optimizer's group, a parameter.
    ("def f(o):\n    g = o.param_groups[0]\n    g['lr'] = 0.0\n    return g['lr']\n",
     "print(f(opt))"),
    ("def f(w):\n    w += 1\n    return 0\n", "print(f(model.weight.data))"),
])
def test_a_helper_function_that_changes_its_arguments_is_not_a_probe(helper, reader):
    new = _LOOP.replace("for epoch", helper + "for epoch").replace(
        "    print(epoch)\n", f"    print(epoch)\n    {reader}\n")
    got, other = _shapes(_LOOP, new)
    assert got == [] and f"added: {reader}" in other
    # The same helper adding up numbers of its own is one.
    fine = _LOOP.replace("for epoch", (
        "def gnorm(m):\n    total = 0.0\n    for q in m.parameters():\n"
        "        total += float(q.grad.norm()) ** 2\n    return total ** 0.5\nfor epoch")).replace(
        "    print(epoch)\n", "    print(epoch)\n    print(gnorm(model))\n")
    assert _shapes(_LOOP, fine)[1] == []


LIGHTNING_MODULE = """
import torch

def norm(model):
    return sum(p.norm() for p in model.parameters())

class Net:
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        return loss

    def on_train_epoch_end(self):
        print(self.current_epoch)
"""


def test_changes_only_lightning_epoch_end_hooks_call_are_not_training():
    """A library's epoch-end hook, and a helper only it calls, changed: no
    code that runs in an epoch's training changed.  A change in
    training_step, or in a helper it calls, is one."""
    old = {"s.py": LIGHTNING_MODULE}
    at_end = LIGHTNING_MODULE.replace(
        "        print(self.current_epoch)",
        "        print(self.current_epoch)\n        print(norm(self), extra(self))") + \
        "\ndef extra(m):\n    return norm(m) * 2\n"
    assert changed_outside(old, {"s.py": at_end}, EPOCH_END) == set()
    in_step = LIGHTNING_MODULE.replace("        return loss", "        print(loss)\n        return loss")
    assert changed_outside(old, {"s.py": in_step}, EPOCH_END) == {"training_step"}
    helper = LIGHTNING_MODULE.replace("        loss = self.loss(batch)",
                                      "        loss = self.loss(batch)\n        norm(self)")
    helper = helper.replace("    return sum(", "    print(1)\n    return sum(")
    assert changed_outside(old, {"s.py": helper}, EPOCH_END) == {"norm", "training_step"}


def test_training_libraries_flor_does_not_follow_are_named():
    assert unfollowed({"torch": None, "transformers.trainer": None}) == \
        ["the Hugging Face Trainer (transformers before 5.3)"]
    assert unfollowed({"torch": None, "transformers.trainer": None},
                      followed={"transformers.trainer"}) == []
    assert unfollowed({"torch", "lightning.pytorch", "transformers"}) == []


def test_the_globals_that_code_a_library_calls_changes():
    """What a callback, a compute_loss or a function passed to a library
    changes at module level (set, or in place), and what they call does;
    not what the script's own set-up fills before training."""
    from flor.program.analysis import globals_changed

    src = '''
import torch
SEEN = {"batches": 0}
CALLS = 0
LOSSES = []
DATA = []
SETTINGS = {"lr": 1e-3}

def load():
    for i in range(10):
        DATA.append(i)
    SETTINGS["lr"] = 2e-3

def count():
    global CALLS
    CALLS += 1

def compute_metrics(pred):
    LOSSES.append(pred)
    return {}

class MyTrainer:
    def compute_loss(self, model, inputs):
        SEEN["batches"] += 1
        count()
        loss = model(inputs)
        return loss

def main():
    load()
    trainer = MyTrainer(compute_metrics=compute_metrics)
'''
    assert globals_changed(ast.parse(src)) == {"SEEN", "CALLS", "LOSSES"}
    # Through an alias, a namespace's attribute, a class attribute.
    src += """
NS = types.SimpleNamespace(examples=0)
STATS = {"n": 0}

class Counter:
    calls = 0

class Report:
    def on_epoch_end(self, args, state, control, **kwargs):
        s = STATS
        s["n"] += 1
        NS.examples += 1
        Counter.calls += 1
        Counter.describe()
"""
    assert globals_changed(ast.parse(src)) == {"SEEN", "CALLS", "LOSSES", "NS", "STATS",
                                               "Counter"}


def test_calls_into_the_projects_modules_are_followed():
    """Functions and classes imported from the project's modules are
    analysed through their bodies, in their own module; one that changes
    its own module's globals makes the analysis give up on the block."""
    from flor.program.analysis import GiveUp, Modules

    files = {
        "engine": textwrap.dedent("""
            STEPS = 0

            def train_one_epoch(model, optimizer, loader):
                model.train()
                for x in loader:
                    optimizer.step()

            def counted(model):
                global STEPS
                STEPS += 1

            class Trainer:
                def __init__(self, model):
                    self.model = model
                def train_epoch(self, loader):
                    for x in loader:
                        self.model.step(x)
                    self.epochs += 1
            """),
        "pkg.__init__": "",
        "pkg.tools": "def bump(h):\n    h.append(1)\n",
    }

    def find(dotted, level, path):
        key = dotted if dotted in files else dotted + ".__init__"
        return (f"/p/{key}.py", files[key]) if key in files else None

    tree = ast.parse(textwrap.dedent("""
        import engine
        from engine import Trainer, counted
        from pkg import tools
        t = Trainer(net)
        for ep in range(2):
            engine.train_one_epoch(net, opt, loader)
            t.train_epoch(loader)
            tools.bump(history)
        print(net, opt, t, history)
        """))
    script = Script(tree, "/p/train.py", Modules(find))
    loop = tree.body[-2]
    eff = block_effects(script, loop.body, tree)
    assert sorted(eff.paths) == ["history", "net", "opt", "t.epochs", "t.model"]
    assert script.has_loop(script.resolve(loop.body[0].value, tree))
    call = ast.parse("counted(net)").body[0]
    with pytest.raises(GiveUp, match="globals of its module"):
        block_effects(script, [call], tree)


def test_an_item_by_a_variable_stops_the_path_at_its_container():
    from flor.program.syntax import path_of

    def p(src):
        return path_of(ast.parse(src, mode="eval").body)

    assert p('hist[ep]["loss"]') == "hist"
    assert p("slots[j].count") == "slots"
    assert p('cfg.runs[0]["lr"]') == "cfg.runs[0]['lr']"


@pytest.mark.parametrize("body, changed", [
    # a variable key, an item reached by one, an attribute of one
    ('s = STATS\n    s[key] += 1', "STATS"),
    ('s = STATS[key]\n    s["n"] += 1', "STATS"),
    ("slot = SLOTS[j]\n    slot.count += 1", "SLOTS"),
    # tuple and chained assignment, a conditional, :=, a loop over names
    ('s, c = STATS, CFG\n    s["n"] += 1', "STATS['n']"),
    ('s = t = STATS\n    t["n"] += 1', "STATS['n']"),
    ('s = EVEN if key else ODD\n    s["n"] += 1', "EVEN['n']"),
    ('(s := STATS)["n"] += 1', "STATS['n']"),
    ("for d in (STATS, CFG):\n        d[key] = 1", "STATS"),
])
def test_changes_through_aliases_as_people_spell_them(body, changed):
    src = f"def step(key, j):\n    {body}\n"
    tree = ast.parse(src + "for ep in range(2):\n    for i in data:\n        step(i, i)\n")
    eff = block_effects(Script(tree), [tree.body[-1].body[0]], tree)
    assert changed in eff.globals, eff.globals


def test_a_classmethod_changes_its_class():
    e = effects("""
        class Meter:
            calls = 0
            @classmethod
            def bump(cls):
                cls.calls += 1
            @staticmethod
            def scale(x):
                x.mul_(2)
        meter = Meter()
        for ep in range(2):
            for x in data:
                Meter.bump()
                meter.bump()
                meter.scale(w)
        """, "print(Meter.calls, w)")
    assert sorted(e.paths) == ["Meter.calls", "w"]


def test_a_project_modules_attribute_and_a_value_imported_from_it_are_state():
    from flor.program.analysis import Modules

    files = {"cfg": "STEP = 0\nSTATS = {'n': 0}\ndef helper():\n    pass\n"}

    def find(dotted, level, path):
        return (f"/p/{dotted}.py", files[dotted]) if dotted in files else None

    tree = ast.parse(textwrap.dedent("""
        import cfg
        from cfg import STATS, helper
        for ep in range(2):
            for x in data:
                cfg.STEP += 1
                STATS["n"] += 1
                helper.calls = 1
        print(cfg, STATS)
        """))
    script = Script(tree, "/p/train.py", Modules(find))
    loop = [n for n in tree.body if isinstance(n, ast.For)][0]
    eff = block_effects(script, loop.body, tree)
    assert sorted(eff.paths) == ["STATS['n']", "cfg.STEP"]


def test_a_call_on_an_object_of_no_known_class_may_run_any_method_of_that_name():
    """A trainer module calls its callbacks back (cb.on_epoch(...)): the
    script's on_epoch changes the script's globals, which the trainer's
    block cannot hold, so the analysis gives up on it; a method of that
    name that changes only its receiver adds nothing beyond it."""
    from flor.program.analysis import GiveUp, Modules

    files = {"/p/train.py": textwrap.dedent("""
        from mylib import Trainer
        class Printer:
            def on_epoch(self, trainer, model):
                opt.step()
        class Meter:
            def update(self, v):
                self.total += v
        """)}
    lib = ast.parse(textwrap.dedent("""
        class Trainer:
            def fit(self, model):
                for epoch in range(3):
                    for cb in self.callbacks:
                        cb.on_epoch(self, model)
                    self.meter.update(1)
        """))
    modules = Modules(lambda dotted, level, path: None)
    Script(ast.parse(files["/p/train.py"]), "/p/train.py", modules)
    script = Script(lib, "/p/mylib.py", modules)
    fit = script.classes["Trainer"].body[0]
    epoch = fit.body[0]
    with pytest.raises(GiveUp, match="on_epoch"):
        block_effects(script, [epoch.body[0]], fit)
    assert block_effects(script, [epoch.body[1]], fit).paths == ["self.meter"]


def _project_script(main, files, path="/p/train.py"):
    """The Script of `main` at `path`, with `files` ({dotted: source}) the
    project's modules (MISSING for one found nowhere)."""
    from flor.program.analysis import MISSING, Modules

    def find(dotted, level, where):
        if dotted not in files:
            return None
        return MISSING if files[dotted] is MISSING else (f"/p/{dotted}.py", files[dotted])

    tree = ast.parse(textwrap.dedent(main))
    return tree, Script(tree, path, Modules(find))


def _loop_effects(tree, script):
    loop = [n for n in tree.body if isinstance(n, ast.For)][0]
    return block_effects(script, loop.body, tree)


def test_calls_the_analysis_reaches_through_dotted_names_and_star_imports():
    from flor.program.analysis import MISSING, GiveUp

    ema = "def update(ema, net):\n    ema.mul_(0.9)\n"
    tree, script = _project_script("""
        import mylib.ema
        from tools import *
        for ep in range(2):
            for x in data:
                mylib.ema.update(avg, net)
                bump(counts)
        print(avg, counts)
        """, {"mylib": "", "mylib.ema": ema, "tools": "def bump(c):\n    c.append(1)\n"})
    assert sorted(_loop_effects(tree, script).paths) == ["avg", "counts"]
    # A module found nowhere (a path the script adds as it runs): give up.
    tree, script = _project_script("""
        from mylib import ema
        for ep in range(2):
            for x in data:
                ema.update(avg, net)
        """, {"mylib": MISSING, "mylib.ema": MISSING})
    with pytest.raises(GiveUp, match="cannot find"):
        _loop_effects(tree, script)
    # A name imported from a module that is found (a class of a library's
    # package: no module of that name) is no unseen module.
    tree, script = _project_script("""
        from lib.data import Loader
        for ep in range(2):
            for x in data:
                Loader(x).step()
        """, {"lib.data.Loader": MISSING})
    _loop_effects(tree, script)


def test_callables_held_in_variables_may_run_the_projects_callbacks_and_forwards():
    tree, script = _project_script("""
        CALLS = 0
        class Net:
            def forward(self, x):
                global CALLS
                CALLS += 1
        def validate(trainer):
            trainer.best = 1
        class Trainer:
            def fit(self):
                for epoch in range(3):
                    for cb in self.callbacks:
                        cb(self)
        t = Trainer(callbacks=[validate])
        net = Net()
        for ep in range(2):
            for x in data:
                net(x)
        print(CALLS)
        """, {})
    assert _loop_effects(tree, script).globals == ["CALLS"]
    fit = script.classes["Trainer"].body[0]
    epoch = fit.body[0]
    assert "self.best" in block_effects(script, [epoch.body[0]], fit).paths


def test_a_model_called_as_an_item_runs_the_projects_forwards():
    """models["G"](z) and heads[k](h) run a forward that counts its calls:
    the item (or, by a variable key, its container) changes."""
    e = effects("""
        class Counted:
            def forward(self, x):
                self.calls += 1
        models = {"G": Counted(), "D": Counted()}
        heads = [Counted(), Counted()]
        for ep in range(2):
            for z in data:
                fake = models["G"](z)
                out = heads[k](fake)
        """, "print(models, heads)")
    assert "models['G'].calls" in e.paths and "heads" in e.paths, e.paths


def test_a_comprehension_s_own_variable_is_never_state():
    """p in a probe's sum(p.grad.norm() for p in ...) is the generator's own:
    a path under it is dropped, so the probe leaves the loop's carried set
    (and its iteration checkpoints) as they were."""
    e = effects("""
        class Counted:
            def forward(self, x):
                self.calls += 1
        p = make_parser()  # another p, of the script's scope
        for ep in range(2):
            for x in data:
                loss = model(x)
                print(sum(p.grad.norm() for p in model.parameters()))
                print([q.norm() for q in ws], {k: v.norm() for k, v in d.items()})
        """, "print(loss)")
    assert not [p for p in e.paths if p.split(".")[0] in ("p", "q", "k", "v")], e.paths
    assert "p.grad.norm.calls" in e.dropped
    # A probe that only reads what it draws from changes none of it.
    e = effects("""
        for ep in range(2):
            for x in data:
                print(sum(p.grad.norm() ** 2 for p in model.parameters()).item())
                for p in model.parameters():
                    print(p.norm().item())
        """)
    assert "model" not in e.paths, e.paths


def test_a_comprehension_that_changes_its_items_changes_what_it_draws_from():
    e = effects("""
        for ep in range(2):
            for x in data:
                [o.step() for o in opts]
                [m.train() for m in models.values()]
                {k: p.add_(1) for net in nets for k, p in net.named_parameters()}
                total = sum(w for w in weights)
        """, "print(total)")
    assert {"opts", "models", "nets"} <= set(e.paths) and "weights" not in e.paths, e.paths


def test_a_model_a_trainer_method_calls_runs_the_projects_forwards():
    """self.nets[k](h) inside a method the block calls: the forward's change
    of self counts (not inside a forward itself, where every layer's call
    would run every forward)."""
    tree, script = _project_script("""
        class Block:
            def forward(self, x):
                self.calls += 1
                return self.lin(x)
        class Trainer:
            def train_epoch(self, X):
                for k in range(2):
                    X = self.nets[k](X)
                return X
        trainer = Trainer()
        for ep in range(2):
            for x in data:
                trainer.train_epoch(x)
        print(trainer)
        """, {})
    assert "trainer.nets" in _loop_effects(tree, script).paths


def test_a_method_taken_for_one_on_its_own_attribute_converges():
    """self.opt.step() on an optimizer of no known class may be Trainer.step,
    which changes self.opt: the paths it makes (self.opt.opt...) are capped,
    and the analysis of a transformer-sized model ends at once."""
    import time

    tree, script = _project_script("""
        class Attn:
            def forward(s, x):
                return s.o(s.q(x) @ s.k(x))
        class Block:
            def forward(s, x):
                x = x + s.at(s.n1(x))
                return x + s.ml(s.n2(x))
        class Net:
            def forward(s, x):
                for b in s.blocks:
                    x = b(x)
                return s.head(x)
        class Trainer:
            def step(s, x):
                s.opt.zero_grad()
                loss = s.model(x)
                loss.backward()
                s.opt.step()
                s.steps += 1
        trainer = Trainer()
        for ep in range(2):
            for x in data:
                trainer.step(x)
        print(trainer)
        """, {})
    t0 = time.perf_counter()
    paths = _loop_effects(tree, script).paths
    assert time.perf_counter() - t0 < 10 and "trainer" in paths, paths


def test_a_subclass_override_of_a_method_the_base_class_calls_counts():
    e = effects("""
        class Base:
            def step(self):
                self.on_after_step()
            def on_after_step(self):
                pass
        class EMA(Base):
            def on_after_step(self):
                self.n_updates += 1
        t = EMA()
        for ep in range(2):
            for x in data:
                t.step()
        """, "print(t)")
    assert "t.n_updates" in e.paths


def test_a_block_calls_what_the_analysis_followed():
    from flor.program.instrument import instrument

    src = textwrap.dedent("""
        from mylib.engine import train_one_epoch as tr1
        for ep in range(2):
            tr1(model, opt, loader)
        """)
    files = {"mylib": "", "mylib.engine": "def train_one_epoch(m, o, l):\n"
                                         "    for x in l:\n        o.step()\n"}
    from flor.program.analysis import Modules

    mods = Modules(lambda d, lv, p: (f"/p/{d}.py", files[d]) if d in files else None)
    inst = instrument(src, "/p/train.py", lambda line: f"train.py:{line}", mods)
    (block,) = inst.blocks
    assert "train_one_epoch" in block.calls and "tr1" in block.calls


def _method_block(src, cls, method, index=0):
    """The effects of the `index`th statement of `cls.method` in src."""
    tree = ast.parse(textwrap.dedent(src))
    script = Script(tree)
    fn = next(m for m in script.classes[cls].body if getattr(m, "name", None) == method)
    return block_effects(script, [fn.body[index]], fn)


HOOKED = """
    def recorder(store, name):
        def hook(module, inputs, output):
            store.setdefault(name, []).append(output.mean().item())
        return hook

    class Trainer:
        def __init__(self, model):
            self.model, self.calls, self.peaks, self.acts = model, 0, [], {}
            model[0].register_forward_hook(self._count)
            model[1].register_forward_hook(lambda m, i, o: self.peaks.append(o.max()))
            model[2].register_forward_hook(recorder(self.acts, "head"))

        def _count(self, module, inputs, output):
            self.calls += 1

        def train_epoch(self, X, Y):
            for x, y in zip(X, Y):
                loss(self.model(x), y).backward()
    """


def test_hooks_handed_over_change_what_the_block_that_runs_them_holds():
    """A forward hook (a bound method of the trainer, a lambda, a closure a
    factory makes) runs when the block calls the model: what it changes of
    the object it was taken from, or of the names it closes over, is the
    block's state, as the block names it (self here, the arguments of the
    factory's call there)."""
    e = _method_block(HOOKED, "Trainer", "train_epoch")
    assert {"self.calls", "self.peaks", "self.acts"} <= set(e.paths)

    factory_here = textwrap.dedent(HOOKED).replace(
        "        for x, y in zip(X, Y):",
        "        stats = {}\n"
        "        self.model[2].register_forward_hook(recorder(stats, 'h'))\n"
        "        for x, y in zip(X, Y):")
    e = _method_block(factory_here, "Trainer", "train_epoch", index=2)
    assert "stats" in e.paths


def test_a_hook_on_an_object_of_the_module_level_changes_that_object():
    e = effects("""
        class Stats:
            def hook(self, module, inputs, output):
                self.seen += 1
        stats = Stats()
        model.register_forward_hook(stats.hook)
        acts = []
        model.head.register_forward_hook(lambda m, i, o: acts.append(o))
        for epoch in range(2):
            for x in data:
                model(x)
        """, "print(stats.seen, acts)")
    assert {"stats.seen", "acts"} <= set(e.paths)


def test_a_hook_whose_object_the_block_cannot_name_gives_up():
    """The block is not in a method of the hook's class and binds no
    instance of it: the analysis cannot say what the hook changes."""
    from flor.program.analysis import GiveUp

    with pytest.raises(GiveUp, match="Trainer._count"):
        effects(textwrap.dedent(HOOKED) + textwrap.dedent("""
            model = make_model()
            for epoch in range(2):
                for x in data:
                    model(x)
            """))


def test_a_method_result_changed_in_place_changes_its_receiver():
    e = effects("""
        for epoch in range(2):
            for x in data:
                store.setdefault("acts", []).append(x)
                book.get("losses").extend([x])
        """, "print(store, book)")
    assert e.paths == ["store", "book"]


def test_hooks_bound_by_partial_defaults_and_callable_objects():
    """A hook's own parameters name the objects a ``functools.partial``
    bound or a lambda's defaults name; an instance of a class with
    ``__call__`` changes itself; a static factory's parameter is its
    argument (no self to skip); a callback called with arguments changes
    those (``cb(stats, loss)``)."""
    e = effects("""
        import functools
        def record(store, name, module, inp, out):
            store.setdefault(name, []).append(out)
        class SaveOutput:
            def __call__(self, module, inp, out):
                self.outputs.append(out)
        class Meter:
            def update(self, stats, loss):
                stats["n"] += 1
        class Hooks:
            @staticmethod
            def make(scale, storage):
                def hook(module, inp, out):
                    storage.append(scale * out)
                return hook
        acts, peaks, kept = {}, {}, []
        save = SaveOutput()
        meter = Meter()
        model[0].register_forward_hook(functools.partial(record, acts, "fc1"))
        model[1].register_forward_hook(save)
        model[2].register_forward_hook(lambda m, i, o, into=peaks: into.update(o=o))
        model[4].register_forward_hook(lambda m, i, o, s=book.setdefault("a", []): s.append(o))
        model[3].register_forward_hook(Hooks.make(2.0, kept))
        callbacks = [meter.update]
        for epoch in range(2):
            for x in data:
                model(x)
                for cb in callbacks:
                    cb(stats, x)
        """, "print(acts, save.outputs, peaks, kept, stats, book)")
    assert {"acts", "save.outputs", "peaks", "kept", "stats['n']", "book"} <= set(e.paths)
    assert "data" not in e.paths and "x" not in e.paths


def test_a_block_that_registers_a_hook_is_left_to_run():
    """No checkpoint holds the hooks a module has: a block that registers
    one, passed over by restoring it, would leave the hook out."""
    from flor.program.analysis import GiveUp

    with pytest.raises(GiveUp, match="register_full_backward_hook"):
        effects("""
            for epoch in range(2):
                for name, layer in model.named_children():
                    layer.register_full_backward_hook(functools.partial(seen, name))
            """)


def test_a_hook_of_a_module_level_object_is_a_global_of_a_function():
    tree = ast.parse(textwrap.dedent("""
        class Monitor:
            def __init__(self, model):
                self.stats = []
                model.register_forward_pre_hook(self.pre)
            def pre(self, module, inp):
                self.stats.append(inp)
        def train_epoch(model, opt):
            for x in data:
                model(x)
        monitor = Monitor(model)
        """))
    script = Script(tree)
    fn = script.functions["train_epoch"]
    e = block_effects(script, [fn.body[0]], fn)
    assert e.globals == ["monitor.stats"]


def test_a_hook_taken_from_a_loop_variable_is_one_object_of_many():
    """``[m.layer.register_forward_hook(m.record) for m in mons]``: the
    variable names one monitor of many (the last, where a loop leaves
    it), so the analysis gives up rather than name it."""
    from flor.program.analysis import GiveUp

    for register in ("handles = [m.layer.register_forward_hook(m.record) for m in mons]",
                     "for m in mons:\n    m.layer.register_forward_hook(m.record)"):
        with pytest.raises(GiveUp, match="ActMonitor.record"):
            effects(textwrap.dedent("""
                class ActMonitor:
                    def record(self, module, inp, out):
                        self.n += 1
                mons = [ActMonitor(model[0]), ActMonitor(model[2])]
                """) + register + textwrap.dedent("""
                for epoch in range(2):
                    for x in data:
                        model(x)
                """), "print(mons[0].n)")


def test_callbacks_the_analysis_must_see_or_give_up_on():
    """A callback registered by the project's own decorator is handed
    over; one whose changed argument has no name here gives up; a lambda
    a builtin runs at once, and a callable object the block reaches as an
    attribute, hand nothing over."""
    from flor.program.analysis import GiveUp

    e = effects("""
        CALLBACKS = []
        def on_step(fn):
            CALLBACKS.append(fn)
            return fn
        @on_step
        def track(loss):
            best["loss"] = loss
        for epoch in range(2):
            for x in data:
                for cb in CALLBACKS:
                    cb(x)
        """, "print(best)")
    assert "best['loss']" in e.globals
    with pytest.raises(GiveUp, match="an argument this code has no name for"):
        effects("""
            log = lambda store, v: store.append(v)
            for epoch in range(2):
                for x in data:
                    log(pick("train"), x)
            """)
    tree = ast.parse(textwrap.dedent("""
        class Accuracy:
            def __init__(self):
                self.correct = 0
            def __call__(self, out, y):
                self.correct += 1
        class Trainer:
            def __init__(self):
                self.metric = Accuracy()
            def train_epoch(self):
                for x in data:
                    self.metric(model(x), x)
        def main():
            seen = []
            list(map(lambda p: seen.append(p), model.parameters()))
        """))
    script = Script(tree)
    fn = script.classes["Trainer"].body[1]
    assert "self" in block_effects(script, [fn.body[0]], fn).paths  # (self.metric.correct)


def test_a_block_that_removes_a_hook_is_left_to_run():
    from flor.program.analysis import GiveUp

    with pytest.raises(GiveUp, match="handle.remove"):
        effects("""
            handle = model.register_forward_hook(record)
            for epoch in range(2):
                for x in data:
                    model(x)
                    if epoch == 1:
                        handle.remove()
            """)


def test_objects_a_loop_changes_through_its_variable_are_its_lists():
    """``for k in callbacks: k.on_batch_end(loss)`` (or ``cb(loss)``, a
    callable object) changes the objects the list holds: the list counts."""
    for body in ("k.bad += 1", "k.on_batch_end(x)", "k(x)"):
        e = effects(f"""
            class Early:
                def on_batch_end(self, loss):
                    self.bad += 1
            callbacks = [Early()]
            for epoch in range(2):
                for x in data:
                    for k in callbacks:
                        {body}
            """, "print(callbacks)")
        assert "callbacks" in e.paths, body
    e = effects("""
        for epoch in range(2):
            for x in data:
                for k in callbacks:
                    print(k)
        """, "print(callbacks)")
    assert "callbacks" not in e.paths
