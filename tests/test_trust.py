"""Safe loading: a checkpoint file cannot run code unless its reader trusts
it, and crafted contents with valid checksums raise CheckpointCorrupt."""
import os
import pickle
import shutil
import stat
import struct
import time

import numpy as np
import pytest
import torch

import flor
from flor import _core, trust
from flor.checkpoint import read
from flor.errors import FlorError

from conftest import edit, flor as flor_cli, plain, run_py, store, write_script
from crafted import craft, fix_checksums, zero_blobs

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core


class _RunsCode:
    """Unpickling this runs os.system: what a malicious file would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil(tmp_path, **kw):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.flor"
    path.write_bytes(craft(pickle.dumps({"w": _RunsCode(marker)}, protocol=5), **kw))
    return path, marker


@pytest.mark.unit
def test_a_pickle_that_calls_os_system_is_refused_by_default(tmp_path):
    path, marker = _evil(tmp_path)
    with pytest.raises(flor.UnsafeCheckpoint) as info:
        flor.load(path)
    msg = str(info.value)
    assert "system" in msg and "trusted=True" in msg and str(path) in msg
    assert not marker.exists()
    # The opt-in does what it says: the file's code runs.
    flor.load(path, trusted=True)
    assert marker.exists()


@pytest.mark.unit
def test_state_dicts_numpy_and_torch_constants_load_safely(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    obj = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
           "np": np.arange(6.0).reshape(2, 3), "od": __import__("collections").OrderedDict(a=1),
           "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
           "gen": torch.Generator().manual_seed(7), "set": {1, 2}, "bytes": b"x",
           "param": torch.nn.Parameter(torch.ones(2))}
    flor.save(obj, tmp_path / "s.flor")
    got = flor.load(tmp_path / "s.flor")
    assert torch.equal(got["model"]["1.running_mean"], model[1].running_mean)
    assert got["opt"]["param_groups"] == opt.state_dict()["param_groups"]
    assert got["sched"] == sched.state_dict()
    assert got["od"] == {"a": 1} and np.array_equal(got["np"], obj["np"])
    assert got["dtype"] is torch.bfloat16 and got["size"] == torch.Size([2, 3])
    assert torch.equal(got["gen"].get_state(), obj["gen"].get_state())
    assert isinstance(got["param"], torch.nn.Parameter)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model2.load_state_dict(got["model"])


class _Global:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.unit
def test_admitted_globals_build_nothing_from_a_single_number(tmp_path):
    """What safe mode refuses: constructors that allocate from one integer or
    iterate lazily, and numpy's dtype and scalar (a crafted dtype state made a
    scalar whose repr read a planted pointer)."""
    import collections

    cases = [_Global(bytearray, 3 << 30), _Global(bytes, 3 << 30),
             _Global(collections.deque, [1], 0), _Global(np.dtype, "f8"),
             _Global(np.float64, 1.5)]
    for obj in cases:
        path = tmp_path / "g.flor"
        path.write_bytes(craft(pickle.dumps({"x": obj}, protocol=5)))
        with pytest.raises(flor.UnsafeCheckpoint):
            flor.load(path)


@pytest.mark.unit
def test_what_is_verified_is_what_is_unpickled(tmp_path, monkeypatch):
    """The file may change while it is read (the mapping shows later writes):
    the checksums, the scan, the signature and the unpickler all read one
    private copy of the metadata."""
    path = tmp_path / "s.flor"
    flor.save({"x": "A" * 64}, path)
    data = path.read_bytes()
    at = data.index(b"A" * 64)
    real = trust.verifies

    def verify_then_change(tag, sig, meta, table=None):
        ok = real(tag, sig, meta, table)
        with open(path, "r+b") as f:  # same length, checksums now stale
            f.seek(at)
            f.write(b"B" * 64)
        return ok
    monkeypatch.setattr(trust, "verifies", verify_then_change)
    seen = []
    assert read(path, trusted="signed", seen=seen) == {"x": "A" * 64}
    assert seen == ["signed"]


@pytest.mark.unit
def test_the_signature_covers_the_tensor_table_and_the_data(tmp_path):
    """Zeroed weights with every checksum recomputed no longer verify as
    signed: the signature covers the table, which holds each blob's CRC
    (checked before the blob is used) and content hash.  Where the key
    sealed the run, such a file is refused before anything is unpickled, and
    so is one without a signature."""
    path = tmp_path / "w.flor"
    flor.save({"w": torch.arange(1.0, 9.0)}, path)
    flags = struct.unpack_from("<I", path.read_bytes(), 88)[0]
    assert flags & 6 == 6  # signed: the tag, metadata and tensor table
    zeroed = tmp_path / "zeroed.flor"
    zeroed.write_bytes(zero_blobs(bytearray(path.read_bytes())))
    seen = []
    assert torch.equal(read(zeroed, trusted="signed", seen=seen)["w"], torch.zeros(8))
    assert seen == ["safe"]  # (flor.load in safe mode reads any well-formed file)
    with pytest.raises(trust.Forged, match="signature does not verify"):
        read(zeroed, trusted="signed", sealed=True)
    assert read(path, trusted="signed", sealed=True)["w"].sum() == 36
    # Nor does removing the signature help: where the key sealed the run,
    # every checkpoint it wrote is signed.
    unsigned = tmp_path / "unsigned.flor"
    _core.save({"w": torch.zeros(8)}, str(unsigned), None, None)
    with pytest.raises(trust.Forged, match="is not signed"):
        read(unsigned, trusted="signed", sealed=True)
    assert read(unsigned, trusted="signed")["w"].sum() == 0  # (safe mode, as before)


@pytest.mark.unit
def test_save_without_a_usable_key_writes_unsigned(tmp_path, monkeypatch):
    (tmp_path / "cfg").write_text("not a directory")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    trust._cached.clear()
    try:
        with pytest.warns(UserWarning, match="unsigned"):
            flor.save({"w": torch.ones(2)}, tmp_path / "u.flor")
        seen = []
        assert torch.equal(read(tmp_path / "u.flor", trusted="signed", seen=seen)["w"],
                           torch.ones(2))
        assert seen == ["safe"]
    finally:
        trust._cached.clear()


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.flor"
    os.mkfifo(fifo)
    out = run_py(f"""
        import flor
        try:
            flor.load({str(fifo)!r})
        except OSError as e:
            print("refused")
    """, timeout=60)
    assert out.stdout.strip() == "refused"


@pytest.mark.unit
def test_a_file_cannot_declare_itself_trusted(tmp_path):
    """Replay's mode ("signed") unpickles in full only what the user's key
    signed: a file that sets the signed flag, or carries the signature of
    another file, still loads in safe mode."""
    good = tmp_path / "good.flor"
    flor.save({"a": 1}, good)
    real_sig = good.read_bytes()[128:160]
    assert real_sig != bytes(32)
    for sig in (os.urandom(32), real_sig):
        path, marker = _evil(tmp_path, sig=sig)
        seen = []
        with pytest.raises(flor.UnsafeCheckpoint):
            read(path, trusted="signed", seen=seen)
        assert seen == ["safe"] and not marker.exists()
    # What the key signed loads in full: a function of this module, by value.
    flor.save({"f": _RunsCode}, tmp_path / "own.flor")
    seen = []
    assert read(tmp_path / "own.flor", trusted="signed", seen=seen)["f"] is not None
    assert seen == ["signed"]


@pytest.mark.unit
def test_the_header_tag_is_checked_before_anything_is_unpickled(tmp_path):
    path, marker = _evil(tmp_path, tag=trust.tag_of("block", "a"))
    with pytest.raises(trust.Mismatch):
        read(path, trusted=True, expect_tag=trust.tag_of("block", "b"))
    assert not marker.exists()


@pytest.mark.unit
def test_memo_bombs_are_refused_before_unpickling(tmp_path):
    """A huge memo index would make the unpickler allocate gigabytes."""
    cases = {
        "put": b"\x80\x05N" + b"r" + struct.pack("<I", 1 << 31) + b".",
        "get": b"\x80\x05N\x94" + b"j" + struct.pack("<I", 1 << 30) + b".",
        "text": b"\x80\x05" + b"cos\nsystem\n" + b".",
        "persid": b"\x80\x05N" + b"Q" + b".",
        "trailing": b"\x80\x05N." + b"N",
        "cut": b"\x80\x05" + b"\x8d" + struct.pack("<Q", 1 << 40),
    }
    for name, meta in cases.items():
        path = tmp_path / f"{name}.flor"
        path.write_bytes(craft(meta))
        t0 = time.perf_counter()
        with pytest.raises(flor.CheckpointCorrupt) as info:
            flor.load(path, trusted=True)
        assert info.value.section == "metadata", name
        assert time.perf_counter() - t0 < 5, name  # refused, not attempted


@pytest.mark.unit
def test_placeholders_rebuild_only_torch_constants(tmp_path):
    """_rebuild's named kind returns dtypes, layouts and memory formats, never
    another attribute of torch (torch.load, say) for the pickle to call."""
    class Named:
        def __init__(self, kind, payload):
            self.kind, self.payload = kind, payload

        def __reduce__(self):
            return (_core._rebuild, (self.kind, -1, self.payload))

    for kind, payload in ((4, "load"), (4, "_C"), (5, 5), (6, ("a",)), (7, ("cpu", 1)),
                          (1, None)):
        path = tmp_path / "n.flor"
        path.write_bytes(craft(pickle.dumps(Named(kind, payload), protocol=5)))
        with pytest.raises(flor.CheckpointCorrupt):
            flor.load(path)


FUZZ = """
import random, sys, traceback
sys.path.insert(0, {tests!r})
import numpy as np, torch, flor
from crafted import fix_checksums
src = open({path!r}, "rb").read()
rng = random.Random({seed})
kinds = {{}}
for i in range({n}):
    b = bytearray(src)
    meta_off, meta_len, table_off, table_len = __import__("struct").unpack_from("<QQQQ", b, 24)
    lo, hi = (table_off, table_off + table_len) if i % 3 else (meta_off, meta_off + meta_len)
    for _ in range(rng.choice((1, 1, 2, 4))):
        pos = rng.randrange(lo, hi)
        b[pos] = rng.choice((rng.randrange(256), b[pos] ^ (1 << rng.randrange(8)), 0, 255))
    fix_checksums(b)
    with open({out!r}, "wb") as f:
        f.write(b)
    try:
        flor.load({out!r})
        kinds["loaded"] = kinds.get("loaded", 0) + 1
    except (flor.CheckpointCorrupt, flor.UnsafeCheckpoint) as e:
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    except Exception as e:
        print("UNEXPECTED", type(e).__name__, e)
        traceback.print_exc()
print(kinds)
"""


@pytest.mark.unit
def test_a_quantized_dtype_in_the_table_is_a_damaged_file(tmp_path):
    # flor never writes a quantized tensor (its bytes lose scale and zero
    # point): a table that names one loaded, then failed inside torch.
    path = str(tmp_path / "q.flor")
    flor.save({"t": torch.arange(8, dtype=torch.uint8)}, path)
    with open(path, "rb") as f:
        b = bytearray(f.read())
    at = b.index(b"uint8")
    b[at:at + 5] = b"qint8"
    with open(path, "wb") as f:
        f.write(fix_checksums(b))
    with pytest.raises(flor.CheckpointCorrupt, match="quantized dtype 'qint8'"):
        flor.load(path)


def test_checksum_fixed_mutations_raise_only_checkpoint_errors(tmp_path):
    """Bytes of the metadata and tensor table changed at random, every CRC
    recomputed: a load either succeeds or raises CheckpointCorrupt (or
    UnsafeCheckpoint for a pickle that now names another global); no other
    exception, no crash."""
    obj = {"w": torch.arange(64.0).reshape(8, 8), "v": torch.ones(3, dtype=torch.int16)[1:],
           "np": np.arange(10, dtype=np.int32), "b": bytearray(b"abc"),
           "sd": torch.nn.Linear(3, 2).state_dict(), "dt": torch.float16,
           "sz": torch.Size([4]), "p": torch.nn.Parameter(torch.zeros(2))}
    src = tmp_path / "src.flor"
    flor.save(obj, src)
    tests = os.path.dirname(os.path.abspath(__file__))
    out = run_py(FUZZ.format(tests=tests, path=str(src), seed=2026, n=1500,
                             out=str(tmp_path / "m.flor")), timeout=600)
    assert "UNEXPECTED" not in out.stdout, out.stdout + out.stderr
    counts = eval(out.stdout.strip().splitlines()[-1])
    assert counts.get("CheckpointCorrupt", 0) > 500, counts


@pytest.mark.unit
def test_a_signing_key_others_can_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    trust._cached.clear()
    try:
        assert trust.signing_key(create=True) is not None
        key = trust.key_path()
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        os.chmod(key, 0o644)
        trust._cached.clear()
        with pytest.raises(FlorError, match=f"chmod 600 {key}"):
            trust.signing_key()
    finally:
        trust._cached.clear()


SCRIPT = """
import argparse
import torch
import flor

class Holder:  # a user object in the block's state: needs the full unpickler
    def __init__(self):
        self.count = 0

def main():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = Holder()
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    for epoch in flor.generator(range(4)):
        if flor.SkipBlock.step_into("train"):
            for _ in range(5):
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                holder.count += 1
        flor.SkipBlock.end(model, opt, holder)
        loss = ((model(x) - y) ** 2).mean()
        print(f"epoch {epoch} loss {loss.item():.6f} count {holder.count}")

main()
"""


def test_replay_restores_signed_files_and_never_runs_planted_ones(tmp_path):
    d = str(tmp_path)
    path = write_script(d, "train.py", SCRIPT)
    flor_cli(d, "record", "--no-adaptive", "train.py")
    st = store(d)
    rec = [r for r in st.runs() if r["kind"] == "record"][-1]
    ckdir = st.layout.ckpt_dir(rec["run_id"])
    files = sorted(f for f in os.listdir(ckdir) if f.endswith(".flor"))
    assert len(files) == 4
    # Plant a crafted file in place of epoch 1's checkpoint, with its header
    # tag (not a secret) but no signature, and epoch 0's (signed, but
    # made for another block execution) in place of epoch 2's.
    marker = tmp_path / "ran"
    planted = os.path.join(ckdir, files[1])
    with open(planted, "rb") as f:
        tag = f.read(128)[96:128]
    with open(planted, "wb") as f:
        f.write(craft(pickle.dumps({"x": _RunsCode(marker)}, protocol=5), tag=tag))
    shutil.copy(os.path.join(ckdir, files[0]), os.path.join(ckdir, files[2]))
    edit(path, 'print(f"epoch', 'print(f"  w {model.weight.norm().item():.6f}")', after=False)
    want = plain(d, "train.py").stdout
    rep = flor_cli(d, "replay", "train.py")
    assert rep.stdout == want
    assert not marker.exists()
    assert f"{files[1]} is not signed, though the key that sealed its run" in rep.stderr, \
        rep.stderr
    assert "does not belong" in rep.stderr and "nothing of it was unpickled" in rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr


RUNS = """
import sys

import torch
import flor

torch.manual_seed(int(sys.argv[1]))
w = torch.zeros(3)
for epoch in flor.generator(range(3)):
    if flor.SkipBlock.step_into("train"):
        for _ in range(4):
            w += torch.randn(3)
    w = flor.SkipBlock.end(w)
    print("epoch", epoch, round(w.sum().item(), 4))
"""


def test_a_checkpoint_of_another_run_or_outside_the_run_is_never_restored(tmp_path):
    # Two records of one script (seeds 1 and 2): the first's signed
    # checkpoints, put in the second's place, name another run in their
    # header tag; a decision row naming a path outside the run's checkpoint
    # directory is not followed.  Each such block is run again.
    d = str(tmp_path)
    path = write_script(d, "train.py", RUNS)
    flor_cli(d, "record", "--no-adaptive", "train.py", "1")
    flor_cli(d, "record", "--no-adaptive", "train.py", "2")
    st = store(d)
    first, second = [r["run_id"] for r in st.runs() if r["kind"] == "record"]
    names = sorted(os.listdir(st.layout.ckpt_dir(second)))
    assert names == sorted(os.listdir(st.layout.ckpt_dir(first))) and len(names) == 3
    for name in names[:2]:
        shutil.copy(os.path.join(st.layout.ckpt_dir(first), name),
                    os.path.join(st.layout.ckpt_dir(second), name))
    outside = os.path.join(d, "elsewhere.flor")
    shutil.copy(os.path.join(st.layout.ckpt_dir(second), names[2]), outside)
    with st.transaction():
        st.db.execute("UPDATE decisions SET file = ? WHERE run_id = ? AND file = ?",
                      (outside, second, names[2]))
    edit(path, 'print("epoch"', 'print("  w", round(w.norm().item(), 4))', after=False)
    want = plain(d, "train.py", "2").stdout
    rep = flor_cli(d, "replay", "train.py")
    assert rep.stdout == want
    for name in names[:2]:
        assert f"checkpoint {name} does not belong to block 'train'" in rep.stderr
        assert f"of run {second}" in rep.stderr
    assert f"the run store names {outside!r} as a checkpoint" in rep.stderr, rep.stderr
    assert "deferred checks passed" in rep.stderr


def test_a_checkpoint_changed_after_the_record_is_refused(tmp_path):
    # Epoch 1's checkpoint with its weights zeroed and every checksum
    # recomputed: its signature no longer verifies with the key that sealed
    # the run, so replay refuses it before unpickling anything, runs that
    # epoch again and prints what a plain run prints.
    d = str(tmp_path)
    path = write_script(d, "train.py", RUNS)
    flor_cli(d, "record", "--no-adaptive", "train.py", "1")
    st = store(d)
    rec = [r for r in st.runs() if r["kind"] == "record"][-1]
    ckdir = st.layout.ckpt_dir(rec["run_id"])
    name = sorted(os.listdir(ckdir))[1]
    target = os.path.join(ckdir, name)
    with open(target, "rb") as f:
        zeroed = zero_blobs(bytearray(f.read()))
    with open(target, "wb") as f:
        f.write(zeroed)
    edit(path, 'print("epoch"', 'print("  w", round(w.norm().item(), 4))', after=False)
    want = plain(d, "train.py", "1").stdout
    rep = flor_cli(d, "replay", "train.py")
    assert rep.stdout == want
    assert f"{name} is signed, and its signature does not verify" in rep.stderr, rep.stderr
    assert "re-executing block 'train'" in rep.stderr, rep.stderr
    assert "deferred checks passed" in rep.stderr, rep.stderr


@pytest.mark.unit
def test_header_tags_name_the_run_and_store_names_stay_in_the_run(tmp_path):
    from flor.errors import StoreError
    from flor.layout import checkpoint_path
    from flor.runtime import blockstate

    t = blockstate.tag("train", "[]", 0)
    assert trust.bound(t, "run-a") != trust.bound(t, "run-b") != t
    assert blockstate.expected(t, None) == t
    ckdir = str(tmp_path)
    assert checkpoint_path(ckdir, "train@0-abc.flor") == os.path.join(ckdir, "train@0-abc.flor")
    for bad in ("/etc/passwd", "../other/ckpt/x.flor", "..", ".", "", "a/b.flor", None):
        with pytest.raises(StoreError, match="not a file name there"):
            checkpoint_path(ckdir, bad)


def test_a_replay_with_a_key_others_can_read_stops_before_it_starts(tmp_path):
    # Record wrote signed checkpoints; the key's mode changed since.  Replay
    # says how to fix it (exit 2) instead of failing in its workers (the
    # script "exited with status 1").
    d = str(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    write_script(d, "train.py", RUNS)
    flor_cli(d, "record", "--no-adaptive", "train.py", "1", env=env)
    key = tmp_path / "cfg" / "flor" / "key"
    os.chmod(key, 0o644)
    rep = flor_cli(d, "replay", "train.py", env=env, check=False)
    assert rep.returncode == 2, rep.stderr
    assert f"chmod 600 {key}" in rep.stderr and "exited with status" not in rep.stderr
    assert rep.stdout == ""
    os.chmod(key, 0o600)
    assert flor_cli(d, "replay", "train.py", env=env).stdout == plain(d, "train.py", "1").stdout
