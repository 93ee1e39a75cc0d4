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

__all__ = ["Writes", "Writing", "calibration"]

CALIBRATION_BYTES = 32 << 20
# What the rule assumes where the store's calibration could not be measured:
# a slow disk (so few checkpoints) and an ordinary memory copy.
FALLBACK_WRITE_BPS = 20 << 20
FALLBACK_COPY_BPS = 1 << 30


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
        self._bw = None

    def materializer(self) -> Materializer:
        if self._mat is None:
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
        return self._mat

    def writing(self) -> Writing:
        """What is being written now: the oldest checkpoint submitted that
        has not finished (writes finish in order), and the writers' CPU."""
        if self._mat is None:
            return Writing(None, 0.0)
        st = self._mat.stats()
        cpu = st["writer_cpu_seconds"] if self._mat.mode == "thread" else None
        if not st["writing"] or not self.submitted:
            return Writing(None, cpu)
        done = st["written"] + st["failed"]
        return Writing(self.submitted[min(done, len(self.submitted) - 1)], cpu)

    def bandwidth(self) -> tuple[float, float]:
        """(write, copy) bytes per second: the write bandwidth measured by the
        run's own writes once there are some, else both by a one-time
        calibration of this machine."""
        if self._bw is None:
            self._bw = calibration(self.store, self.adaptive)
        write_bw, copy_bw = self._bw
        if self._mat is not None:
            st = self._mat.stats()
            # Checkpoints of numbers alone carry no data bytes: no measure.
            if st["written"] >= 2 and st["write_seconds"] > 0 and st["bytes_written"] > 0:
                write_bw = st["bytes_written"] / st["write_seconds"]
        return write_bw, copy_bw

    def thin(self, thinning, final=False):
        """Remove the files of the iteration checkpoints that `thinning`
        no longer keeps, once written (runtime/thinning.py)."""
        if self._mat is not None:
            st = self._mat.stats()
            thinning.collect(self._mat, st["written"] + st["failed"], final)

    def close(self) -> list:
        """Make every checkpoint durable; returns the failed writes."""
        if self._mat is None:
            return []
        try:
            self._mat.close()
        except CheckpointWriteError as e:
            note(str(e))
            return e.failures
        return []


def calibration(store, adaptive) -> tuple[float, float]:
    """(write, copy) bytes per second of this machine, measured once per
    store.  Without adaptivity nothing is measured: the rule decides
    nothing, and the run's own writes measure it soon enough.  A calibration
    that cannot write (a full disk, a read-only store) never stops the
    training: the rule then assumes a slow disk, and says so."""
    if not adaptive:
        return FALLBACK_WRITE_BPS, FALLBACK_COPY_BPS
    try:
        cal = store.layout.calibration(write_bytes_per_s=lambda: _calibrate_write(store.root),
                                copy_bytes_per_s=_calibrate_copy)
    except OSError as e:
        note(f"could not measure how fast this machine writes checkpoints ({e}); the "
             f"adaptive rule assumes {FALLBACK_WRITE_BPS / 2**20:.0f} MiB/s until this "
             "run's own checkpoints measure it")
        return FALLBACK_WRITE_BPS, FALLBACK_COPY_BPS
    return cal["write_bytes_per_s"], cal["copy_bytes_per_s"]


def _calibrate_write(root) -> float:
    from ..checkpoint import save

    path = os.path.join(root, f"calibrate.{os.getpid()}.flor")
    t0 = time.perf_counter()
    save({"bytes": bytearray(CALIBRATION_BYTES)}, path)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return CALIBRATION_BYTES / dt


def _calibrate_copy() -> float:
    """A snapshot's copy into a warm staging buffer (the second of two)."""
    data = bytearray(CALIBRATION_BYTES)
    _core.snapshot(data)
    return CALIBRATION_BYTES / max(_core.snapshot(data).copy_seconds, 1e-9)
