"""Incremental checkpoints: a checkpoint refers to the unchanged tensor bytes
of earlier files of the same run instead of writing them again."""
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import flor

from conftest import ROOT

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core


def _finetune_state(seed=0):
    torch.manual_seed(seed)
    backbone = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    for p in backbone.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(256, 10)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    return backbone, head, opt


def _train_step(backbone, head, opt):
    x = torch.randn(16, 256)
    loss = head(backbone(x)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(backbone, head, opt):
    return {"backbone": backbone.state_dict(), "head": head.state_dict(),
            "opt": opt.state_dict()}


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("mode", ["thread", "inline"])
@pytest.mark.unit
def test_a_frozen_backbone_is_written_once(tmp_path, mode):
    import copy

    backbone, head, opt = _finetune_state()
    frozen = sum(p.numel() * 4 for p in backbone.parameters())
    saved = []
    with flor.Materializer(tmp_path, mode=mode, incremental=True) as mat:
        for i in range(5):
            _train_step(backbone, head, opt)
            state = _state(backbone, head, opt)
            estimate = mat.submit(f"ck{i}", state)
            saved.append(copy.deepcopy(state))
            if i:
                assert estimate < frozen / 10, estimate  # M counts what will be written
        mat.flush()
        st = mat.stats()
    changed = sum(sum(t.numel() * t.element_size() for t in s["head"].values()) +
                  sum(t.numel() * t.element_size() for v in s["opt"]["state"].values()
                      for t in v.values()) for s in saved)
    assert st["bytes_written"] <= frozen + 1.2 * changed, (st, frozen, changed)
    assert st["bytes_referenced"] >= 4 * frozen
    sizes = [os.path.getsize(tmp_path / f"ck{i}.flor") for i in range(5)]
    assert sizes[0] > frozen and max(sizes[1:]) < frozen / 10, sizes
    for i in range(5):
        _assert_same(flor.load(tmp_path / f"ck{i}.flor"), saved[i])


@pytest.mark.unit
def test_a_missing_earlier_file_is_named(tmp_path):
    backbone, head, opt = _finetune_state()
    with flor.Materializer(tmp_path, incremental=True) as mat:
        for i in range(3):
            _train_step(backbone, head, opt)
            mat.submit(f"ck{i}", _state(backbone, head, opt))
    os.unlink(tmp_path / "ck0.flor")
    with pytest.raises(flor.CheckpointCorrupt) as info:
        flor.load(tmp_path / "ck2.flor")
    assert str(tmp_path / "ck0.flor") in str(info.value) and "missing" in str(info.value)
    # A damaged earlier file is caught by the blob checksums kept in the later one.
    flor.save({"other": torch.ones(3)}, tmp_path / "ck0.flor")
    with pytest.raises(flor.CheckpointCorrupt):
        flor.load(tmp_path / "ck2.flor")


@pytest.mark.parametrize("mode", ["thread", "inline", "fork"])
@pytest.mark.unit
def test_remove_deletes_only_files_no_checkpoint_refers_to(tmp_path, mode):
    """A file that a later checkpoint refers to stays; one that none does
    goes, and no later checkpoint refers to its bytes: they are written
    again, and every file left loads."""
    frozen, w0, w1 = torch.randn(4096), torch.zeros(4096), torch.ones(4096)
    referred = mode != "fork"  # fork mode writes every blob: no file refers to another
    with flor.Materializer(tmp_path, mode=mode, incremental=True) as mat:
        mat.submit("a", {"frozen": frozen, "w": w0})
        mat.flush()
        mat.submit("b", {"frozen": frozen, "w": w1})  # refers to a for frozen
        mat.flush()
        assert mat.remove("a") is not referred
        assert mat.remove("b") is True  # nothing refers to its w
        assert os.path.exists(tmp_path / "a.flor") is referred
        assert not os.path.exists(tmp_path / "b.flor")
        mat.submit("c", {"frozen": frozen, "w": w1})  # w1: b is gone, so c holds it
        mat.submit("d", {"w": w0})
    for name, want in [("c", w1), ("d", w0)]:
        got = flor.load(tmp_path / f"{name}.flor")
        assert torch.equal(got["w"], want)
    assert torch.equal(flor.load(tmp_path / "c.flor")["frozen"], frozen)
    if referred:
        assert torch.equal(flor.load(tmp_path / "a.flor")["w"], w0)


@pytest.mark.parametrize("mode", ["thread", "inline"])
@pytest.mark.unit
def test_a_file_is_released_when_the_files_referring_to_it_are_removed(tmp_path, mode):
    x, y = torch.randn(4096), torch.randn(4096)
    with flor.Materializer(tmp_path, mode=mode, incremental=True) as mat:
        mat.submit("a", {"x": x})
        mat.flush()
        mat.submit("b", {"x": x, "y": y})  # refers to a for x
        mat.submit("c", {"y": y})  # refers to b for y
        mat.flush()
        assert mat.remove("a") is False and mat.remove("b") is False
        assert mat.remove("c") is True  # nothing refers to c
        assert mat.remove("b") is True and mat.remove("a") is True  # released in turn
        assert not os.listdir(tmp_path)
        mat.submit("d", {"x": x, "y": y})  # both written again
    got = flor.load(tmp_path / "d.flor")
    assert torch.equal(got["x"], x) and torch.equal(got["y"], y)


@pytest.mark.unit
def test_equal_tensors_stay_apart_after_loading(tmp_path):
    """Two tensors with equal bytes may refer to one region of an earlier
    file; loaded, they must not share memory (an optimizer's step counters
    are equal, and it increments each in place)."""
    a, b = torch.zeros(1000), torch.zeros(1000)
    with flor.Materializer(tmp_path, incremental=True) as mat:
        mat.submit("first", {"a": a})
        mat.submit("second", {"a": a, "b": b})
    loaded = flor.load(tmp_path / "second.flor")
    loaded["a"].add_(1)
    assert float(loaded["b"].sum()) == 0.0


@pytest.mark.unit
def test_a_name_cannot_be_written_twice(tmp_path):
    """Rewriting a file would pull bytes from under the files that refer to it."""
    with flor.Materializer(tmp_path, incremental=True) as mat:
        mat.submit("latest", {"w": torch.ones(10)})
        with pytest.raises(ValueError, match="incremental=False"):
            mat.submit("latest", {"w": torch.ones(10)})
    with flor.Materializer(tmp_path) as mat:  # not incremental: replacing is fine
        mat.submit("latest", {"w": torch.zeros(10)})
        mat.submit("latest", {"w": torch.full((10,), 2.0)})
    assert float(flor.load(tmp_path / "latest.flor")["w"][0]) == 2.0


@pytest.mark.unit
def test_names_a_reader_refuses_as_sources_are_never_referred_to(tmp_path):
    """A file whose name has spaces or non-ASCII letters holds its own bytes."""
    w = torch.arange(1000.0)
    with flor.Materializer(tmp_path, incremental=True) as mat:
        mat.submit("epoch 1", {"w": w})
        mat.submit("époque-2", {"w": w})
        mat.submit("epoch-3", {"w": w})
    for name in ("epoch 1", "époque-2", "epoch-3"):
        assert torch.equal(flor.load(tmp_path / f"{name}.flor")["w"], w)
    assert os.path.getsize(tmp_path / "epoch-3.flor") > 4000  # nothing to refer to


@pytest.mark.unit
def test_views_and_shared_storage_survive_references(tmp_path):
    base = torch.arange(100.0)
    obj = {"base": base, "view": base[10:20], "t": base.view(10, 10).t()}
    with flor.Materializer(tmp_path, incremental=True) as mat:
        mat.submit("one", obj)
        mat.submit("two", obj)
    two = flor.load(tmp_path / "two.flor")
    assert os.path.getsize(tmp_path / "two.flor") < 4096
    _assert_same(two, obj)
    two["base"][15] = -1
    assert two["view"][5] == -1  # one storage, as saved


KILLED = """
import sys, torch, flor
torch.manual_seed(0)
frozen = torch.nn.Linear(512, 512)
head = torch.nn.Linear(512, 4)
mat = flor.Materializer(sys.argv[1], incremental=True)
i = 0
while True:
    with torch.no_grad():
        head.weight.add_(0.5)
    mat.submit(f"ck{i:05d}", {"frozen": frozen.state_dict(), "head": head.state_dict(), "i": i})
    i += 1
    if i % 5 == 0:
        mat.flush()
        print(i, flush=True)
"""


def test_a_kill_at_any_moment_leaves_every_checkpoint_loadable(tmp_path):
    """SIGKILL while incremental checkpoints are being written: every file
    under its final name loads, with the values it was written with."""
    rng = random.Random(7)
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(KILLED))
    for trial in range(4):
        d = tmp_path / f"t{trial}"
        p = subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)
        for _ in range(rng.randrange(1, 6)):
            p.stdout.readline()  # a number of flushes, then a kill mid-write
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        names = sorted(f for f in os.listdir(d) if f.endswith(".flor"))
        assert names
        torch.manual_seed(0)
        frozen = torch.nn.Linear(512, 512)
        head = torch.nn.Linear(512, 4)
        for name in names:
            got = flor.load(d / name)
            i = got["i"]
            _assert_same(got["frozen"], frozen.state_dict())
            assert torch.allclose(got["head"]["weight"], head.weight + 0.5 * (i + 1))
