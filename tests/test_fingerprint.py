"""State fingerprints: version 2 is the CRC-32C of the blobs' lengths and of
a 64-bit digest of their bytes (csrc/crc32c.c), which a GPU computes where
the tensors live (flor/_cuda.py).  Its torch kernels run here on CPU
storages and must give what the C code gives, so that a state fingerprinted
on the GPU in record and on the host in replay (or the reverse) compares.
Version 3, which records take, reads of each tensor storage only the span
its tensors view: the rest may never have been written.  Records made
before it keep being replayed with version 2 or 1."""
import json
import os
import struct

import numpy as np
import pytest
import torch

from flor import _core, _cuda
from flor.runtime.blockstate import fingerprint_version

from conftest import flor, plain, runs, store, write_script

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

M = (1 << 64) - 1


def digest_spec(data: bytes, first: int) -> int:
    """The digest, straight from its definition (csrc/crc32c.c)."""
    data = bytes(data) + b"\0" * (-len(data) % 8)
    total = 0
    for k in range(len(data) // 8):
        w = int.from_bytes(data[8 * k:8 * k + 8], "little")
        x = ((w ^ ((first + k + 1) * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & M
        signed = x - (1 << 64) if x >> 63 else x
        total = (total + (x ^ ((signed >> 31) & M))) & M
    return total


def blob_bytes(t) -> bytes:
    """A tensor's whole storage, as a snapshot holds it."""
    s = t.untyped_storage()
    return bytes(torch.empty(0, dtype=torch.uint8).set_(s).numpy())


def span(views) -> tuple[int, int]:
    """The bytes [lo, hi) of their storage that tensors view, from the
    first element of any to the last of any; (0, 0) when none has one."""
    lo = hi = None
    for t in views:
        if t.numel() == 0:
            continue
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        first = t.storage_offset() * t.element_size()
        end = (last + 1) * t.element_size()
        lo, hi = (first, end) if lo is None else (min(lo, first), max(hi, end))
    return (0, 0) if lo is None else (lo, hi)


def version_3_spec(storages) -> int:
    """Version 3, from its definition: storages [[tensor views]], in the
    order the walk meets them."""
    crc, total, index = 0, 0, 0
    for views in storages:
        lo, hi = span(views)
        data = blob_bytes(views[0])[lo:hi]
        crc = _core.crc32c(struct.pack("<Q", len(data)), crc)
        total = (total + digest_spec(data, index)) & M
        index += (len(data) + 7) // 8
    return 1 << 33 | _core.crc32c(struct.pack("<Q", total), crc)


STATE = [torch.randn(1001), torch.arange(13, dtype=torch.uint8), torch.randn(5, 3).double().t(),
         torch.arange(7, dtype=torch.int16), torch.zeros(0)]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1000])
@pytest.mark.unit
def test_the_digest_is_its_specification(n):
    data = np.random.default_rng(n).bytes(n)
    for first in (0, 3, 1 << 40):
        assert _core.digest64(data, first) == digest_spec(data, first)


@pytest.mark.unit
def test_a_version_2_fingerprint_is_the_crc_of_the_lengths_and_the_digest():
    crc, total, index = 0, 0, 0
    for t in STATE:
        data = blob_bytes(t)
        crc = _core.crc32c(struct.pack("<Q", len(data)), crc)
        total = (total + digest_spec(data, index)) & M
        index += (len(data) + 7) // 8
    expected = 1 << 32 | _core.crc32c(struct.pack("<Q", total), crc)
    assert _core.fingerprint(STATE, 2) == expected
    # One changed bit changes it; so does a swap of two equal-sized words.
    changed = [t.clone() for t in STATE]
    changed[3][2], changed[3][5] = STATE[3][5], STATE[3][2]
    assert _core.fingerprint(changed, 2) != expected


@pytest.mark.unit
def test_a_version_3_fingerprint_reads_the_bytes_the_tensors_view():
    base = torch.randn(40)
    grid = torch.arange(24.0).reshape(4, 6)
    state = [base[3:9], STATE[0], base[30:31], grid[1:3, 2:4], torch.randn(8)[5], base[:0],
             grid.t()[0], torch.zeros(0), torch.arange(5)[2:].expand(3, 3)]
    # The walk meets storages in this order; one storage's views widen one span.
    storages = [[base[3:9], base[30:31], base[:0]], [STATE[0]], [grid[1:3, 2:4], grid.t()[0]],
                [state[4]], [torch.zeros(0)], [state[8]]]
    assert span(storages[0]) == (12, 124) and span(storages[2]) == (0, 76)
    assert span(storages[5]) == (16, 40)
    expected = version_3_spec(storages)
    assert _core.fingerprint(state) == _core.fingerprint(state, 3) == expected
    assert _core.fingerprint(state, 3, True).value() == expected
    assert _core.fingerprint(STATE) == version_3_spec([[t] for t in STATE])


@pytest.mark.unit
def test_bytes_no_tensor_views_leave_a_version_3_fingerprint_as_it_was():
    """A mean-squared-error loss is a 0-d view of a 32-byte buffer whose
    other bytes were never written: they differ from run to run (here,
    from call to call), and a fingerprint of the loss must not read them."""
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(torch.nn.Linear(3, 1)(x), y).detach()
    storage = torch.empty(0, dtype=torch.uint8).set_(loss.untyped_storage())
    assert loss.dim() == 0 and storage.numel() > loss.element_size()
    before3, before2 = _core.fingerprint([loss], 3), _core.fingerprint([loss], 2)
    storage[loss.element_size():] = 0xA5
    assert _core.fingerprint([loss], 3) == before3 == _core.fingerprint([loss.clone()], 3)
    assert _core.fingerprint([loss], 2) != before2
    loss += 1  # a viewed byte
    assert _core.fingerprint([loss], 3) != before3
    # A view of the middle of a storage, likewise.
    base = torch.randn(64)
    view = base[10:20]
    before3 = _core.fingerprint({"w": view})
    base[:10], base[20:] = 0.0, 1.0
    assert _core.fingerprint({"w": view}) == before3
    base[19] += 1
    assert _core.fingerprint({"w": view}) != before3


@pytest.mark.unit
def test_version_1_is_the_crc_of_the_lengths_and_the_bytes():
    crc = 0
    for t in STATE:
        data = blob_bytes(t)
        crc = _core.crc32c(data, _core.crc32c(struct.pack("<Q", len(data)), crc))
    assert _core.fingerprint(STATE, 1) == crc < 1 << 32
    for bad in (0, 4):
        with pytest.raises(ValueError, match="version must be 1, 2 or 3"):
            _core.fingerprint(STATE, bad)


@pytest.mark.unit
def test_the_device_digest_equals_the_host_digest(monkeypatch):
    """flor/_cuda.digest on CPU storages: small ones are read together
    (runs of consecutive word indices, a pass at most), large ones in
    several passes, and partial last words are zero-padded, as the C code
    does."""
    monkeypatch.setattr(_cuda, "PASS", 1000)  # words: several passes over the large ones
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in (3, 1, 5000, 17, 2, 1025, 9, 900, 700, 900)]
    tensors.append(torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g))
    blobs, expected, index = [], 0, 0
    for k, t in enumerate(tensors):
        if k == 4:
            index += 11  # a host blob between them: a gap in the device's words
        data = blob_bytes(t)
        blobs.append((t.untyped_storage(), index))
        expected = (expected + _core.digest64(data, index)) & M
        index += (len(data) + 7) // 8
    assert _cuda.digest(blobs) == expected
    # Spans (version 3): (storage, first word, first byte, length), at any
    # byte offset, small ones read together and large ones in passes.
    blobs, expected, index = [], 0, 0
    for k, t in enumerate(tensors):
        data = blob_bytes(t)
        lo, n = k % 5, len(data) - k % 5 - 3 * (k % 2)
        blobs.append((t.untyped_storage(), index, lo, n))
        expected = (expected + _core.digest64(data[lo:lo + n], index)) & M
        index += (n + 7) // 8
    assert _cuda.digest(blobs) == expected


@pytest.mark.unit
def test_a_fingerprint_read_later_equals_the_one_read_now():
    """fingerprint(objs, 2 or 3, True) hands the CRC of the lengths and the host
    blobs' sum to flor._cuda.later, whose value() finishes the same
    fingerprint; version 1 has no such form."""
    mixed = [STATE, np.arange(11.0), {"n": 3, "t": torch.ones(2, 2)}]
    for objs in (STATE, mixed, [], [1, "no tensors"]):
        for version in (2, 3):
            got = _core.fingerprint(objs, version, True)
            assert isinstance(got, _cuda.Later)
            assert got.value() == got.value() == _core.fingerprint(objs, version)
    with pytest.raises(ValueError, match="versions 2 and 3 only"):
        _core.fingerprint(STATE, 1, True)


@pytest.mark.unit
def test_later_adds_each_device_sum_to_the_host_part():
    """flor/_cuda.later on CPU storages: their sum is added at once, and the
    fingerprint is the CRC given continued over the whole sum's 8 bytes."""
    blobs, index = [], 5
    for t in STATE[:3]:
        blobs.append((t.untyped_storage(), index))
        index += (len(blob_bytes(t)) + 7) // 8
    total, crc = M - 12345, 0xDEADBEEF  # the sum wraps modulo 2**64
    got = _cuda.later(blobs, crc, total)
    whole = (total + _cuda.digest(blobs)) & M
    assert got.value() == 1 << 32 | _core.crc32c(struct.pack("<Q", whole), crc)


TRAIN = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    for epoch in range(4):
        for i in range(0, 64, 16):
            opt.zero_grad()
            loss = ((model(x[i:i + 16]) - y[i:i + 16]) ** 2).mean()
            loss.backward()
            opt.step()
        print("epoch", epoch, round(loss.item(), 6))
"""

# The flor that recorded before version 2: every fingerprint of version 1,
# and no "fingerprint" in the run's info.
OLDER_FLOR = """
from flor.runtime.recording import Recording
Recording.fingerprint_version = 1
"""


def _started_with(tmp_path, code) -> dict:
    """The environment of a process that runs `code` as it starts (a
    sitecustomize module), before flor records in it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


# A device error met where a block-end fingerprint is read (at the flush).
UNREADABLE = """
import flor._cuda

def value(self):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

flor._cuda.Later.value = value
"""


def test_a_fingerprint_that_cannot_be_read_loses_no_other_row(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", TRAIN)
    rec = flor(d, "record", "--no-adaptive", "train.py", env=_started_with(tmp_path, UNREADABLE))
    assert rec.stdout == plain(d, "train.py").stdout
    assert "the state fingerprint at the end of block train.py:" in rec.stderr
    assert "illegal memory access" in rec.stderr
    st = store(d)
    run = runs(st, "record")[0]
    assert st.status(run) == "finished"
    names = [r["name"] for r in st.logs(run["run_id"])]
    assert names.count("state@iteration") == 4 and "state@block" not in names
    assert len(st.rows("output", run["run_id"])) == 4
    assert len(st.rows("decisions", run["run_id"])) > 0


def test_a_record_with_version_1_fingerprints_replays_with_them(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", TRAIN)
    flor(d, "record", "--no-adaptive", "train.py", env=_started_with(tmp_path, OLDER_FLOR))
    st = store(d)
    rec = runs(st, "record")[0]
    info = rec["info"].to_dict()  # as a record before version 2 stored it
    assert info.pop("fingerprint") == 1
    st.update_run(rec["run_id"], info=json.dumps(info))
    fps = [json.loads(r["value"]) for r in st.logs(rec["run_id"]) if r["name"] == "state@iteration"]
    assert len(fps) == 4 and all(v < 1 << 32 for v in fps)
    with open(os.path.join(d, "train.py")) as f:
        src = f.read()
    with open(os.path.join(d, "train.py"), "w") as f:
        f.write(src.replace('    print("epoch"', '    print("w", model.weight.sum().item())\n'
                                                 '    print("epoch"'))
    rep = flor(d, "replay", "--jobs", "2", "train.py")
    assert rep.stdout == plain(d, "train.py").stdout
    # Compared, each against the record's version 1 value.
    assert "deferred checks passed" in rep.stderr and "not compared" not in rep.stderr, \
        rep.stderr
    assert " 4 state fingerprints" in rep.stderr, rep.stderr
    replay = runs(st, "replay")[-1]["run_id"]
    parts = st.parts(replay)
    # The second segment started from its iteration checkpoint, verified by
    # its version 1 fingerprint.
    assert parts[1]["info"].resumed_from is not None, parts


# The loss of the last batch, a 0-d view of a buffer most of which no
# kernel wrote, is in the state of the batch loop: version 2 read that
# buffer and a replay stepping into the loop reported false failures.
MSE = """
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X = torch.randn(128, 8)
    Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(128, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        for i in range(0, 128, 32):
            loss = F.mse_loss(model(X[i:i + 32]), Y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        print("epoch", epoch, round(loss.item(), 4))
"""


def test_a_replay_into_a_loop_whose_loss_views_a_larger_buffer_passes_its_checks(tmp_path):
    d = str(tmp_path)
    write_script(d, "train.py", MSE)
    assert torch.nn.functional.mse_loss(torch.ones(2), torch.zeros(2)).untyped_storage().nbytes() > 4
    flor(d, "record", "--no-adaptive", "train.py")
    st = store(d)
    rec = runs(st, "record")[0]
    assert rec["info"].fingerprint == 3
    fps = [json.loads(r["value"]) for r in st.logs(rec["run_id"]) if r["name"] == "state@block"]
    assert fps and all(fingerprint_version(v[-1] if isinstance(v, list) else v) == 3 for v in fps)
    with open(os.path.join(d, "train.py")) as f:
        src = f.read()
    with open(os.path.join(d, "train.py"), "w") as f:
        f.write(src.replace("        opt.step()\n",
                            "        opt.step()\n        print(\"batch\", loss.item())\n"))
    rep = flor(d, "replay", "train.py")
    assert rep.stdout == plain(d, "train.py").stdout and "batch" in rep.stdout
    assert "stepping into changed blocks" in rep.stderr, rep.stderr
    assert "deferred checks passed" in rep.stderr and "state fingerprints" in rep.stderr, \
        rep.stderr
