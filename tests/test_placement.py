"""A replay loads checkpoints onto the CPU and copies them into live objects;
what it installs as it was loaded (a rebound name, a new dict entry) goes
back on the device the record had it on (flor/runtime/placement.py).

This machine has no GPU: the meta device stands in for one here, the only
change being that `usable` accepts it.  tests/test_cuda.py replays a
script whose skipped block rebinds CUDA tensors."""
import pytest
import torch

from flor.runtime import blockstate
from flor.runtime.placement import Devices

pytestmark = pytest.mark.unit  # in-process: `make check` runs these


class OnMeta(Devices):
    """Every recorded device is usable, and is the meta device."""

    def usable(self, name):
        return torch.device("meta")


def loaded(devices, *tensors, device="cuda:0"):
    """Note each tensor's storage as a checkpoint load would: on the CPU,
    recorded on `device`."""
    for t in tensors:
        devices.hook(t.untyped_storage(), device)


def apply(devices, saved_objs, live, rebind):
    saved = {"objs": saved_objs, "modes": [None] * len(live), "rng": blockstate.rng_state(),
             "devices": devices}
    return blockstate.apply(saved, live, rebind)


def test_rebound_tensors_go_to_their_recorded_device_and_views_stay_views():
    base = torch.arange(6.0)
    weight = torch.nn.Parameter(torch.ones(2))
    d = OnMeta()
    loaded(d, base, weight)
    x, view = base[:4], base[2:]
    out = apply(d, [x, (view, {"w": weight, weight: "state of w"})], [None, None], [True, True])
    px, (pview, by_name) = out
    assert (px.device.type, pview.device.type) == ("meta", "meta")
    assert px.shape == (4,) and pview.shape == (4,) and pview.storage_offset() == 2
    assert px.untyped_storage()._cdata == pview.untyped_storage()._cdata  # moved once
    w = by_name["w"]
    assert type(w) is torch.nn.Parameter and w.device.type == "meta" and w.requires_grad
    # A dict keyed by parameters (an optimizer's state) is keyed by the moved one.
    assert list(by_name) == ["w", w] and by_name[w] == "state of w"


def test_what_is_copied_into_a_live_object_stays_where_the_live_object_is():
    saved_t, new_entry, kept = torch.full((3,), 7.0), torch.ones(2), torch.zeros(2)
    d = OnMeta()
    loaded(d, saved_t, new_entry, kept)
    live_t, live_d = torch.zeros(3), {"kept": torch.ones(2)}
    out = apply(d, [saved_t, {"kept": kept, "new": new_entry}], [live_t, live_d],
                [False, False])
    assert out[0] is live_t and torch.equal(live_t, saved_t)
    assert out[1] is live_d and live_d["kept"].device.type == "cpu"
    assert live_d["new"].device.type == "meta"  # installed as loaded


def test_a_device_this_process_cannot_use_leaves_tensors_on_the_cpu():
    t = torch.arange(4.0)
    d = Devices()
    loaded(d, t, device="cuda:99")  # no machine has it: the CPU, as before
    (out,) = apply(d, [t], [None], [True])
    assert out is t and out.device.type == "cpu"


def test_tensors_recorded_on_the_cpu_are_not_noted():
    t = torch.arange(4.0)
    d = OnMeta()
    loaded(d, t, device="cpu")
    (out,) = apply(d, [t], [None], [True])
    assert out is t


def test_subclasses_stay_leaves_of_their_class():
    class Scaled(torch.nn.Parameter):
        pass

    w = Scaled(torch.ones(3))
    d = OnMeta()
    loaded(d, w)
    (out,) = apply(d, [w], [None], [True])
    assert type(out) is Scaled and out.is_leaf and out.requires_grad
    assert out.device.type == "meta"


def test_containers_are_written_only_where_a_value_moved():
    class Frozen(dict):
        def __setitem__(self, key, value):
            raise TypeError("immutable")

    moved = torch.ones(2)
    d = OnMeta()
    loaded(d, moved)
    (out,) = apply(d, [[Frozen(n=1), moved]], [None], [True])
    assert out[0] == {"n": 1} and out[1].device.type == "meta"


def test_a_module_that_keeps_its_extra_state_gets_it_on_the_device():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.total = torch.zeros(1)

        def get_extra_state(self):
            return {"total": self.total}

        def set_extra_state(self, state):
            self.total = state["total"]  # kept as handed, as a metric does

    live, rec = Counter(), Counter()
    state = rec.state_dict()
    d = OnMeta()
    loaded(d, *[v for v in state.values() if torch.is_tensor(v)], state["_extra_state"]["total"])
    (out,) = apply(d, [state], [live], [False])
    assert out is live and live.total.device.type == "meta"
    assert live.lin.weight.device.type == "cpu"  # copied into the live parameter


def test_what_was_placed_is_freed_with_the_value_without_the_cycle_collector():
    import gc
    import weakref

    t = torch.ones(4)
    d = OnMeta()
    loaded(d, t)
    gc.disable()
    try:
        (out,) = apply(d, [t], [None], [True])
        ref = weakref.ref(out)
        del out
        assert ref() is None
    finally:
        gc.enable()
