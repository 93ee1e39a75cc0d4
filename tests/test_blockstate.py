"""A block or iteration checkpoint of an object that holds modules and
optimizers (a class-based trainer, a dict of models) puts back what their
state dicts leave out: the training flags and counters of the modules, and
whether an LR scheduler saw its optimizer step.  A replay worker verifies a
restored iteration by its digest, which reads them."""
import random

import pytest
import torch

import flor.checkpoint
from flor.runtime import blockstate, digest

pytestmark = pytest.mark.unit  # in-process: `make check` runs these


class Trainer:
    def __init__(self, seed):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1),
                                         torch.nn.Linear(8, 2))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        self.parts = {"ema": [torch.nn.Linear(2, 2)]}
        self.epoch = 0


def _trained():
    t = Trainer(0)
    t.model(torch.ones(3, 4)).sum().backward()
    t.opt.step()
    t.sched.step()
    t.model.eval()                 # as an epoch's evaluation leaves it
    t.model[0].calls = 7           # a counter no state dict holds
    t.parts["ema"][0].eval()
    t.epoch = 3
    return t


def test_what_the_state_dicts_of_held_modules_and_optimizers_leave_out_is_restored(tmp_path):
    rec = _trained()
    path = str(tmp_path / "it.flor")
    flor.checkpoint.save(blockstate.payload("k", "[]", 0, ["self"], [rec]), path)
    saved = flor.checkpoint.load(path, trusted=True)
    assert saved["held"][0], saved.keys()

    live = Trainer(1)
    assert live.model.training and not hasattr(live.opt, "_opt_called")
    blockstate.apply(saved, [live])
    assert not live.model.training and not live.model[1].training
    assert live.model[0].calls == 7
    assert not live.parts["ema"][0].training
    assert live.opt._opt_called is True
    assert live.epoch == 3
    # What a replay worker checks after restoring an iteration.
    assert digest.digest(live) == digest.digest(rec)


def test_an_optimizer_that_never_stepped_is_restored_as_never_stepped(tmp_path):
    rec = Trainer(0)
    path = str(tmp_path / "it.flor")
    flor.checkpoint.save(blockstate.payload("k", "[]", 0, ["self"], [rec]), path)
    live = Trainer(1)
    blockstate.apply(flor.checkpoint.load(path, trusted=True), [live])
    assert not hasattr(live.opt, "_opt_called")
    assert digest.digest(live) == digest.digest(rec)


def test_held_looks_through_attributes_and_small_containers_only():
    m = torch.nn.Linear(1, 1)
    big = [0] * (blockstate.HELD_ITEMS + 1) + [m]

    class Box:
        pass

    box = Box()
    box.a = {"x": [m]}
    box.big = big
    box.again = m
    paths = [p for p, _ in blockstate.held(box, torch.nn.Module)]
    assert paths == [[["a", "a"], ["i", "x"], ["i", 0]]]
    assert blockstate.held(m, torch.nn.Module) == []


def test_held_names_tuple_keys_and_passes_over_objects_that_raise_when_inspected():
    import weakref

    class Config:
        __slots__ = ("lr",)

        def __getattr__(self, name):
            raise KeyError(name)

    class Gone:
        pass

    m = torch.nn.Linear(1, 1)
    gone = Gone()
    proxy = weakref.proxy(gone)
    del gone
    box = {("ema", 0): m, "cfg": Config(), "proxy": proxy}
    assert blockstate.held(box, torch.nn.Module) == [([["i", ("ema", 0)]], m)]


def test_held_visits_a_bounded_number_of_objects():
    tree = [[[[object() for _ in range(20)] for _ in range(20)] for _ in range(20)]]
    tree.append(torch.nn.Linear(1, 1))  # past the budget
    assert blockstate.held(tree, torch.nn.Module) == []
    assert blockstate.held([torch.nn.Linear(1, 1)] + tree, torch.nn.Module)


def test_a_block_that_binds_a_name_to_new_modules_is_not_restored_where_none_are_there():
    """ema = copy.deepcopy(model), or emas = (copy, copy), the first time:
    the checkpoint holds state dicts, and with no module there to load them
    into the execution runs instead; where modules are there they load."""
    one, pair = torch.nn.Linear(2, 2), (torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    saved = blockstate.payload("k", "[]", 0, ["ema", "emas"], [one, pair])
    fresh = blockstate.Expected(["ema", "emas"], [None, None], [True, True])
    assert "ema is bound to a module" in blockstate.unrestorable(saved, fresh)
    assert "emas is bound in the block" in blockstate.unrestorable(
        saved, fresh._replace(live=[torch.nn.Linear(2, 2), None]))
    live = [torch.nn.Linear(2, 2), (torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))]
    assert blockstate.unrestorable(saved, fresh._replace(live=live)) is None


def test_the_random_state_is_held_packed_and_put_back_exactly():
    """A checkpoint holds `random`'s 625 words as 2.5 KB of bytes (not 625
    int objects while it waits for the writer); putting it back, or one
    written as a tuple of ints, continues the same sequence."""
    random.seed(11)
    random.gauss(0, 1)  # a cached gauss_next is part of the state
    saved = blockstate.rng_state()
    version, words, gauss = saved["random"]
    assert isinstance(words, bytes) and len(words) == 625 * 4 and gauss is not None
    want = [random.random() for _ in range(5)] + [random.gauss(0, 1)]
    random.seed(99)
    blockstate.set_rng_state(saved)
    assert [random.random() for _ in range(5)] + [random.gauss(0, 1)] == want
    random.seed(11)
    random.gauss(0, 1)
    older = {"random": random.getstate()}  # as flor wrote it before: a tuple of ints
    random.seed(99)
    blockstate.set_rng_state(older)
    assert [random.random() for _ in range(5)] + [random.gauss(0, 1)] == want


def test_a_modules_loose_tensor_attributes_are_held_but_not_its_own_tensors(tmp_path):
    """A tensor a module keeps as a plain attribute (a running center its
    forward reassigns) is no state dict's: the checkpoint holds it and puts
    it back; a tensor that shares a parameter's or buffer's memory, or that
    requires gradients (an activation kept), is left out."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    m[0].center = torch.arange(4.0)
    m[0].alias = m[0].weight.detach()           # the weight's memory
    m[1].stats = m[1].running_mean.view(2, 2)   # a buffer's memory
    m[0].kept = m[0](torch.ones(2, 3))          # requires gradients
    m[1].seen = 5
    (attrs,) = blockstate.module_attributes([m])
    assert sorted(attrs) == ["0", "1"]
    assert sorted(attrs["0"]) == ["center", "in_features", "out_features"]
    assert sorted(attrs["1"]) == ["eps", "momentum", "num_features", "seen"]
    path = str(tmp_path / "b.flor")
    flor.checkpoint.save({"attrs": [attrs]}, path)
    saved = flor.checkpoint.load(path)
    m[0].center = torch.zeros(4)
    m[1].seen = 0
    blockstate.set_module_attributes([m], saved["attrs"])
    assert torch.equal(m[0].center, torch.arange(4.0)) and m[1].seen == 5


def test_a_tensor_attribute_tied_to_another_modules_weight_is_left_out():
    """A module that keeps another module's weight as a plain attribute
    (tied) must keep following it: restored as a copy, it would not."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tied = torch.nn.Module()
    tied.w = model.weight.detach()
    tied.own = torch.ones(2)
    assert blockstate.module_attributes([model, opt, tied])[2] == {"": {"own": tied.own}}
    assert blockstate.module_attributes([opt, tied])[1] == {"": {"own": tied.own}}
    trainer = Trainer(0)
    trainer.tied = torch.nn.Module()
    trainer.tied.w = trainer.model[0].weight.detach()
    (inner,) = blockstate.held_state([trainer])
    assert all("w" not in (state.get("attrs") or {}).get("", {}) for _, state in inner)


def test_realias_puts_back_views_of_the_live_weights_and_passes_over_the_rest():
    """What shared a module's memory when saved (a state dict kept without
    a copy, a row of the weight) shares the live module's after a restore;
    a sparse tensor (no storage to compare), and tensors of other memory,
    are left as they are."""
    from flor.runtime.aliases import realias

    model = torch.nn.Linear(3, 2)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flat = torch.arange(12.0)  # saved, the weight was a part of a larger buffer
    saved["weight"] = flat[2:8].view(2, 3)

    class Holder:
        pass

    h = Holder()
    sparse = torch.eye(3).to_sparse()
    other = torch.ones(2)
    h.adj, h.best, h.other = sparse, {"weight": saved["weight"]}, other
    h.rows = [saved["weight"][1]]
    h.tail = flat[6:12]  # beyond what the live weight's memory holds
    out = realias([(model, saved)], {id(saved): model}, [h, saved["weight"], sparse])
    assert out[1].data_ptr() == model.weight.data_ptr() and not out[1].requires_grad
    assert h.best["weight"].data_ptr() == model.weight.data_ptr()
    assert h.rows[0].data_ptr() == model.weight[1].data_ptr()
    assert out[2] is sparse and h.adj is sparse and h.other is other
    assert torch.equal(h.tail, torch.arange(6.0, 12.0))
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(h.best["weight"], model.weight.detach())
