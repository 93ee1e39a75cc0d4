"""The digest of a carried object (flor/runtime/digest.py): every part of
its state counts, and it is the same in another process."""
import collections
import random
import threading

import pytest

from conftest import run_py

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

torch = pytest.importorskip("torch")
from flor.runtime.digest import Opaque, covered, digest  # noqa: E402


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.updates = 0


class Holder:
    def __init__(self):
        self.items = {"b", "a", "c"}
        self.losses = [0.5] * 40
        self.step = 3


@pytest.mark.unit
def test_a_module_attribute_outside_its_state_dict_counts():
    torch.manual_seed(0)
    m = Counter()
    before = digest(m)
    m.updates += 1
    assert digest(m) != before
    m.updates -= 1
    assert digest(m) == before
    m.eval()
    assert digest(m) != before


@pytest.mark.unit
def test_tensor_bytes_count_unless_a_fingerprint_covers_them():
    torch.manual_seed(0)
    m = Counter()
    before, shape_only = digest(m), digest(m, covered([m]))
    with torch.no_grad():
        m.fc.weight[0, 0] += 1.0
    assert digest(m) != before
    assert digest(m, covered([m])) == shape_only


@pytest.mark.unit
def test_a_tensor_counts_by_its_whole_storage_as_a_checkpoint_restores_it():
    """Unlike a state fingerprint (version 3), a digest reads the whole
    storage of a view, as checkpoints hold it: the digests that records of
    earlier versions of flor stored keep verifying their restores."""
    base = torch.arange(16.0)
    view = base[4:8]
    before = digest([view])
    base[12] = -1.0  # a byte no tensor views, which a restore puts back too
    assert digest([view]) != before


@pytest.mark.unit
def test_optimizer_state_and_hyperparameters_count():
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    before = digest(opt)
    opt.param_groups[0]["lr"] = 0.05
    assert digest(opt) != before
    opt.param_groups[0]["lr"] = 0.1
    assert digest(opt) == before
    with torch.no_grad():
        opt.state[m.weight]["exp_avg"].add_(1.0)
    assert digest(opt) != before


@pytest.mark.unit
def test_plain_values_generators_and_aliasing():
    h = Holder()
    before = digest(h)
    h.losses[-1] = 0.25
    assert digest(h) != before
    g = torch.Generator().manual_seed(1)
    r = random.Random(1)
    gd, rd = digest(g), digest(r)
    torch.rand(1, generator=g)
    r.random()
    assert digest(g) != gd and digest(r) != rd
    shared = [1]
    assert digest([shared, shared]) != digest([shared, [1]])
    d = collections.defaultdict(list, a=[1])
    assert digest(d) != digest(dict(a=[1]))


class Handle:  # copies as itself, as Accelerate's Accelerator does
    def __init__(self):
        self.step, self.refs = 0, [1.0]
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    def __deepcopy__(self, memo):
        return self


@pytest.mark.unit
def test_a_known_handle_counts_by_what_a_checkpoint_keeps_of_it(monkeypatch):
    from flor import handles

    h = Handle()
    before = digest(h)
    h.refs.append(2.0)  # a class flor does not know: all of its state counts
    assert digest(h) != before
    monkeypatch.setitem(handles.KNOWN, f"{Handle.__module__}.{Handle.__qualname__}",
                        ("scaler",))
    monkeypatch.setattr(handles, "_kinds", {})
    before = digest(h)
    h.refs.append(threading.Lock())  # what a known handle refers to is not its state
    assert digest(h) == before
    h.step += 1
    assert digest(h) != before
    h.step -= 1
    h.scaler.scale(torch.ones(()))
    h.scaler.update(new_scale=1.0)  # its parts' state is
    assert digest(h) != before


@pytest.mark.unit
def test_an_object_pickle_cannot_reduce_is_opaque():
    class WithLock:
        def __init__(self):
            self.lock = threading.Lock()

    with pytest.raises(Opaque, match="lock"):
        digest(WithLock())


def test_the_same_in_another_process_whatever_its_string_hashes():
    code = """
        import torch
        from flor.runtime.digest import digest
        torch.manual_seed(0)
        state = {"seen": {"alpha", "beta", "gamma", "delta"}, "w": torch.randn(4),
                 "nested": [frozenset({"x", "y"}), ("t", 1.5)]}
        print(digest(state))
    """
    got = {run_py(code, env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2", "3")}
    assert len(got) == 1, got


def _saved(objs, carried):
    """An iteration checkpoint of `objs` as a restore reads it (copies)."""
    import copy

    from flor.runtime import carry
    sig = carry.Carried(objs).capture(None)[1]
    saved = carry.payload("train.py:3", 0, 4, copy.deepcopy(list(objs)), sig, 0, 7, carried)
    return saved, sig


@pytest.mark.unit
def test_a_restore_verifies_every_carried_object_or_says_what_it_could_not():
    from flor.errors import FlorReplayError
    from flor.runtime import carry
    stats, history = {"calls": 4}, [0.5, 0.25]
    saved, _ = _saved((stats, history), carry.digests((stats, history), None))
    live = ({"calls": 0}, [])
    values, unverified = carry.restore(saved, carry.Carried(live), "train.py:3", 0, 4, None,
                                       "iteration checkpoint f")
    assert values is None and unverified == [] and live == (stats, history)

    older, _ = _saved((stats, history), None)  # a record made before digests
    del older["carried"]
    _, unverified = carry.restore(older, carry.Carried(({"calls": 0}, [])), "train.py:3", 0,
                                  4, None, "iteration checkpoint f")
    assert unverified == ["state[0] (a dict) (the record took no digest of it)",
                          "state[1] (a list) (the record took no digest of it)"]

    # What the record had differs from what the checkpoint holds.
    wrong, _ = _saved((stats, history), carry.digests(({"calls": 5}, history), None))
    with pytest.raises(FlorReplayError, match=r"differs from what the record had at the end "
                       r"of iteration 4: state\[0\] \(a dict\) \("):
        carry.restore(wrong, carry.Carried(({"calls": 0}, [])), "train.py:3", 0, 4, None,
                      "iteration checkpoint f")


@pytest.mark.unit
def test_a_tuple_counts_by_its_value_wherever_it_is_met():
    """Version 2: two param groups sharing AdamW's default betas tuple (as
    nanoGPT's configure_optimizers makes them) digest as their restored
    copy, which has a tuple per group; version 1, which old records hold,
    told them apart."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert opt.param_groups[0]["betas"] is opt.param_groups[1]["betas"]
    skip = covered([m, opt])
    recorded = {v: digest(opt, skip, v) for v in (1, 2)}
    copy = torch.optim.AdamW([{"params": g["params"]} for g in groups], lr=1.0)
    copy.load_state_dict(_round_trip(opt.state_dict()))
    assert copy.param_groups[0]["betas"] is not copy.param_groups[1]["betas"]
    skip = covered([m, copy])
    assert digest(copy, skip, 2) == recorded[2] and digest(copy, skip) == recorded[2]
    assert digest(copy, skip, 1) != recorded[1]
    pair, other = (1, 2), tuple([1, 2])
    assert pair is not other and digest([pair, pair]) == digest([pair, other])
    assert digest([pair, pair], version=1) != digest([pair, other], version=1)
    inner = [1]  # a list shared through tuples is still shared
    assert digest([(inner,), (inner,)]) != digest([(inner,), ([1],)])
    with pytest.raises(ValueError, match="no digest version 3"):
        digest(pair, version=3)


def _round_trip(obj):
    """`obj` saved to a checkpoint file and loaded back."""
    import os
    import tempfile

    from flor import checkpoint
    with tempfile.TemporaryDirectory() as d:
        checkpoint.save(obj, os.path.join(d, "x.flor"))
        return checkpoint.load(os.path.join(d, "x.flor"), trusted=True)


@pytest.mark.unit
def test_a_restore_compares_digests_of_the_version_the_record_took():
    from flor.errors import FlorReplayError
    from flor.runtime import carry
    pair = (0.9, 0.95)
    state = [{"betas": pair}, {"betas": pair}]  # one tuple, twice
    restored = [{"betas": tuple(list(pair))} for _ in range(2)]  # (a literal is one constant)
    saved, _ = _saved((state,), carry.digests((state,), None))
    assert saved["carried_version"] == 2
    values, unverified = carry.restore(saved, carry.Carried(([],)), "train.py:3", 0, 4, None,
                                       "iteration checkpoint f")
    assert unverified == []
    # A record made before version 2, whose checkpoint holds a tuple per dict.
    old, _ = _saved((restored,), carry.digests((state,), None, version=1))
    del old["carried_version"]
    with pytest.raises(FlorReplayError, match="differs from what the record had"):
        carry.restore(old, carry.Carried(([],)), "train.py:3", 0, 4, None,
                      "iteration checkpoint f")
    future, _ = _saved((state,), carry.digests((state,), None))
    future["carried_version"] = 9
    _, unverified = carry.restore(future, carry.Carried(([],)), "train.py:3", 0, 4, None,
                                  "iteration checkpoint f")
    assert unverified == ["state[0] (a list) (the record's digests are of version 9, which "
                          "this flor does not make)"]


@pytest.mark.unit
def test_tuple_subclasses_count_by_value_and_a_tuple_met_on_many_paths_is_walked_once(monkeypatch):
    """A namedtuple or torch.Size shared in two places is two tuples once
    restored in place; `x = (x, x)` twenty times over is met on a million
    paths, and the record digests it at every checkpoint."""
    from flor.runtime import digest as digest_module
    from flor.runtime import carry
    Best = collections.namedtuple("Best", "loss step")
    best, size = Best(1.5, 1000), torch.Size([4, 4])
    state = {"best": best, "last": best, "q": size, "k": size}
    live = {"best": Best(0.25, 20), "last": None, "q": torch.Size([1]), "k": None}
    saved, _ = _saved((state,), carry.digests((state,), None))
    _, unverified = carry.restore(saved, carry.Carried((live,)), "train.py:3", 0, 4, None,
                                  "iteration checkpoint f")
    assert unverified == [] and live == state and live["best"] is not live["last"]
    assert digest(Best(1.5, 1000)) != digest((1.5, 1000))  # the type counts

    x = (1,)
    for _ in range(20):
        x = (x, x)
    calls = []
    add = digest_module._Digest.add
    monkeypatch.setattr(digest_module._Digest, "add",
                        lambda self, obj: calls.append(1) or add(self, obj))
    digest([x, x])
    assert len(calls) < 200, len(calls)
    calls.clear()
    digest(x, version=1)
    assert len(calls) < 200, len(calls)


@pytest.mark.unit
def test_digests_of_two_versions_never_equal():
    """An older flor compares version 1 digests: it must refuse a newer
    record's version 2 digest, never take it for a match."""
    for obj in ([1, 2], {"a": (1, 2)}, "text", 3.5, None):
        assert digest(obj, version=1) != digest(obj, version=2)
