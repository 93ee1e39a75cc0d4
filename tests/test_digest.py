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
