"""GPU paths: device-to-host snapshots through pinned staging buffers.

These run only where CUDA is available and skip cleanly elsewhere."""
import pytest
import torch

import flor
from flor import _core

from conftest import run_py

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_tensors_are_copied_to_the_host():
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    snap = flor.snapshot({"model": model, "opt": opt})
    with torch.no_grad():
        model.weight.add_(1.0)  # queued after the copy on the same stream
    out = snap.restore()
    for k, v in expected.items():
        assert out["model"][k].device.type == "cpu"
        assert torch.equal(out["model"][k], v)


def test_one_synchronisation_per_snapshot(monkeypatch):
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a) or real(*a))
    tensors = {f"t{i}": torch.randn(1000, device="cuda") for i in range(50)}
    flor.snapshot(tensors)
    assert len(calls) == 1


def test_shared_cuda_storage_stays_shared():
    base = torch.arange(100.0, device="cuda")
    out = flor.snapshot({"a": base, "b": base[10:20]}).restore()
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()


def test_load_back_to_the_device(tmp_path):
    t = torch.randn(10, device="cuda")
    flor.save({"t": t}, tmp_path / "x.flor")
    assert flor.load(tmp_path / "x.flor")["t"].device.type == "cuda"
    on_cpu = flor.load(tmp_path / "x.flor", map_location="cpu")["t"]
    assert on_cpu.device.type == "cpu" and torch.equal(on_cpu, t.cpu())


@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_materializer_writes_gpu_state(tmp_path, mode):
    model = torch.nn.Linear(64, 64).cuda()
    with flor.Materializer(tmp_path, mode=mode, batch_count=1) as m:
        m.submit("gpu", model)
    sd = flor.load(tmp_path / "gpu.flor", map_location="cpu")
    assert torch.equal(sd["weight"], model.weight.detach().cpu())


def test_staging_for_gpu_snapshots_is_reused():
    t = {"w": torch.randn(1 << 20, device="cuda")}
    flor.snapshot(t)
    fresh = _core.pool_stats()["fresh"]
    for _ in range(10):
        flor.snapshot(t)
    assert _core.pool_stats()["fresh"] == fresh


def test_cpu_only_snapshot_leaves_cuda_uninitialised():
    out = run_py(
        """
        import torch, flor
        flor.snapshot(torch.nn.Linear(4, 4))
        print(torch.cuda.is_initialized())
        """
    )
    assert out.stdout.strip() == "False"
