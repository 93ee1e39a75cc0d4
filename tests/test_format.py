"""The checkpoint file: round trips, the golden file, damage, crashes, write errors."""
import errno
import os
import pathlib
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import torch

import flor
from flor import _core

from conftest import ROOT, run_py
from make_golden import GOLDEN_TAG, golden_object

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden-v1.flor")
GOLDEN_V2 = os.path.join(os.path.dirname(__file__), "data", "golden-v2.flor")
HEADER = struct.Struct("<8sIIQQQQQQQIIIIII32s32s28sI")  # version 2


def header(path):
    with open(path, "rb") as f:
        fields = HEADER.unpack(f.read(HEADER.size))
    names = ("magic version header_size file_size meta_off meta_len table_off table_len "
             "data_off data_len n_blobs n_entries meta_crc table_crc flags n_sources tag sig "
             "reserved header_crc").split()
    return dict(zip(names, fields))


def assert_equal_objects(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_equal_objects(a[k], b[k])
    else:
        assert a == b


@pytest.mark.unit
def test_crc32c_check_value():
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c(b"56789", _core.crc32c(b"1234")) == 0xE3069283


@pytest.mark.unit
def test_save_load_roundtrip(tmp_path):
    obj = golden_object()
    path = tmp_path / "x.flor"
    flor.save(obj, path)
    assert_equal_objects(flor.load(path), obj)
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


@pytest.mark.unit
def test_golden_file_loads():
    """A file written by format version 1 keeps loading: format changes are deliberate."""
    h = header(GOLDEN)
    assert h["magic"] == b"\x89FLR\r\n\x1a\n" and h["version"] == 1
    assert_equal_objects(flor.load(GOLDEN), golden_object())


@pytest.mark.unit
def test_golden_version_2_files_load():
    """A version-2 file that refers to blobs of an earlier one (its header
    names one source) and carries a tag keeps loading."""
    h = header(GOLDEN_V2)
    assert h["version"] == 2 and h["n_sources"] == 1 and h["tag"] == GOLDEN_TAG
    assert h["flags"] == 1  # tagged, not signed
    assert_equal_objects(flor.load(GOLDEN_V2), golden_object())


@pytest.mark.unit
def test_layout_is_aligned(tmp_path):
    path = tmp_path / "x.flor"
    flor.save({"a": torch.ones(3), "b": torch.zeros(17, dtype=torch.int8)}, path)
    h = header(path)
    assert h["data_off"] % 64 == 0 and h["meta_off"] == 192
    assert h["file_size"] == os.path.getsize(path) == h["data_off"] + h["data_len"]


@pytest.mark.unit
def test_load_is_zero_copy_and_private(tmp_path):
    path = tmp_path / "x.flor"
    flor.save({"w": torch.arange(1000.0)}, path)
    loaded = flor.load(path)["w"]
    loaded.add_(1)  # a private (copy-on-write) mapping: the file is untouched
    assert torch.equal(flor.load(path)["w"], torch.arange(1000.0))


@pytest.mark.unit
def test_map_location(tmp_path):
    path = tmp_path / "x.flor"
    flor.save({"w": torch.ones(2)}, path)
    seen = []

    def hook(storage, device):
        seen.append(device)
        return storage

    assert flor.load(path, map_location="cpu")["w"].device.type == "cpu"
    assert flor.load(path, map_location={"cpu": "cpu"})["w"].device.type == "cpu"
    flor.load(path, map_location=hook)
    assert seen == ["cpu"]
    with pytest.raises(TypeError, match="map_location"):
        flor.load(path, map_location=3.5)


@pytest.mark.unit
def test_save_into_missing_directory_reports_errno(tmp_path):
    with pytest.raises(flor.CheckpointWriteError) as info:
        flor.save({"a": 1}, tmp_path / "missing" / "x.flor")
    assert info.value.errno == errno.ENOENT
    assert "missing" in str(info.value) and "create" in str(info.value)


# --- damaged files ---------------------------------------------------------

@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "good.flor"
    obj = {"w": torch.arange(4096.0), "b": torch.ones(10), "meta": {"epoch": 4}}
    flor.save(obj, path)
    return path, obj


def damaged(path, data, tmp_path, name="bad.flor"):
    out = tmp_path / name
    out.write_bytes(data)
    return out


@pytest.mark.unit
def test_truncation_names_the_section(good_file, tmp_path):
    path, _ = good_file
    data = path.read_bytes()
    h = header(path)
    cases = {
        0: "header",
        60: "header",
        h["meta_off"] + 5: "metadata",
        h["table_off"] + 5: "tensor table",
        h["data_off"] + 100: "data",
        len(data) - 1: "data",
    }
    for cut, section in cases.items():
        bad = damaged(path, data[:cut], tmp_path)
        with pytest.raises(flor.CheckpointCorrupt) as info:
            flor.load(bad)
        assert info.value.section == section, (cut, str(info.value))
        assert str(bad) in str(info.value)
        if cut >= 128:
            assert "truncated" in str(info.value)


@pytest.mark.unit
def test_flipped_byte_names_the_section(good_file, tmp_path):
    path, _ = good_file
    data = path.read_bytes()
    h = header(path)
    cases = {
        0: "header",
        20: "header",
        h["meta_off"] + 3: "metadata",
        h["table_off"] + 9: "tensor table",
        h["data_off"] + 4 * 1000: "data",
    }
    for pos, section in cases.items():
        buf = bytearray(data)
        buf[pos] ^= 0x40
        bad = damaged(path, bytes(buf), tmp_path)
        with pytest.raises(flor.CheckpointCorrupt) as info:
            flor.load(bad)
        assert info.value.section == section, (pos, str(info.value))


@pytest.mark.unit
def test_random_damage_never_gives_wrong_values(good_file, tmp_path):
    """Any single damaged byte is caught, or lies in padding that holds no value."""
    path, obj = good_file
    data = path.read_bytes()
    rng = random.Random(1234)
    caught = 0
    for i in range(300):
        buf = bytearray(data)
        pos = rng.randrange(len(buf))
        buf[pos] ^= 1 << rng.randrange(8)
        bad = damaged(path, bytes(buf), tmp_path)
        try:
            loaded = flor.load(bad)
        except flor.CheckpointCorrupt:
            caught += 1
            continue
        assert_equal_objects(loaded, obj)
    assert caught > 250


@pytest.mark.unit
def test_not_a_checkpoint(tmp_path):
    for content in (b"", b"hello", b"PK\x03\x04" + b"\0" * 200):
        bad = damaged(None, content, tmp_path)
        with pytest.raises(flor.CheckpointCorrupt) as info:
            flor.load(bad)
        assert info.value.section == "header"
    with pytest.raises(FileNotFoundError):
        flor.load(tmp_path / "nope.flor")


@pytest.mark.unit
def test_future_version_is_refused(good_file, tmp_path):
    path, _ = good_file
    buf = bytearray(path.read_bytes())
    buf[8] = 3
    buf[188:192] = struct.pack("<I", _core.crc32c(bytes(buf[:188])))
    with pytest.raises(flor.CheckpointCorrupt, match="version 3 is not supported"):
        flor.load(damaged(path, bytes(buf), tmp_path))


# --- crashes ---------------------------------------------------------------

def test_kill_during_write_leaves_nothing_under_the_final_name(tmp_path):
    """SIGKILL while a large checkpoint is being written: the earlier checkpoint
    still loads, the new name does not exist, and only a temp file remains."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, torch, flor
            flor.save({{"step": 1, "w": torch.ones(100)}}, {str(tmp_path / "first.flor")!r})
            big = {{"w": torch.ones(384 * 2**20 // 4)}}
            print("ready", flush=True)
            flor.save(big, {str(tmp_path / "second.flor")!r})
            print("finished", flush=True)
        """)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        # Watch the directory until the temp file of the second save has data.
        while True:
            tmps = [n for n in os.listdir(tmp_path) if n.startswith("second.flor.tmp.")]
            if tmps and os.path.getsize(tmp_path / tmps[0]) > 0:
                break
            assert child.poll() is None, "the writer finished before it could be killed"
            os.sched_yield()
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    names = os.listdir(tmp_path)
    assert "second.flor" not in names
    assert any(n.startswith("second.flor.tmp.") for n in names)
    assert flor.load(tmp_path / "first.flor")["step"] == 1
    # A new materializer on the directory removes the dead writer's temp file.
    flor.Materializer(tmp_path).close()
    assert sorted(os.listdir(tmp_path)) == ["first.flor"]


# --- write errors ----------------------------------------------------------

@pytest.fixture
def world_tmp():
    """A temp directory every user can traverse (pytest's own is private)."""
    path = tempfile.mkdtemp(prefix="flor-test-")
    os.chmod(path, 0o755)
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_unwritable_directory_is_refused_up_front(world_tmp):
    directory = world_tmp / "ro"
    directory.mkdir(mode=0o555)
    code = f"""
        import os, flor
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        try:
            flor.Materializer({str(directory)!r})
        except PermissionError as e:
            print(e)
    """
    out = run_py(code).stdout
    assert "is not writable" in out and str(directory) in out

WRITE_IN_CHILD = """
import os, sys, errno, resource, signal
import torch, flor
mode, directory, case = sys.argv[1], sys.argv[2], sys.argv[3]
m = flor.Materializer(directory, mode=mode)
# The directory becomes unwritable (or the disk "fills") after the writer
# was set up: the failure must surface at flush(), not vanish.
if case == "readonly":
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)  # root ignores permission bits: drop to nobody
    else:
        os.chmod(directory, 0o555)
elif case == "filesize":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    m.submit("ckpt", {"w": torch.ones(2**20)})
    m.flush()
except flor.CheckpointWriteError as e:
    print(e.errno, e.filename, e.failures[0][2], sep="|")
    print(str(e), file=sys.stderr)
else:
    print("no error")
m.close()
"""


@pytest.mark.parametrize("mode", ["inline", "thread", "fork"])
@pytest.mark.parametrize("case,expected", [("readonly", errno.EACCES), ("filesize", errno.EFBIG)])
def test_failed_write_is_reported_by_flush(world_tmp, mode, case, expected):
    directory = world_tmp / "ckpts"
    directory.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_IN_CHILD, mode, str(directory), case],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    err, filename, step = proc.stdout.strip().split("|")
    assert int(err) == expected
    assert filename == str(directory / "ckpt.flor")
    assert step == ("create" if case == "readonly" else "write")
    assert os.strerror(expected) in proc.stderr
    assert os.listdir(directory) == []  # no partial file, no temp file


@pytest.mark.unit
def test_script_functions_pickle_by_value_even_recursive(tmp_path):
    """Functions defined in a script are pickled by value (cloudpickle); a
    recursive one cannot use the memo-free fast path and falls back."""
    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    flor.save({"f": fact, "w": torch.ones(2)}, tmp_path / "f.flor")
    with pytest.raises(flor.UnsafeCheckpoint, match="trusted=True"):
        flor.load(tmp_path / "f.flor")  # code: only on request
    assert flor.load(tmp_path / "f.flor", trusted=True)["f"](5) == 120
