"""GPU paths: device-to-host snapshots through pinned staging buffers.

These run only where CUDA is available and skip cleanly elsewhere."""

import numpy as np
import pytest
import torch

import flor
from flor import _core

from conftest import run_py

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.unit
def test_cuda_tensors_are_copied_to_the_host():
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    snap = flor.snapshot({"model": model, "opt": opt})
    with torch.no_grad():
        model.weight.add_(1.0)  # queued after the snapshot on the training stream
    out = snap.restore()
    for k, v in expected.items():
        assert out["model"][k].device.type == "cpu"
        assert torch.equal(out["model"][k], v)


def _count_waits(monkeypatch):
    """Every way torch lets the host wait for the device, counted."""
    calls = []
    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                        (torch.cuda.Event, "synchronize")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _r=real, _n=name, **k:
                            calls.append(_n) or _r(*a, **k))
    return calls


@pytest.mark.parametrize("mode", ["staged", "ordered"])
@pytest.mark.unit
def test_a_snapshot_queues_its_copies_without_waiting_for_them(monkeypatch, mode):
    monkeypatch.setenv("FLOR_CUDA_COPY", mode)
    tensors = {f"t{i}": torch.randn(1000, device="cuda") for i in range(50)}
    tensors["big"] = torch.randn(1 << 22, device="cuda")
    expected = {k: v.cpu() for k, v in tensors.items()}
    calls = _count_waits(monkeypatch)
    snap = flor.snapshot(tensors)
    assert calls == []  # the training thread goes on at once
    out = snap.restore()  # a reader waits for the copies
    assert calls == ["synchronize"]
    assert all(torch.equal(out[k], v) for k, v in expected.items())


@pytest.mark.parametrize("mode", ["staged", "ordered"])
@pytest.mark.unit
def test_in_place_updates_queued_right_after_a_submit_never_reach_it(tmp_path, monkeypatch, mode):
    """256 MiB take milliseconds to copy: the updates are queued long before
    the copy ends, on the training stream, and must come after it."""
    monkeypatch.setenv("FLOR_CUDA_COPY", mode)
    state = {"w": torch.randn(1 << 26, device="cuda"),
             "small": [torch.randn(100, device="cuda") for _ in range(20)]}
    expected = {"w": state["w"].cpu(), "small": [t.cpu() for t in state["small"]]}
    with flor.Materializer(tmp_path) as m:
        m.submit("s", state)
        for _ in range(5):
            state["w"].mul_(3.0).add_(1.0)
            for t in state["small"]:
                t.zero_()
    back = flor.load(tmp_path / "s.flor", map_location="cpu")
    assert torch.equal(back["w"], expected["w"])
    assert all(torch.equal(a, b) for a, b in zip(back["small"], expected["small"]))


@pytest.mark.parametrize("mode", ["staged", "ordered"])
@pytest.mark.unit
def test_memory_a_snapshot_reads_is_not_reused_before_the_copy(monkeypatch, mode):
    """The script drops a tensor right after the snapshot and allocates
    another of its size, which the caching allocator would hand the same
    memory, and fills it."""
    monkeypatch.setenv("FLOR_CUDA_COPY", mode)
    x = torch.randn(1 << 24, device="cuda")
    expected = x.cpu()
    snap = flor.snapshot({"x": x})
    del x
    y = torch.full((1 << 24,), 7.0, device="cuda")
    assert torch.equal(snap.restore()["x"], expected)
    assert y[0].item() == 7.0


@pytest.mark.unit
def test_a_staging_buffer_is_reused_only_once_its_copies_have_landed():
    """A snapshot is dropped while its copy waits behind a second of queued
    kernels; the next snapshot, of host memory the same size, reuses its
    staging buffer, and the late copy must not land on top of it."""
    a = torch.randn(1 << 24, device="cuda")
    m = torch.randn(4096, 4096, device="cuda")
    for _ in range(300):  # queued on the training stream: the copy comes after
        m @ m
    flor.snapshot({"a": a})  # dropped at once
    b = torch.randn(1 << 24)
    expected = b.clone()
    snap = flor.snapshot({"b": b})
    torch.cuda.synchronize()  # every copy has landed by now
    assert torch.equal(snap.restore()["b"], expected)


@pytest.mark.unit
def test_a_gpu_fingerprint_reads_the_state_on_the_device(monkeypatch):
    """Version 2 fingerprints equal the host's for the same bytes, read
    with no copy of the state to the host and bounded device memory."""
    g = torch.Generator().manual_seed(0)
    host = {"big": torch.randn(3 << 20, generator=g), "odd": torch.randn(1001, generator=g),
            "bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
            "small": [torch.randn(7, generator=g) for _ in range(30)]}
    expected = _core.fingerprint(host)
    gpu = {"big": host["big"].cuda(), "odd": host["odd"].cuda(), "bytes": host["bytes"].cuda(),
           "small": [t.cuda() for t in host["small"]]}
    copies = []
    for owner in (torch.Tensor, torch.UntypedStorage):
        real = owner.cpu
        monkeypatch.setattr(owner, "cpu", lambda *a, _r=real, **k: copies.append(1) or _r(*a, **k))
    assert _core.fingerprint(gpu) == expected
    assert copies == []
    big = torch.randn(1 << 28, device="cuda")  # 1 GiB
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _core.fingerprint(big)
    assert torch.cuda.max_memory_allocated() - before <= 100 << 20


@pytest.mark.unit
def test_a_gpu_fingerprint_read_later_is_of_the_state_when_it_was_taken():
    """fingerprint(objs, 2, True) queues the device's part behind the work
    queued so far and returns without waiting for it; in-place updates
    queued after it never reach it."""
    g = torch.Generator().manual_seed(1)
    host = [torch.randn(1 << 20, generator=g), torch.randn(5, generator=g), np.arange(9.0)]
    gpu = [host[0].cuda(), host[1].cuda(), host[2]]
    _core.fingerprint(gpu, 2, True).value()  # kernels loaded, pinned memory allocated
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the stream is busy when the fingerprint is taken
    gpu[1].fill_(3.0)  # queued before it: the fingerprint reads this
    got = _core.fingerprint(gpu, 2, True)
    assert got.parts and not got.parts[0][2].query()  # returned before its part was computed
    gpu[0].mul_(2)  # queued after it: never read by it
    gpu[1].zero_()
    host[1].fill_(3.0)
    expected = _core.fingerprint(host, 2)
    assert got.value() == expected
    assert _core.fingerprint(gpu, 2) != expected


@pytest.mark.unit
def test_a_gpu_version_3_fingerprint_reads_the_viewed_bytes_on_the_device():
    """Version 3 reads of each storage the span its tensors view, on the
    device, at any byte offset (a float32 view starting at an odd element
    is not on an 8-byte word), now and later alike, equal to the host's;
    where the span starts does not count (the host's 0-d loss views a
    storage of 4 bytes, the device's one of 32)."""
    g = torch.Generator().manual_seed(2)
    base, losses = torch.randn(4099, generator=g), torch.randn(8, generator=g)
    host = {"mid": base[1:4000], "two": [base[5:9], base[21:30]], "loss": losses[3].clone(),
            "big": torch.randn(3 << 20, generator=g), "none": base[:0]}
    gbase = base.cuda()
    gpu = {"mid": gbase[1:4000], "two": [gbase[5:9], gbase[21:30]],
           "loss": losses.cuda()[3], "big": host["big"].cuda()[7:], "none": gbase[:0]}
    host["big"] = host["big"][7:]
    expected = _core.fingerprint(host, 3)
    assert _core.fingerprint(gpu, 3) == expected == _core.fingerprint(gpu, 3, True).value()
    gbase[4000:].fill_(7.0)  # bytes no tensor views
    assert _core.fingerprint(gpu, 3) == expected
    gbase[25] = 0.5
    assert _core.fingerprint(gpu, 3) != expected


@pytest.mark.unit
def test_shared_cuda_storage_stays_shared():
    base = torch.arange(100.0, device="cuda")
    out = flor.snapshot({"a": base, "b": base[10:20]}).restore()
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()


@pytest.mark.unit
def test_load_back_to_the_device(tmp_path):
    t = torch.randn(10, device="cuda")
    flor.save({"t": t}, tmp_path / "x.flor")
    assert flor.load(tmp_path / "x.flor")["t"].device.type == "cuda"
    on_cpu = flor.load(tmp_path / "x.flor", map_location="cpu")["t"]
    assert on_cpu.device.type == "cpu" and torch.equal(on_cpu, t.cpu())


@pytest.mark.parametrize("mode", ["thread", "fork", "inline"])
@pytest.mark.unit
def test_materializer_writes_gpu_state(tmp_path, mode):
    model = torch.nn.Linear(64, 64).cuda()
    with flor.Materializer(tmp_path, mode=mode, batch_count=1) as m:
        m.submit("gpu", model)
    sd = flor.load(tmp_path / "gpu.flor", map_location="cpu")
    assert torch.equal(sd["weight"], model.weight.detach().cpu())


@pytest.mark.unit
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
        import sys, torch, flor
        flor.snapshot(torch.nn.Linear(4, 4))
        flor._core.fingerprint(torch.nn.Linear(4, 4))
        print(torch.cuda.is_initialized(), "flor._cuda" in sys.modules)
        """
    )
    assert out.stdout.strip() == "False False"


# --- isolation, sharing and devices -------------------------------------------

@pytest.mark.parametrize("mode", ["staged", "ordered"])
@pytest.mark.unit
def test_an_in_place_update_after_the_snapshot_does_not_reach_it(monkeypatch, mode):
    monkeypatch.setenv("FLOR_CUDA_COPY", mode)
    w = torch.randn(1 << 16, device="cuda")
    expected = w.cpu()
    snap = flor.snapshot({"w": w})
    for _ in range(20):  # kernels queued after the snapshot on the training stream
        w.mul_(3.0).add_(1.0)
    assert torch.equal(snap.restore()["w"], expected)


@pytest.mark.unit
def test_tied_cuda_weights_stay_tied():
    emb = torch.nn.Embedding(50, 16).cuda()
    head = torch.nn.Linear(16, 50, bias=False).cuda()
    head.weight = emb.weight
    out = flor.snapshot({"emb": emb, "head": head}).restore()  # modules as state dicts
    a, b = out["emb"]["weight"], out["head"]["weight"]
    assert a.device.type == "cpu" and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(a, emb.weight.detach().cpu())


@pytest.mark.unit
def test_mixed_cpu_and_cuda_state(tmp_path):
    state = {"gpu": torch.randn(8, device="cuda"), "cpu": torch.randn(8), "n": 3}
    flor.save(state, tmp_path / "m.flor")
    back = flor.load(tmp_path / "m.flor")
    assert back["gpu"].device.type == "cuda" and back["cpu"].device.type == "cpu"
    assert torch.equal(back["gpu"], state["gpu"]) and torch.equal(back["cpu"], state["cpu"])
    assert back["n"] == 3


@pytest.mark.unit
def test_load_onto_the_device_with_map_location(tmp_path):
    t = torch.randn(10)
    flor.save({"t": t}, tmp_path / "c.flor")
    on_gpu = flor.load(tmp_path / "c.flor", map_location="cuda")["t"]
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), t)


# --- record and replay on the GPU ---------------------------------------------

TRAIN = """
import argparse
import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    x = torch.randn(512, 32, device="cuda")
    y = (x.sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for epoch in range(args.epochs):
        model.train()
        for i in range(0, 512, 64):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64])
            loss.backward()
            opt.step()
        noise = torch.rand(1, device="cuda").item()
        print(f"epoch {epoch}: loss {loss.item():.6f} noise {noise:.6f}")


if __name__ == "__main__":
    main()
"""

ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _probe_replayed(tmp_path, source, anchor, probe, jobs):
    """Record `source` hands-free, add `probe` before the line holding
    `anchor`, replay with --jobs `jobs`: (the replay's stdout, a plain run's)."""
    from conftest import edit, flor as flor_cli, plain, write_script

    d = str(tmp_path)
    write_script(d, "train.py", source)
    flor_cli(d, "record", "--no-adaptive", "train.py", env=ENV)
    edit(f"{d}/train.py", anchor, probe, after=False)
    proc = flor_cli(d, "replay", "--jobs", jobs, "train.py", env=ENV)
    return proc.stdout, plain(d, "train.py", env=ENV).stdout


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_hands_free_record_and_replay_on_the_gpu(tmp_path, jobs):
    replayed, expected = _probe_replayed(tmp_path, TRAIN, "model.train()",
                                         'print(f"w {model[0].weight.norm().item():.6f}")', jobs)
    assert replayed == expected
    assert "w " in replayed


MANUAL = """
import torch
from torch import nn
import flor

torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
x = torch.randn(256, 16, device="cuda")
y = x @ torch.randn(16, 1, device="cuda")
model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 1)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for epoch in flor.generator(range(3)):
    if flor.SkipBlock.step_into("train"):
        for i in range(0, 256, 32):
            opt.zero_grad()
            nn.functional.mse_loss(model(x[i:i + 32]), y[i:i + 32]).backward()
            opt.step()
    model, opt = flor.SkipBlock.end(model, opt)
    flor.log("after", torch.rand(1, device="cuda").item())
    print(epoch, round(model[0].weight.sum().item(), 6))
"""


def test_manual_api_record_and_replay_on_the_gpu(tmp_path):
    from conftest import flor as flor_cli, plain, store, write_script

    d = str(tmp_path)
    write_script(d, "manual.py", MANUAL)
    rec = flor_cli(d, "record", "--no-adaptive", "manual.py", env=ENV)
    info = store(d).runs()[-1]["info"]
    assert info.cuda is True and info.deterministic is True  # for the checks' causes
    proc = flor_cli(d, "replay", "manual.py", env=ENV)
    assert proc.stdout == rec.stdout == plain(d, "manual.py", env=ENV).stdout


# nanoGPT's loop: the next batch is fetched inside the accumulation loop, so
# the block rebinds tensors that live on the GPU (X, Y, loss), and the code
# after it and the next iteration use them with the model's.
PREFETCH = """
import torch
from torch import nn

torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
data = torch.randint(0, 50, (4096,))


def get_batch():
    ix = torch.randint(len(data) - 17, (8,))
    x = torch.stack([data[i:i + 16] for i in ix])
    y = torch.stack([data[i + 1:i + 17] for i in ix])
    return x.to("cuda"), y.to("cuda")


model = nn.Sequential(nn.Embedding(50, 32), nn.Dropout(0.1), nn.Linear(32, 50)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
X, Y = get_batch()
for it in range(6):
    for micro in range(3):
        loss = nn.functional.cross_entropy(model(X).view(-1, 50), Y.view(-1)) / 3
        X, Y = get_batch()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"it {it} loss {(loss * 3).item():.6f} next {X.device} {(X.float().mean() + loss).item():.6f}")
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_tensors_a_skipped_block_rebinds_come_back_on_the_gpu(tmp_path, jobs):
    replayed, expected = _probe_replayed(
        tmp_path, PREFETCH, "opt.step()",
        'print(f"gn {sum(p.grad.norm() ** 2 for p in model.parameters()).item():.6f}")', jobs)
    assert "next cuda:0" in replayed and replayed.count("gn ") == 6
    assert replayed == expected
