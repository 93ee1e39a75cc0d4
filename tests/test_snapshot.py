"""flor.snapshot: isolated copies of containers, tensors, arrays and stateful objects."""
import collections
import copy
import threading

import numpy as np
import pytest
import torch

import flor

from conftest import run_py

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

Point = collections.namedtuple("Point", "x y")


class Plain:
    def __init__(self, t, n):
        self.t = t
        self.n = n


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a = a
        self.b = b


class Tagged(dict):
    """A dict subclass with an attribute of its own."""


class OwnCopy:
    def __init__(self, v):
        self.v = v
        self.copies = 0

    def __deepcopy__(self, memo):
        c = OwnCopy(copy.deepcopy(self.v, memo))
        c.copies = self.copies + 1
        return c


class Handle:
    """Copies as itself, as Accelerate's Accelerator does: a handle to state
    held elsewhere (what it wraps), with a counter of its own."""

    def __init__(self, model):
        self.models = [model]
        self.lock = threading.Lock()
        self.step, self.name, self.scale = 0, "acc", 1.0

    def __deepcopy__(self, memo):
        return self


def roundtrip(obj):
    return flor.snapshot(obj).restore()


@pytest.mark.unit
def test_containers_are_copied_and_atoms_shared():
    s = "a string"
    inner = [1, 2.5, s, b"bytes", None, True]
    obj = {"inner": inner, "t": (1, inner), "set": {1, 2}, "fs": frozenset({3})}
    out = roundtrip(obj)
    assert out == obj
    assert out is not obj and out["inner"] is not inner
    assert out["t"][1] is out["inner"]  # sharing kept inside the copy
    assert out["inner"][2] == s


@pytest.mark.unit
def test_subclasses_keep_type_and_attributes():
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    od.extra = "kept"
    dd = collections.defaultdict(list, {"k": [1]})
    tagged = Tagged(x=1)
    tagged.note = "n"
    obj = [od, dd, Point(1, [2]), tagged, collections.Counter("aab")]
    out = roundtrip(obj)
    assert type(out[0]) is collections.OrderedDict and list(out[0]) == ["b", "a"]
    assert out[0].extra == "kept"
    assert type(out[1]) is collections.defaultdict and out[1].default_factory is list
    out[1]["new"].append(3)
    assert out[2] == Point(1, [2]) and type(out[2]) is Point
    assert type(out[3]) is Tagged and out[3].note == "n" and out[3] == {"x": 1}
    assert out[4] == collections.Counter("aab")


@pytest.mark.unit
def test_cycles_and_shared_references():
    a = [1]
    a.append(a)
    d = {"self": None}
    d["self"] = d
    shared = [9]
    obj = {"a": a, "d": d, "s1": shared, "s2": (shared,)}
    out = roundtrip(obj)
    assert out["a"][1] is out["a"]
    assert out["d"]["self"] is out["d"]
    assert out["s2"][0] is out["s1"]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.int64,
              torch.float64, torch.complex64, torch.uint8]
)
@pytest.mark.unit
def test_tensor_dtypes(dtype):
    base = torch.arange(24).reshape(4, 6)
    t = (base % 2).to(dtype) if dtype is torch.bool else base.to(dtype)
    out = roundtrip({"t": t})["t"]
    assert out.dtype == dtype and torch.equal(out, t)


@pytest.mark.unit
def test_tensor_shapes_views_and_strides():
    base = torch.arange(60.0).reshape(3, 4, 5)
    obj = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "transposed": base.transpose(0, 2),
        "stepped": base[:, ::2, 1:],
        "base": base,
        "view": base[1],
    }
    out = roundtrip(obj)
    for k, v in obj.items():
        assert torch.equal(out[k], v), k
        assert out[k].shape == v.shape and out[k].stride() == v.stride(), k
    assert out["scalar"].dim() == 0
    # views of one storage still share it after the round trip
    assert out["view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    out["base"][1, 0, 0] = -1
    assert out["view"][0, 0] == -1


@pytest.mark.unit
def test_cpu_tensors_are_copied_not_aliased():
    t = torch.ones(1000)
    p = torch.nn.Parameter(torch.zeros(10))
    snap = flor.snapshot({"t": t, "p": p})
    t.add_(5)
    with torch.no_grad():
        p.add_(7)
    out = snap.restore()
    assert torch.equal(out["t"], torch.ones(1000))
    assert torch.equal(out["p"], torch.zeros(10))
    assert out["t"].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.unit
def test_parameters_and_requires_grad():
    p = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(4, requires_grad=True)
    out = roundtrip([p, frozen, leaf])
    assert type(out[0]) is torch.nn.Parameter and out[0].requires_grad
    assert type(out[1]) is torch.nn.Parameter and not out[1].requires_grad
    assert type(out[2]) is torch.Tensor and out[2].requires_grad and out[2].is_leaf
    assert torch.equal(out[0], p)


@pytest.mark.unit
def test_tied_weights_stay_tied():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = roundtrip(model)
    assert set(sd) == {"emb.weight", "head.weight"}
    assert sd["emb.weight"].untyped_storage().data_ptr() == sd["head.weight"].untyped_storage().data_ptr()
    snap = flor.snapshot(model)
    assert snap.nbytes == 10 * 4 * 4  # one storage, copied once


def _train_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _fresh_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def assert_same_state(a, b):
    ma, oa, sa = a
    mb, ob, sb = b
    for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    sda, sdb = oa.state_dict(), ob.state_dict()
    assert sda["param_groups"] == sdb["param_groups"]
    for k in sda["state"]:
        for name, v in sda["state"][k].items():
            assert torch.equal(v, sdb["state"][k][name]), (k, name)
    assert sa.state_dict() == sb.state_dict()


@pytest.mark.unit
def test_model_optimizer_scheduler_restore_in_place():
    live = _train_state()
    snap = flor.snapshot(list(live))
    # training goes on after the snapshot
    model, opt, sched = live
    loss = model(torch.randn(5, 8)).sum()
    loss.backward()
    opt.step()
    sched.step()
    fresh = _fresh_state()
    flor.restore(list(fresh), snap.restore())
    expected = _train_state()
    assert_same_state(fresh, expected)


@pytest.mark.unit
def test_numpy_arrays_and_buffers():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    obj = {
        "a": a,
        "strided": a[:, ::2],
        "zero_d": np.array(5, dtype=np.int16),
        "bools": np.array([True, False]),
        "objects": np.array([{"k": 1}, None], dtype=object),
        "dt": np.array(["2020-01-01"], dtype="datetime64[D]"),
        "ba": bytearray(b"abc"),
        "scalar": np.float32(2.5),
    }
    snap = flor.snapshot(obj)
    a[0, 0] = 99
    obj["ba"][0] = ord("z")
    out = snap.restore()
    assert out["a"][0, 0] == 0 and np.array_equal(out["strided"], np.arange(12.0).reshape(3, 4)[:, ::2])
    assert out["zero_d"].shape == () and out["zero_d"] == 5
    assert out["bools"].dtype == bool
    assert out["objects"][0] == {"k": 1} and out["objects"][0] is not obj["objects"][0]
    assert out["dt"][0] == np.datetime64("2020-01-01")
    assert out["ba"] == bytearray(b"abc")
    assert out["scalar"] == np.float32(2.5)


@pytest.mark.unit
def test_user_objects_are_copied_through_their_protocol():
    t = torch.ones(3)
    obj = [Plain(t, 1), Slotted([1], t), OwnCopy([5])]
    snap = flor.snapshot(obj)
    t.add_(1)
    obj[1].a.append(2)
    out = snap.restore()
    assert torch.equal(out[0].t, torch.ones(3)) and out[0].n == 1
    assert out[1].a == [1] and torch.equal(out[1].b, torch.ones(3))
    assert out[2].v == [5] and out[2].copies == 1


@pytest.mark.unit
def test_torch_constants_and_generators():
    g = torch.Generator().manual_seed(7)
    obj = {"dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
           "layout": torch.strided, "fmt": torch.channels_last, "gen": g}
    snap = flor.snapshot(obj)
    expected = torch.rand(4, generator=g)  # advances the live generator
    out = snap.restore()
    assert out["dtype"] is torch.float16 and out["device"] == torch.device("cpu")
    assert out["size"] == torch.Size([2, 3]) and type(out["size"]) is torch.Size
    assert out["layout"] is torch.strided and out["fmt"] is torch.channels_last
    assert torch.equal(torch.rand(4, generator=out["gen"]), expected)


class ReadsItsArray:
    """A Python class whose own __setstate__ reads the array of its state."""
    calls = 0

    def __init__(self, a, shared):
        self.a, self.shared = a, shared

    def __setstate__(self, state):
        ReadsItsArray.calls += 1
        self.n = state["a"].shape[0]
        self.__dict__.update(state)


@pytest.mark.unit
def test_a_generator_that_reads_the_array_of_its_state_is_copied_whole():
    # numpy's bit generators read the array of their state in their own
    # __setstate__, which the skeleton holds as a placeholder
    rs, mt = np.random.RandomState(7), np.random.Generator(np.random.MT19937(8))
    shared = [rs]
    snap = flor.snapshot({"rs": rs, "again": shared, "bg": rs._bit_generator, "mt": mt,
                          "a": np.arange(3)})
    expected = rs.rand(4), mt.random(4)  # advance the live generators
    out = snap.restore()
    assert out["again"][0] is out["rs"] and out["rs"] is not rs  # shared, and a copy
    assert out["bg"] is out["rs"]._bit_generator  # the RandomState's own, still
    assert np.array_equal(out["rs"].rand(4), expected[0])
    assert np.array_equal(out["mt"].random(4), expected[1])
    assert np.array_equal(out["a"], np.arange(3))


@pytest.mark.unit
def test_a_python_class_that_reads_the_array_of_its_state_is_refused_by_its_path():
    # Its state may share objects with the rest of the snapshot (`shared`),
    # which a deep copy of its own would split: it is not copied that way.
    shared = [1]
    with pytest.raises(AttributeError, match="shape") as info:
        flor.snapshot({"r": ReadsItsArray(np.zeros(2), shared), "shared": shared})
    assert "obj['r']" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert ReadsItsArray.calls == 1


@pytest.mark.unit
def test_nbytes_counts_each_storage_once():
    t = torch.zeros(256)  # 1 KiB
    snap = flor.snapshot({"a": t, "b": t, "c": t[10:20], "n": np.zeros(8, np.int32)})
    assert snap.nbytes == 1024 + 32
    assert snap.narrays == 3  # "a" and "b" are one tensor object: one entry


@pytest.mark.unit
def test_uncopyable_object_names_its_path():
    obj = {"ok": [1], "loader": {"lock": threading.Lock()}}
    with pytest.raises(TypeError) as info:
        flor.snapshot(obj)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "obj['loader']" in notes and "lock" in notes


@pytest.mark.unit
def test_sparse_and_meta_tensors_are_refused_clearly():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match="to_dense"):
        flor.snapshot({"s": sparse})
    with pytest.raises(TypeError, match="meta"):
        flor.snapshot(torch.empty(3, device="meta"))
    with pytest.warns(UserWarning, match="deprecated"):  # torch deprecates quantized dtypes
        q = torch.quantize_per_tensor(torch.ones(4), scale=0.1, zero_point=0, dtype=torch.qint8)
    with pytest.raises(TypeError, match="quantized"):
        flor.snapshot([q])


def test_snapshot_of_plain_objects_does_not_import_torch():
    out = run_py(
        """
        import sys, flor
        s = flor.snapshot({"a": [1, 2, {"b": (3, 4)}], "c": bytearray(b"x")})
        assert s.restore() == {"a": [1, 2, {"b": (3, 4)}], "c": bytearray(b"x")}
        print("torch" in sys.modules)
        """
    )
    assert out.stdout.strip() == "False"


def test_walk_does_not_initialise_cuda():
    out = run_py(
        """
        import torch, flor
        m = torch.nn.Linear(4, 4)
        s = flor.snapshot({"m": m, "o": torch.optim.SGD(m.parameters(), lr=0.1)})
        s.restore()
        print(torch.cuda.is_initialized())
        """
    )
    assert out.stdout.strip() == "False"


@pytest.mark.unit
def test_large_dict_of_small_lists():
    obj = {i: [i, i + 1, i + 2] for i in range(100_000)}
    snap = flor.snapshot(obj)
    obj[5].append(0)
    out = snap.restore()
    assert out[5] == [5, 6, 7] and len(out) == 100_000


@pytest.fixture
def known_handle(monkeypatch):
    """Handle (above) taken as a known handle, as Accelerate's Accelerator
    is, with its scaler's state and its config's values kept."""
    from flor import handles

    monkeypatch.setitem(handles.KNOWN, f"{Handle.__module__}.{Handle.__qualname__}",
                        ("scaler", "config"))
    monkeypatch.setattr(handles, "_kinds", {})


class Config:
    def __init__(self):
        self.iteration, self.name, self.paths = 0, "run", ["a"]


@pytest.mark.unit
def test_a_handle_keeps_its_plain_values_and_its_parts_state(tmp_path, known_handle):
    model = torch.nn.Linear(2, 2)
    h = Handle(model)
    h.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    h.config = Config()
    h.step, h.config.iteration = 7, 3
    snap = flor.snapshot({"acc": h, "model": model})
    saved = snap.restore()["acc"]
    # Not the live object, nor its lock and references: its own plain
    # values, its scaler's state dict and its config's plain values.
    assert saved is not h and saved.attrs == {"step": 7, "name": "acc", "scale": 1.0}
    assert saved.parts["scaler"][0] == "state_dict" and saved.parts["scaler"][1]["scale"] == 256.0
    assert saved.parts["config"] == ("values", {"iteration": 3, "name": "run"})
    h.step, h.scale, h.config.iteration = 0, 2.0, 9
    h.scaler.scale(torch.ones(()))  # (a GradScaler makes its scale at its first use)
    h.scaler.update(new_scale=1.0)
    assert flor.restore(h, saved) is h
    assert (h.step, h.scale, h.models[0], h.config.iteration) == (7, 1.0, model, 3)
    assert h.scaler.get_scale() == 256.0
    # A checkpoint file holds it, and the safe loader admits it.
    path = str(tmp_path / "h.flor")
    flor.save({"acc": h}, path)
    h.step = 1
    flor.restore(h, flor.load(path)["acc"])
    assert h.step == 7
    with pytest.raises(ValueError, match="handle of a .*Handle"):
        flor.restore(Plain(1, 2), saved)
    with pytest.raises(ValueError, match="no live one there"):
        flor.restore({}, {"acc": saved})


@pytest.mark.unit
def test_a_handle_s_values_go_only_onto_what_the_live_one_holds(known_handle):
    from flor.handles import Handle as Kept

    h = Handle(torch.nn.Linear(2, 2))
    kind = f"{Handle.__module__}.{Handle.__qualname__}"
    for attrs in ({"add": "not a method"}, {"__class__": 1}, {"step": "seven"}):
        with pytest.raises(ValueError, match="cannot restore"):
            Kept(kind, attrs).apply(h)
    for damaged in (Kept(kind, [1]), Kept(kind, {}, {"scaler": 5}), Kept(kind, {}, [("x", 1)])):
        with pytest.raises(ValueError, match="damaged handle"):
            damaged.apply(h)
    assert h.step == 0 and callable(h.__deepcopy__)


class SelfCopy:
    def __init__(self):
        self.history = [1.0, 2.0]

    def __deepcopy__(self, memo):
        return self


@pytest.mark.unit
def test_another_class_whose_copy_is_itself_is_kept_whole():
    from flor.handles import Handle as Kept

    out = flor.snapshot([SelfCopy(), np.float32(2.5)]).restore()
    assert not isinstance(out[0], Kept) and out[0].history == [1.0, 2.0]
    assert out[1] == np.float32(2.5)
