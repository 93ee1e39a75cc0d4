"""Hostile inputs: code that mutates what is being copied, crafted files,
collectors running inside the writer.  Each case once crashed or corrupted
data; those that could crash run in a child process."""
import copy
import gc
import struct

import pytest
import torch

import flor
from flor import _core

from conftest import run_py

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

MAGIC = bytes([0x89]) + b"FLR\r\n\x1a\n"


def test_dict_value_freed_while_its_key_is_copied():
    out = run_py(
        """
        import flor
        class V: pass
        class K:
            def __reduce_ex__(self, proto):
                d[self] = None          # drops the value the walk is about to copy
                return (K, ())
        d = {K(): V()}
        try:
            flor.snapshot(d).restore()
        except RuntimeError as e:
            print("refused:", e)
        else:
            print("copied")
        """
    )
    assert out.stdout.strip() in ("copied", "refused: dictionary changed during flor.snapshot")


@pytest.mark.unit
def test_slot_state_survives_python_setattr():
    names = tuple(f"s{i}" for i in range(12))
    keep = []

    def setattr_(self, n, v):
        keep.append({("x", j): j for j in range(12)})  # allocates: reuses freed memory
        object.__setattr__(self, n, v)

    S = type("S", (), {"__slots__": names, "__setattr__": setattr_})
    s = S()
    for n in names:
        object.__setattr__(s, n, 1)
    r = flor.snapshot([s]).restore()[0]
    assert [getattr(r, n) for n in names] == [1] * 12


def test_cycle_never_shows_python_a_half_built_list():
    out = run_py(
        """
        import flor
        class C:
            def __init__(self, ref=None):
                self.ref = ref
                if ref is not None:
                    assert all(x is None or isinstance(x, (int, C)) for x in ref)
            def __reduce_ex__(self, proto):
                return (C, (self.ref,))
        lst = [C(None), 1]
        lst[0].ref = lst
        out = flor.snapshot(lst).restore()
        print(out[0].ref is out, out[1])
        """
    )
    assert out.stdout.strip() == "True 1"


def test_storage_resized_during_the_walk_is_refused():
    out = run_py(
        """
        import torch, flor
        t = torch.arange(4 << 20, dtype=torch.float32)
        class Evil:
            def __reduce_ex__(self, proto):
                t.untyped_storage().resize_(0)
                return (Evil, ())
        try:
            flor.snapshot([t, Evil()])
        except RuntimeError as e:
            print(e)
        """
    )
    assert "resized" in out.stdout


@pytest.mark.unit
def test_same_size_key_swap_is_refused():
    live = [1, 2]
    d = {}

    class Evil:
        def __reduce_ex__(self, proto):
            if "b" in d:
                del d["b"]
                d["c"] = 0
            return (Evil, ())

    d["a"] = Evil()
    d["b"] = live
    try:
        snap = flor.snapshot(d)
    except RuntimeError as e:
        assert "changed" in str(e)
        return
    live.append("mutated after the snapshot")
    assert "mutated after the snapshot" not in repr(snap.restore())


@pytest.mark.unit
def test_negated_views_keep_their_sign():
    z = torch.tensor([1 + 2j, 3 + 4j])
    imag = z.conj().imag
    assert imag.is_neg()
    assert torch.equal(flor.snapshot(imag).restore(), torch.tensor([-2.0, -4.0]))


class SharesInside:
    def __init__(self):
        self.l = [1]
        self.m = self.l

    def __deepcopy__(self, memo):
        new = SharesInside.__new__(SharesInside)
        new.l = copy.deepcopy(self.l, memo)
        new.m = new.l
        return new


class BuildsSharing:
    def __init__(self, n=1):
        self.l = [n]
        self.m = self.l

    def __reduce_ex__(self, proto):
        return (BuildsSharing, (self.l[0],))


@pytest.mark.unit
def test_sharing_made_by_a_class_protocol_is_kept(tmp_path):
    x = {"d": SharesInside(), "b": BuildsSharing()}
    r = flor.snapshot(x).restore()
    assert r["d"].l is r["d"].m and r["b"].l is r["b"].m
    flor.save(x, tmp_path / "x.flor")
    z = flor.load(tmp_path / "x.flor", trusted=True)  # classes of this module
    assert z["d"].l is z["d"].m and z["b"].l is z["b"].m


def _valid_file(tmp_path):
    path = tmp_path / "x.flor"
    flor.save({"a": torch.zeros(1 << 20, dtype=torch.uint8)}, path)
    return bytearray(path.read_bytes())


def _reseal(b):
    """Fix the header CRC of a version-1 (128-byte) or version-2 (192-byte) header."""
    n = 124 if struct.unpack_from("<I", b, 8)[0] == 1 else 188
    struct.pack_into("<I", b, n, _core.crc32c(bytes(b[:n])))


def test_wrapping_section_offsets_are_refused(tmp_path):
    b = _valid_file(tmp_path)
    size = struct.unpack_from("<Q", b, 16)[0]
    struct.pack_into("<QQ", b, 40, (1 << 64) - size + 8, size)  # table_off + table_len wraps
    _reseal(b)
    (tmp_path / "bad.flor").write_bytes(b)
    out = run_py(f"""
        import flor
        try:
            flor.load({str(tmp_path / "bad.flor")!r})
        except flor.CheckpointCorrupt as e:
            print(e.section)
    """)
    assert out.stdout.strip() == "header"


def test_table_entries_never_run_past_the_table(tmp_path):
    import pickle

    class R:
        def __reduce__(self):
            return (_core._rebuild, (3, 1, None))

    meta = pickle.dumps(R(), 5)
    table = bytearray(struct.pack("<II", 2, 2))
    table += struct.pack("<QQI4x", 0, 0, 0)
    e1 = bytearray(24)
    e1[0], e1[3] = 3, 3
    struct.pack_into("<I", e1, 8, 1)
    data = bytearray(5) + e1 + b"|u1"
    table += struct.pack("<QQI4x", 0, 8, _core.crc32c(bytes(data[:8])))
    entry0 = bytearray(24)
    entry0[0], entry0[3] = 3, 3
    table += entry0 + b"|u1"  # 27 bytes: the table ends mid-padding
    toff = 128 + len(meta)
    doff = toff + len(table)  # entry 0's padding would reach into the data
    size = doff + len(data)
    h = bytearray(128)
    h[:8] = MAGIC
    struct.pack_into("<II7QII", h, 8, 1, 128, size, 128, len(meta), toff, len(table), doff,
                     len(data), 2, 2)
    struct.pack_into("<II", h, 80, _core.crc32c(meta), _core.crc32c(bytes(table)))
    _reseal(h)
    (tmp_path / "bad.flor").write_bytes(bytes(h) + meta + bytes(table) + bytes(data))
    out = run_py(f"""
        import flor
        try:
            print(flor.load({str(tmp_path / "bad.flor")!r}))
        except flor.CheckpointCorrupt as e:
            print("refused", e.section)
    """)
    assert out.stdout.startswith("refused")


def test_collection_inside_the_writer_does_not_hang(tmp_path):
    """The writer thread runs a collection (from code it pickles) that finds
    the only other reference to the engine in unreachable garbage."""
    out = run_py(f"""
        import gc, os, time, flor
        gc.disable()  # only the writer collects
        class Trigger:
            def __init__(self, copied=False):
                self.copied = copied
            def __reduce_ex__(self, proto):
                if self.copied and proto >= 5:
                    gc.collect()
                return (Trigger, (True,))
        path = os.path.join({str(tmp_path)!r}, "a.flor")
        m = flor.Materializer({str(tmp_path)!r}, mode="thread")
        flor.materializer._live.clear()  # as if the exit hook did not hold it
        holder = {{"m": m}}
        holder["self"] = holder
        m.submit("a", Trigger())
        del m, holder
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            pass  # watch for the file the writer must produce
        gc.enable()
        class Cyc:
            pass
        a = Cyc(); a.me = a; del a
        print(os.path.exists(path), gc.collect() > 0)
    """, timeout=60)
    assert out.stdout.strip() == "True True"


@pytest.mark.unit
def test_long_non_ascii_failure_message_is_reported(tmp_path):
    class Bad:
        def __init__(self, copied=False):
            self.copied = copied

        def __reduce_ex__(self, proto):
            if self.copied and proto >= 5:
                raise ValueError("x" + "\u00e9" * 600)
            return (Bad, (True,))

    for mode in ("thread", "fork"):
        m = flor.Materializer(tmp_path / mode, mode=mode, batch_count=1)
        m.submit("a", Bad())
        try:
            m.flush()
        except flor.CheckpointWriteError as e:
            assert "ValueError" in e.failures[0][3]
        else:
            raise AssertionError(f"{mode}: the failure was not reported")
        finally:
            m.close()
    gc.collect()
