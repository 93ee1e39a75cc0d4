"""What a block writes to the script's files in a record is written again
where replay restores the block from its checkpoint
(flor/runtime/filewrites.py, files.py's Files.rewrite): a script that
reads its files back prints what a plain run of the edited script prints,
and leaves the same files.  A block whose writes replay could not write
again is not checkpointed, and replay runs it."""
import os
import shutil

from conftest import ROOT, block_stats, edit, flor, plain, read, store, write_script


def _files(d, names):
    out = {}
    for name in names:
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    return out


def _decisions(st, run_id):
    """{block: [(checkpointed, reason) for each execution]} of a record."""
    out = {}
    for r in st.rows("decisions", run_id):
        out.setdefault(r["block"], []).append((r["checkpoint"], r["reason"]))
    return out


TRAINER_FILES = ["out/losses.txt", "out/losses.bin", "out/metrics.csv", "out/steps.log",
                 "out/status.json", "train.log"]


def test_a_restored_batch_loop_writes_its_files_again(tmp_path):
    # Hands-free, unmodified: tests/scripts/handsfree/trainer_files.py; the
    # batch loop's checkpoints are restored, the epoch loop reads back the
    # files the batch loop writes.
    d = str(tmp_path)
    shutil.copy(os.path.join(ROOT, "tests", "scripts", "handsfree", "trainer_files.py"), d)
    flor(d, "record", "--no-adaptive", "trainer_files.py")
    recorded = _files(d, TRAINER_FILES)
    edit(os.path.join(d, "trainer_files.py"), "for f in (losses, raw, metrics_file):",
         'print("w", round(model[0].weight.norm().item(), 6))', after=False)
    proc = flor(d, "replay", "trainer_files.py")
    replayed = _files(d, TRAINER_FILES)
    st = store(d)
    replay_id = st.runs()[-1]["run_id"]
    assert block_stats(st, replay_id, "trainer_files.py:79")["restores"] == 4
    assert "deferred checks passed" in proc.stderr
    expected = plain(d, "trainer_files.py")
    assert proc.stdout == expected.stdout
    assert "epoch 3: 32 losses" in proc.stdout and proc.stdout.count("w ") == 4
    assert replayed == _files(d, TRAINER_FILES) == recorded


MANUAL = """
import json
import logging
import os

import torch
import flor

torch.manual_seed(0)
torch.set_num_threads(1)
open("train.log", "w").close()
logging.basicConfig(filename="train.log", filemode="a", level=logging.INFO,
                    format="%(name)s %(message)s")
w = torch.zeros(4)
log = open("log.txt", "w")
status = open("status.json", "w")
open("big.bin", "wb").close()
open("enc.txt", "w").close()
extra = None
for epoch in flor.generator(range(3)):
    if flor.SkipBlock.step_into("steps"):
        for step in range(5):
            w += torch.randn(4)
            print(f"{epoch} {step} {w.sum().item():.6f}", file=log)
            open("last.txt", "w").write(f"{epoch} {step}")  # closed when dropped
            logging.getLogger("train").info("epoch %d step %d", epoch, step)
            with open("train.log", "a") as f:  # beside the handler's own
                f.write(f"direct {epoch} {step}\\n")
            with open("enc.txt", "a", encoding="latin-1", newline="\\r\\n") as f:
                f.write(f"na\\u00efve {open('last.txt').read()}\\n")
        log.flush()
    w = flor.SkipBlock.end(w)
    if flor.SkipBlock.step_into("status"):  # rewritten in place: seek, truncate
        w *= 0.9
        status.seek(0)
        status.truncate()
        status.write(json.dumps({"epoch": epoch}))
        status.flush()
    w = flor.SkipBlock.end(w)
    if flor.SkipBlock.step_into("atomic"):  # saved durably, then renamed
        with open("meta.tmp", "w") as f:
            f.write(json.dumps({"epoch": epoch}))
            f.flush()
            os.fsync(f.fileno())
        os.replace("meta.tmp", "meta.json")
        w += 0.25
    w = flor.SkipBlock.end(w)
    if flor.SkipBlock.step_into("big"):  # more than the journal keeps
        w += 1
        with open("big.bin", "ab") as f:
            f.write(bytes(5 << 20))
    w = flor.SkipBlock.end(w)
    if flor.SkipBlock.step_into("lazy"):  # opened by its first execution, kept open
        if extra is None:
            extra = open("extra.txt", "x")
        extra.write(f"{epoch} {w.mean().item():.6f}\\n")
        extra.flush()
        w -= 0.5
    w = flor.SkipBlock.end(w)
    with open("log.txt") as f:
        lines = len(f.readlines())
    with open("extra.txt") as f:
        extras = f.read().split()
    with open("enc.txt", encoding="latin-1", newline="") as f:
        enc = f.read()
    print(epoch, lines, os.path.getsize("big.bin"), open("status.json").read(),
          open("meta.json").read(), extras, repr(enc[-14:]), open("last.txt").read(),
          round(w.sum().item(), 6))
os.remove("extra.txt")  # (made with "x" by the next run)
"""


def test_blocks_whose_writes_cannot_be_written_again_run_again(tmp_path):
    d = str(tmp_path)
    write_script(d, "manual.py", MANUAL)
    unedited = plain(d, "manual.py").stdout
    record = flor(d, "record", "--no-adaptive", "manual.py")
    assert record.stdout == unedited  # (what the script reads back, as in a plain run)
    st = store(d)
    decisions = _decisions(st, st.runs()[-1]["run_id"])
    assert [c for c, _ in decisions["steps"]] == [1, 1, 1]
    for block, why in [("status", "it calls seek() on 'status.json'"),
                       ("atomic", "it calls fileno() on 'meta.tmp'"),
                       ("big", "it writes more than 4 MiB to its files")]:
        assert [c for c, _ in decisions[block]] == [0, 0, 0]
        assert f"{why}, and replay could not write it again" in decisions[block][0][1]
    # Only the execution that opened the file and left it open.
    assert [c for c, _ in decisions["lazy"]] == [0, 1, 1]
    assert "it leaves 'extra.txt' open" in decisions["lazy"][0][1]
    run = d
    files = ["log.txt", "status.json", "big.bin", "enc.txt", "last.txt", "train.log",
             "meta.json"]
    recorded = _files(run, files)
    assert read(os.path.join(run, "train.log")).count("direct") == 15

    edit(os.path.join(d, "manual.py"), "with open(\"log.txt\") as f:",
         'print("probe", round(w.norm().item(), 6))', after=False)
    proc = flor(d, "replay", "manual.py")
    assert "deferred checks passed" in proc.stderr
    replay_id = st.runs()[-1]["run_id"]
    assert block_stats(st, replay_id, "steps")["restores"] == 3
    assert block_stats(st, replay_id, "lazy")["restores"] == 2
    assert block_stats(st, replay_id, "status")["restores"] == 0
    replayed = _files(run, files)
    expected = plain(d, "manual.py")
    assert proc.stdout == expected.stdout and proc.stdout.count("probe") == 3
    assert replayed == _files(run, files) == recorded
    assert b"na\xefve 2 4\r\n" in recorded["enc.txt"]


RUN_DIR = """
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import flor

torch.manual_seed(0)
torch.set_num_threads(1)
run = os.path.join("runs", f"{time.time_ns()}-{os.getpid()}")  # another in every run
os.makedirs(run)
log = open(os.path.join(run, "log.txt"), "w")
side = open("side.txt", "w")
pool = ThreadPoolExecutor(1)
w = torch.zeros(4)
for epoch in flor.generator(range(3)):
    if flor.SkipBlock.step_into("steps"):
        for step in range(4):
            w += torch.randn(4)
            log.write(f"{epoch} {step} {w.sum().item():.6f}\\n")
            with open(os.path.join(run, "status.txt"), "w") as f:
                f.write(f"{epoch} {step}")
        log.flush()
    w = flor.SkipBlock.end(w)
    if flor.SkipBlock.step_into("threaded"):  # written by another thread
        w *= 0.5
        pool.submit(side.write, f"{epoch}\\n").result()
        side.flush()
    w = flor.SkipBlock.end(w)
    with open(os.path.join(run, "log.txt")) as f:
        lines = len(f.readlines())
    print(epoch, lines, open(os.path.join(run, "status.txt")).read(),
          open("side.txt").read().split(), round(w.sum().item(), 6))
"""


def test_files_named_by_the_run_and_writes_of_other_threads_are_run_again(tmp_path):
    # The record's files are not the replay's: a block that wrote into the
    # record's run directory runs again in the replay (and leaves the
    # record's files alone); one whose writes another thread made is not
    # checkpointed.
    d = str(tmp_path)
    write_script(d, "rundir.py", RUN_DIR)
    flor(d, "record", "--no-adaptive", "rundir.py")
    st = store(d)
    decisions = _decisions(st, st.runs()[-1]["run_id"])
    assert [c for c, _ in decisions["steps"]] == [1, 1, 1]
    assert [c for c, _ in decisions["threaded"]] == [0, 0, 0]
    assert "another thread writes to 'side.txt'" in decisions["threaded"][0][1]
    (recorded_run,) = os.listdir(os.path.join(d, "runs"))
    recorded = _files(os.path.join(d, "runs", recorded_run), ["log.txt", "status.txt"])

    edit(os.path.join(d, "rundir.py"), "with open(os.path.join(run, \"log.txt\")) as f:",
         'print("probe", round(w.norm().item(), 6))', after=False)
    proc = flor(d, "replay", "rundir.py")
    assert "block steps: it wrote to " in proc.stderr and "re-executing it" in proc.stderr
    assert "deferred checks passed" in proc.stderr
    assert proc.stdout == plain(d, "rundir.py").stdout and proc.stdout.count("probe") == 3
    assert _files(os.path.join(d, "runs", recorded_run), ["log.txt", "status.txt"]) == recorded
