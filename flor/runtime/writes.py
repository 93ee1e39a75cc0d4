"""The record's checkpoint writes: the materializer (made once per run),
the block whose checkpoint is being written now (what an overlapped block
execution competes with, runtime/charge.py), and how fast this machine
writes and copies checkpoints (a one-time calibration per store and host,
then the run's own writes).
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple

from .. import _core, trust
from ..errors import CheckpointWriteError, FlorError, note
from ..materializer import Materializer, mode_from_env

__all__ = ["Speeds", "Writes", "Writing", "calibration"]

CALIBRATION_BYTES = 32 << 20
LATENCY_SAMPLES = 5  # checkpoints of no bytes written to calibrate a file's fixed cost
# What the rule assumes where the store's calibration could not be measured:
# a slow disk (so few checkpoints) and an ordinary memory copy.
FALLBACK_WRITE_BPS = 20 << 20
FALLBACK_LATENCY_S = 0.01
FALLBACK_COPY_BPS = 1 << 30


class Speeds(NamedTuple):
    """How fast this machine writes and copies checkpoints.  Writing one
    takes a fixed time per file (creating, syncing and renaming it) plus
    its bytes over the write bandwidth: a run of small checkpoints spends
    its write time on files, not bytes, and says nothing of the bandwidth."""
    latency_s: float  # per file written
    write_bps: float
    copy_bps: float

    def write_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.write_bps

    def measured(self, written: int, seconds: float, nbytes: int) -> Speeds:
        """These speeds corrected by a run's own writes (`written` files in
        `seconds`, `nbytes` of data): its files' mean size says which of the
        two its time measures.  Files smaller than what the disk writes in
        one file's fixed time measure that time; larger ones, the bandwidth."""
        if written < 2 or seconds <= 0:
            return self
        if nbytes / written >= self.latency_s * self.write_bps:
            data_s = max(seconds - written * self.latency_s, seconds / 2)
            return self._replace(write_bps=nbytes / data_s)
        latency = (seconds - nbytes / self.write_bps) / written
        return self._replace(latency_s=latency) if latency > 0 else self


class Writing(NamedTuple):
    """What the background writes are doing now: the block whose checkpoint
    is being written (None: nothing is), and the CPU seconds the writers
    have used so far (None where they are counted late: a fork-mode child's
    once it is reaped)."""
    block: str | None
    cpu: float | None


class Writes:
    """The checkpoints of one record, as they are written."""

    def __init__(self, store, run_id, adaptive):
        self.store, self.run_id, self.adaptive = store, run_id, adaptive
        self.submitted: list[str] = []  # the block of each checkpoint submitted, in order
        self._mat = None
        self._speeds = None  # calibrated
        self._idle = None  # the materializer's counters, while it has nothing to write
        self._measured = (None, None)  # (write counters, the speeds they gave)
        # Seconds of one-time work (calibrating the disk, making the
        # materializer): not what a loop's iterations cost flor each time.
        self.setup_s = 0.0

    def materializer(self) -> Materializer:
        if self._mat is None:
            t0 = time.perf_counter()
            # batch_count=1: fork mode writes each checkpoint now, not at exit,
            # so that a killed record keeps what it checkpointed.  Incremental:
            # a checkpoint refers to the unchanged tensor bytes of earlier ones.
            try:
                signed = trust.signer() is not None
            except (OSError, FlorError) as e:
                note(f"checkpoints of this run are not signed ({e}); replay will load them "
                     "in safe mode")
                signed = False
            self._mat = Materializer(self.store.layout.ckpt_dir(self.run_id), mode=mode_from_env(),
                                     batch_count=1, incremental=True, signed=signed)
            self.setup_s += time.perf_counter() - t0
        return self._mat

    def submit(self, key, name, payload, tag) -> int:
        """Hand checkpoint `name` of block `key` to the materializer (made
        first); returns its bytes.  Raises CheckpointWriteError."""
        self._idle = None  # (a submit that fails may still have counted finished writes)
        nbytes = self.materializer().submit(name, payload, tag)
        self.submitted.append(key)
        return nbytes

    def idle(self) -> bool:
        """Whether no checkpoint is being written (as last asked)."""
        return self._mat is None or self._idle is not None

    def _stats(self) -> dict:
        """The materializer's counters.  Once nothing is pending (every
        write finished and counted) they cannot change until the next
        submit: a step loop's iterations, most of them checkpointing
        nothing, do not ask again."""
        if self._idle is not None:
            return self._idle
        st = self._mat.stats()
        if not st["pending"]:
            self._idle = st
        return st

    def writing(self) -> Writing:
        """What is being written now: the oldest checkpoint submitted that
        has not finished (writes finish in order), and the writers' CPU."""
        if self._mat is None:
            return Writing(None, 0.0)
        st = self._stats()
        cpu = st["writer_cpu_seconds"] if self._mat.mode == "thread" else None
        if not st["writing"] or not self.submitted:
            return Writing(None, cpu)
        done = st["written"] + st["failed"]
        return Writing(self.submitted[min(done, len(self.submitted) - 1)], cpu)

    def speeds(self) -> Speeds:
        """How fast checkpoints are written and copied: calibrated once per
        store and host, the writes corrected by the run's own."""
        if self._speeds is None:
            t0 = time.perf_counter()
            self._speeds = calibration(self.store, self.adaptive)
            self.setup_s += time.perf_counter() - t0
        if self._mat is None:
            return self._speeds
        st = self._stats()
        counts = st["written"], st["write_seconds"], st["bytes_written"]
        if self._measured[0] != counts:  # (a write pending: new counters at each call)
            self._measured = counts, self._speeds.measured(*counts)
        return self._measured[1]

    def thin(self, thinning, final=False):
        """Remove the files of the iteration checkpoints that `thinning`
        no longer keeps, once written (runtime/thinning.py)."""
        if self._mat is not None:
            st = self._stats()
            thinning.collect(self._mat, st["written"] + st["failed"], final)

    def close(self) -> list:
        """Make every checkpoint durable; returns the failed writes."""
        if self._mat is None:
            return []
        self._idle = None
        try:
            self._mat.close()
        except CheckpointWriteError as e:
            note(str(e))
            return e.failures
        return []


def calibration(store, adaptive) -> Speeds:
    """This machine's Speeds, measured once per store.  Without adaptivity
    nothing is measured: the rule decides nothing, and the run's own writes
    measure it soon enough.  A calibration that cannot write (a full disk,
    a read-only store) never stops the training: the rule then assumes a
    slow disk, and says so."""
    fallback = Speeds(FALLBACK_LATENCY_S, FALLBACK_WRITE_BPS, FALLBACK_COPY_BPS)
    if not adaptive:
        return fallback
    try:
        cal = store.layout.calibration(write_bytes_per_s=lambda: _calibrate_write(store.root),
                                       write_latency_s=lambda: _calibrate_latency(store.root),
                                       copy_bytes_per_s=_calibrate_copy)
    except OSError as e:
        note(f"could not measure how fast this machine writes checkpoints ({e}); the "
             f"adaptive rule assumes {FALLBACK_WRITE_BPS / 2**20:.0f} MiB/s and "
             f"{FALLBACK_LATENCY_S * 1e3:.0f} ms per file until this run's own checkpoints "
             "measure it")
        return fallback
    finally:
        _core.trim_pool()  # the staging buffers of its 32 MiB snapshots are not the run's
    return Speeds(cal["write_latency_s"], cal["write_bytes_per_s"], cal["copy_bytes_per_s"])


def _calibrate_write(root) -> float:
    from ..checkpoint import save

    path = os.path.join(root, f"calibrate.{os.getpid()}.flor")
    t0 = time.perf_counter()
    save({"bytes": bytearray(CALIBRATION_BYTES)}, path)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return CALIBRATION_BYTES / dt


def _calibrate_latency(root) -> float:
    """A file's fixed cost: the median time to write a checkpoint of no bytes."""
    from ..checkpoint import save

    path = os.path.join(root, f"calibrate.{os.getpid()}.flor")
    times = []
    for _ in range(LATENCY_SAMPLES):
        t0 = time.perf_counter()
        save({}, path)
        times.append(time.perf_counter() - t0)
        os.unlink(path)
    return max(sorted(times)[len(times) // 2], 1e-6)


def _calibrate_copy() -> float:
    """A snapshot's copy into a warm staging buffer (the second of two)."""
    data = bytearray(CALIBRATION_BYTES)
    _core.snapshot(data)
    return CALIBRATION_BYTES / max(_core.snapshot(data).copy_seconds, 1e-9)
