"""The device side of flor._core: snapshots and fingerprints of CUDA tensors,
through torch's streams and events.  csrc/walk.c finds the CUDA storages of
what it walks and calls the functions below; nothing else does, and this
module is imported only once a CUDA tensor has been met or a fingerprint is
to be read later (which imports torch only where CUDA storages are given).

copy(arena, blobs, pinned) queues the copy of every storage into the pinned
staging arena and returns a Pending, which every reader of the arena waits
on first (the writer thread, Snapshot.restore, flor.save).  Training is not
stopped: the copy runs on a stream of flor's own, after the work the
training stream has queued so far, and a later in-place update never
reaches the snapshot, by one of two orders:

  staged   the training stream first copies the storages into one device
           buffer (device-to-device: a few hundred microseconds per GiB on a
           current GPU), then flor's stream copies that buffer to the host
           while training goes on;
  ordered  flor's stream copies the storages themselves, and the training
           stream waits for that copy before its next kernel.

FLOR_CUDA_COPY=auto (the default) stages where the device has room for the
buffer (half its free memory), else orders; staged and ordered force one
(staged orders where the buffer cannot be allocated).  Storages under SMALL
bytes are coalesced into one copy.  docs/benchmarks.md ("The CUDA path on a
GPU") has what each costs the training stream.

digest(blobs) is the sum under a version 2 or 3 state fingerprint
(csrc/crc32c.c, flor_digest64) of storages, or of the spans of them that
tensors view (version 3), computed where they live with int64 kernels:
no host copy, one synchronisation for the 8-byte result.  On CPU storages it
gives what the C code gives, which tests/test_fingerprint.py checks.
later(blobs, crc, total, version) queues the same sum and its copy to the host, and
returns a Later, whose value() is the fingerprint: a record's block-end
fingerprints do not wait for the training kernels queued before them.

torch is imported by the functions that use it: record checks FLOR_CUDA_COPY
(mode()) before the script runs, and must not import torch before it does.
"""
from __future__ import annotations

import os

__all__ = ["copy", "digest", "later", "Later", "Pending", "MODES", "ENV"]

ENV = "FLOR_CUDA_COPY"
MODES = ("auto", "staged", "ordered")
ALIGN = 64  # FLOR_ALIGN in csrc/flor.h: each blob starts at a multiple of it
SMALL = 1 << 20  # storages under this are coalesced into one copy (ordered mode)
PASS = 1 << 22  # int64 words a fingerprint pass reads: bounds its temporaries (32 MiB each)
K1 = 0x9E3779B97F4A7C15 - (1 << 64)  # D1 and D2 in csrc/crc32c.c, as int64
K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
MASK = (1 << 64) - 1

_streams: dict = {}  # device -> flor's copy stream
_zeros: dict = {}  # device -> ALIGN zero bytes, for padding


def mode() -> str:
    """The order copies keep, from FLOR_CUDA_COPY."""
    m = os.environ.get(ENV, "auto")
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, not {m!r}")
    return m


class Pending:
    """The copies of one snapshot still in flight: one event per device."""

    __slots__ = ("events",)

    def __init__(self):
        self.events: list = []

    def wait(self):
        """Return once every copy has landed (the GIL is released meanwhile)."""
        import torch

        for device, event in self.events:
            with torch.cuda.device(device):  # no context made on another device
                event.synchronize()


def _bytes(storage):
    """A storage's bytes as a uint8 tensor on its device (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _pad(device, n):
    """n (< ALIGN) zero bytes on a device."""
    import torch

    z = _zeros.get(device)
    if z is None:
        z = _zeros[device] = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    return z[:n]


def _stream(device):
    import torch

    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device)
    return s


def _aligned(n) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _runs(group, small=None) -> list:
    """Blobs (storage, offset, nbytes) in runs that are contiguous in the
    arena: [(start, end, blobs)].  With small set, only runs of blobs under
    it, and each larger blob alone."""
    runs: list = []
    for b in sorted(group, key=lambda b: b[1]):
        alone = small is not None and b[2] >= small
        last = runs[-1] if runs else None
        if last and not alone and not last[3] and last[1] == b[1]:
            last[1] = b[1] + _aligned(b[2])
            last[2].append(b)
        else:
            runs.append([b[1], b[1] + _aligned(b[2]), [b], alone])
    return [(start, end, blobs) for start, end, blobs, _ in runs]


def _pieces(blobs) -> list:
    """The bytes of a contiguous run, padded as the arena lays them out."""
    out = []
    for storage, _, nbytes in blobs:
        out.append(_bytes(storage))
        if _aligned(nbytes) > nbytes:
            out.append(_pad(out[-1].device, _aligned(nbytes) - nbytes))
    return out


def _room(device, nbytes) -> bool:
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= free // 2


def _staged(host, device, runs, cur, side, pinned) -> bool:
    """Queue the staged copies; False, with nothing queued, where the device
    has no memory for the buffers."""
    import torch

    try:
        stages = [torch.empty(end - start, dtype=torch.uint8, device=device)
                  for start, end, _ in runs]
    except torch.cuda.OutOfMemoryError:
        return False
    for stage, (_, _, blobs) in zip(stages, runs):  # on the training stream
        torch.cat(_pieces(blobs), out=stage)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for stage, (start, end, _) in zip(stages, runs):
            host[start:end].copy_(stage, non_blocking=pinned)
            stage.record_stream(side)  # its memory is reused only after the copy
    return True


def _ordered(host, runs, cur, side, pinned):
    import torch

    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for start, end, blobs in runs:
            for storage, _, _ in blobs:
                # Freed by the script meanwhile, its memory is not reused
                # before this copy has read it.
                _bytes(storage).record_stream(side)
            if len(blobs) == 1:
                storage, offset, nbytes = blobs[0]
                host[offset:offset + nbytes].copy_(_bytes(storage), non_blocking=pinned)
            else:  # small ones, coalesced on the device first
                host[start:end].copy_(torch.cat(_pieces(blobs)), non_blocking=pinned)


def copy(arena, blobs, pinned) -> Pending:
    """Queue the copy of CUDA storages into the arena (a writable memoryview).
    blobs: [(storage, offset, nbytes)]; the arena's padding after each blob
    is zero already.  The copies land once the Pending's wait() returns."""
    import torch

    host = torch.frombuffer(arena, dtype=torch.uint8)
    chosen = mode()
    devices: dict = {}
    for b in blobs:
        devices.setdefault(b[0].device, []).append(b)
    pending, used = Pending(), []
    try:
        for device, group in devices.items():
            cur, side = torch.cuda.current_stream(device), _stream(device)
            used.append(side)
            runs = _runs(group)
            staged = chosen != "ordered" and (
                chosen == "staged" or _room(device, sum(end - start for start, end, _ in runs))
            ) and _staged(host, device, runs, cur, side, pinned)
            if not staged:
                _ordered(host, _runs(group, SMALL), cur, side, pinned)
            done = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, never spins
            done.record(side)
            pending.events.append((device, done))
            if not staged:
                cur.wait_event(done)  # the training stream's next kernels come after the copy
    except BaseException:
        # Nothing may still write into the arena once it can be reused.
        for side in used:
            side.synchronize()
        raise
    return pending


def _terms(words, first):
    """The sum of the digest terms of int64 words, the first at word index
    first (flor_digest64 in csrc/crc32c.c), as a 0-d tensor on their device."""
    import torch

    x = torch.arange(first + 1, first + 1 + words.numel(), dtype=torch.int64,
                     device=words.device)
    x.mul_(K1).bitwise_xor_(words).mul_(K2)
    x.bitwise_xor_(x >> 31)  # arithmetic shift, as the C code's
    return x.sum()


def _whole(u8, first) -> list:
    """The terms of one storage's bytes (a last partial word zero-padded)."""
    import torch

    n = u8.numel()
    words = n // 8
    out = []
    if words:
        w = u8[:words * 8].view(torch.int64)
        for s in range(0, words, PASS):
            out.append(_terms(w[s:s + PASS], first + s))
    if n % 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=u8.device)
        tail[:n % 8] = u8[words * 8:]
        out.append(_terms(tail.view(torch.int64), first + words))
    return out


def digest(blobs) -> int:
    """The digest of storages [(storage, first word index[, first byte,
    length])], each storage's bytes (or the span of them given) starting at a
    fresh 8-byte word, modulo 2**64."""
    total = 0
    for s in _sums(blobs).values():
        total += int(s)  # one synchronisation per device
    return total & MASK


class Later:
    """A version 2 or 3 fingerprint whose device part is still being
    computed (csrc/walk.c, fingerprint(obj, 3, True)): `crc` is the CRC-32C
    of the blobs' lengths, `total` the host blobs' digest, `parts` each
    device's sum as (device, pinned host tensor it is copied into, the event
    after the copy), `version` the bit the value sets (32 + version - 2)."""

    __slots__ = ("crc", "total", "parts", "version", "_value")

    def __init__(self, crc, total, version=2):
        self.crc, self.total, self.parts, self._value = crc, total, [], None
        self.version = version

    def value(self) -> int:
        """The fingerprint, once every device part has landed (waiting for
        those copies alone, not for what was queued after them)."""
        if self._value is None:
            from . import _core

            total = self.total
            for device, host, event in self.parts:
                import torch

                with torch.cuda.device(device):
                    event.synchronize()
                total += int(host)
            self.parts = []
            word = (total & MASK).to_bytes(8, "little")
            self._value = 1 << (30 + self.version) | _core.crc32c(word, self.crc)
        return self._value


def later(blobs, crc, total, version=2) -> Later:
    """Queue the digest of storages [(storage, first word index[, first
    byte, length])] on their devices' current streams, after the work
    queued there so far (which a later in-place update of the storages comes
    after), and return the fingerprint of that version that adds it to
    `total` (see Later)."""
    out = Later(crc, total, version)
    if not blobs:
        return out
    import torch

    for storage, *_ in blobs:
        if storage.device.type == "cuda":
            # Freed by the script meanwhile, its memory is not reused before
            # the digest has read it.
            _bytes(storage).record_stream(torch.cuda.current_stream(storage.device))
    for device, s in _sums(blobs).items():
        if device.type != "cuda":
            out.total += int(s)
            continue
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(s, non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, never spins
        done.record(torch.cuda.current_stream(device))
        out.parts.append((device, host, done))
    return out


def _sums(blobs) -> dict:
    """Each device's sum of the digest terms of storages [(storage, first
    word index[, first byte, length])], as a 0-d int64 tensor there
    (wrapping modulo 2**64).
    Storages under a pass are copied together (consecutive words of one
    device, a pass at most) and read in one pass; larger ones are read
    where they are."""
    if not blobs:
        return {}
    import torch

    parts: dict = {}  # device -> 0-d tensors
    run: list = []  # the storages of the pass being gathered, padded to whole words
    first = end = None

    def close_run():
        if run:
            parts.setdefault(run[0].device, []).extend(_whole(torch.cat(run), first))
            run.clear()

    for storage, at, *span in blobs:
        u8 = _bytes(storage)
        if span:
            u8 = u8[span[0]:span[0] + span[1]]
        n = u8.numel()
        words = (n + 7) // 8
        if words > PASS // 2:
            if u8.storage_offset() % 8 == 0:
                parts.setdefault(u8.device, []).extend(_whole(u8, at))
                continue
            # Words are read as int64, from an 8-byte boundary: a span that
            # starts off one is copied, a pass at a time.
            for s in range(0, n, 8 * PASS):
                piece = u8[s:s + 8 * PASS].clone()
                parts.setdefault(u8.device, []).extend(_whole(piece, at + s // 8))
            continue
        if not run or at != end or u8.device != run[0].device or at + words - first > PASS:
            close_run()
            first = at
        run.append(u8)
        if n % 8:
            run.append(_pad(u8.device, 8 - n % 8))
        end = at + words
    close_run()
    return {device: torch.stack(tensors).sum() for device, tensors in parts.items()}
