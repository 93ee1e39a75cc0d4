"""Data-parallel records: the ranks that torchrun starts record one run.

Under ``torchrun --nproc_per_node N`` (the script's own DistributedDataParallel
training, or ``torchrun ... -m flor record train.py``) each rank is a process
of its own.  They record one run of N ranks:

- Rank 0 creates the run; rank r > 0 stores its rows in the run
  ``<run>-rank<r>``, whose info names the group (``group``, ``rank``,
  ``world_size``).  The run id reaches the other ranks through the store
  that torchrun's agent hosts (``MASTER_ADDR:MASTER_PORT``), before the
  script creates its process group.
- Every rank follows one decision per block execution, so that replay skips
  the same executions on every rank (a rank that re-executed a block whose
  body runs collectives alone would hang the others).  The first rank to
  reach an execution decides, by compare-and-set of the execution's key in
  that store; the others follow it and the C rule is told
  (`SkipMachine.overruled`).
- What every rank holds alike, the parameters and optimizer state of a
  DistributedDataParallel model (DDP makes them equal on every rank), is
  written once, by rank 0 (the owner): always the same rank, so that its
  incremental checkpoints refer to the unchanged blobs of its earlier ones
  (an iteration checkpoint right after a block's holds the same bytes), and
  so that an evaluation block that only rank 0 runs keeps its checkpoints.
  Every rank writes its own random state, its module buffers (BatchNorm
  statistics differ per rank) and whatever else the block changed.  A
  checkpoint that leaves replicated objects to the owner says so in its
  payload::

      {"replicated": {"owner": 0, "index": [i, ...]}}  # objs[i]: the owner's

  and `join` puts the owner's objects back in at replay.  A file never names
  a path: the owner's file has the same name in the owner rank's run.  (An
  execution that rank 0 does not run, a block under ``if rank == 1:``, has
  no owner's file: replay re-executes it on the ranks that ran it.)

Replay under torchrun with the record's world size replays rank r's record
in rank r (flor/replay/plan.py picks it).  The plan restores only the
executions that every rank that ran them checkpointed and whose files (and
the earlier files these refer to) exist (`unusable` lists the others), and
uses rank 0's segments and worker ports (`share_plan`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys

from ..errors import CheckpointCorrupt, FlorError
from ..layout import checkpoint_path
from ..runinfo import RecordInfo

__all__ = ["Group", "world", "rank_run_id", "replicated", "split", "join", "read", "sources",
           "unusable", "group_runs", "share_plan"]

OWNER = 0  # the rank that writes replicated state
TIMEOUT_S = 600  # how long a rank waits for rank 0 to create the run


def _prefix() -> str:
    """Keys of this launch and attempt: torchrun keeps its agent's store
    across restarts (--max-restarts), and a restarted attempt is a new record."""
    return (f"flor/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")


def world() -> tuple[int, int] | None:
    """(rank, world size) of a process that torchrun started with more than
    one rank (its agent hosts a store the ranks can reach), else None."""
    try:
        size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    if size < 2 or not 0 <= rank < size:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return rank, size


def rank_run_id(leader: str, rank: int) -> str:
    return leader if rank == 0 else f"{leader}-rank{rank}"


def _agent_store():
    from torch.distributed import TCPStore

    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    except (KeyError, ValueError, RuntimeError) as e:
        raise FlorError(f"cannot reach the store of torchrun's agent at "
                        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                        f"({e}); flor records data-parallel ranks started by torchrun") from None


class Group:
    """The ranks of one torchrun launch, as a record sees them."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.store = _agent_store()
        self.leader: str | None = None  # rank 0's run id

    @classmethod
    def join(cls, resuming=False) -> "Group | None":
        """The group of this process, if torchrun started it among others.
        Rank r > 0 waits for rank 0 to make the run before it opens the
        store (SQLite would have two processes create it at once)."""
        w = world()
        if w is None:
            return None
        if resuming:
            raise FlorError("record --resume of a data-parallel record is not supported; "
                            "record it again under torchrun")
        group = cls(*w)
        if group.rank != 0:
            try:
                group.leader = group.store.get(_prefix() + "run").decode()
            except RuntimeError as e:
                raise FlorError(f"rank {group.rank} waited {TIMEOUT_S} s for rank 0 to start "
                                f"recording ({e})") from None
        return group

    def publish(self, run_id: str):
        """Rank 0: the run is made; the other ranks may go on."""
        if self.rank == 0:
            self.leader = run_id
            self.store.set(_prefix() + "run", run_id)

    @property
    def owner(self) -> bool:
        """Whether this rank writes the replicated state."""
        return self.rank == OWNER

    def follow(self, machine, handle, key, ctx, occurrence, decided, write_s, nbytes):
        """(checkpoint?, reason): the group's decision on this execution,
        given this rank's (`decided`: decide()'s result); the C rule's
        accounting follows it."""
        ok, reason = decided[0], decided[1]
        agreed, decider = self.agree(key, ctx, occurrence, ok)
        if decider != self.rank:
            reason = f"{'checkpoint' if agreed else 'no checkpoint'}, as rank {decider} " \
                     f"decided (this rank's rule: {reason})"
        if agreed != ok:
            machine.overruled(handle, agreed, write_s, nbytes)
        return agreed, reason

    def new_run_id(self, store, make, info: RecordInfo) -> str:
        """This rank's run id: rank 0's is new (`make()`), rank r's follows
        it; one that is already in the store is refused.  `info` (the run's)
        gets the group, this rank and the world size."""
        run_id = rank_run_id(self.leader or make(), self.rank)
        if store.run(run_id) is not None:
            raise FlorError(f"rank {self.rank}: run {run_id} is already in {store.root}; "
                            "record it again")
        info.group, info.rank, info.world_size = self.leader or run_id, self.rank, self.size
        return run_id

    def agree(self, key: str, ctx: str, occurrence: int, mine: bool) -> tuple[bool, int]:
        """(checkpoint?, the rank that decided): the decision of the first
        rank to reach this execution."""
        digest = hashlib.sha1(f"{key}\0{ctx}\0{occurrence}".encode()).hexdigest()
        what = _prefix() + "d/" + digest
        got = self.store.compare_set(what, "", f"{int(mine)} {self.rank}")
        if self.store.add(what + "/n", 1) == self.size:  # the last rank to get here
            self.store.delete_key(what)
            self.store.delete_key(what + "/n")
        yes, decider = got.decode().split()
        return yes == "1", int(decider)


def _params(o, torch):
    if isinstance(o, torch.nn.Module):
        return list(o.parameters())
    if isinstance(o, torch.optim.Optimizer):
        return [p for g in o.param_groups for p in g["params"]]
    return []


def replicated(objs) -> list[int]:
    """Indices of the objects that every rank holds alike: DistributedDataParallel
    modules, modules whose parameters all belong to one of those among `objs`,
    and optimizers that step only such parameters."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    ddp = torch.nn.parallel.DistributedDataParallel
    # (Parameters DDP is told to ignore are not synchronized: such a model
    # is written by every rank.)
    shared = {id(p) for o in objs if isinstance(o, ddp) and not getattr(
        o, "parameters_to_ignore", None) for p in o.parameters()}
    if not shared:
        return []
    zero = getattr(getattr(torch.distributed, "optim", None), "ZeroRedundancyOptimizer", ())
    out = []
    for i, o in enumerate(objs):
        if isinstance(o, zero):
            continue  # each rank holds its own shard
        params = _params(o, torch)
        if params and all(id(p) in shared for p in params):
            out.append(i)
    return out


def _buffers(module) -> dict:
    """The entries of a module's state dict that are buffers (per rank)."""
    names = {name for name, _ in module.named_buffers()}
    return {k: v for k, v in module.state_dict().items() if k in names}


def split(payload: dict, rank: int, owner: int = OWNER) -> dict:
    """The checkpoint rank `rank` writes of an execution that `owner`
    checkpoints in full: the replicated objects are left to the owner
    (a module keeps its buffers)."""
    if rank == owner or os.environ.get("FLOR_REPLICATED") == "every":
        return payload  # (every: each rank writes it all; benchmarks/ranks.py compares)
    index = replicated(payload["objs"])
    if not index:
        return payload
    torch = sys.modules["torch"]
    objs = list(payload["objs"])
    for i in index:
        objs[i] = _buffers(objs[i]) if isinstance(objs[i], torch.nn.Module) else None
    return dict(payload, objs=objs, replicated={"owner": owner, "index": index})


def join(saved: dict, read_owner, size: int | None, path: str) -> dict:
    """Put the owner's replicated objects into a checkpoint `saved` (read
    from `path`) that leaves them to it; `read_owner(rank)` reads the
    owner's checkpoint of the same execution.  A checkpoint without them is
    returned as it is."""
    rep = saved.get("replicated") if isinstance(saved, dict) else None
    if rep is None:
        return saved
    objs = saved.get("objs")
    try:
        owner, index = rep["owner"], list(rep["index"])
        ok = type(owner) is int and isinstance(objs, list) and \
            all(type(i) is int and 0 <= i < len(objs) for i in index)
    except (TypeError, KeyError):
        ok = False
    if not ok or size is None or not 0 <= owner < size:
        raise CheckpointCorrupt(path, "metadata", f"its replicated objects are left to "
                                f"{rep!r}, which is not a rank of this {size or 1}-rank run")
    full = read_owner(owner)
    theirs = full.get("objs") if isinstance(full, dict) else None
    if not isinstance(theirs, list) or len(theirs) != len(objs) or full.get("replicated"):
        raise CheckpointCorrupt(path, "metadata", f"the checkpoint of rank {owner} does not "
                                "hold the objects this one leaves to it")
    objs = list(objs)
    for i in index:
        mine, whole = objs[i], theirs[i]
        if isinstance(mine, dict) and isinstance(whole, dict):
            merged = whole.copy()
            merged.update(mine)  # this rank's own buffers
            objs[i] = merged
        else:
            objs[i] = whole
    out = dict(saved, objs=objs)
    del out["replicated"]
    return out


def read(ckpt_dir: str, fname: str, expect: bytes, group: dict | None, sealed=False):
    """A checkpoint of the record (blockstate.read_own): (payload, how); of
    a data-parallel record (`group`: the plan's ranks), with the replicated
    objects it leaves to the owner rank's file of the same name put back."""
    from .blockstate import read_own

    path = checkpoint_path(ckpt_dir, fname)
    saved, how = read_own(path, expect, sealed=sealed)
    if group is not None:
        def owner(rank):
            # Its devices are the owner's: what is not copied into a live
            # object stays on the CPU.
            # (another rank's run, whose seal replay did not check)
            return read_own(checkpoint_path(group["ckpt_dirs"][rank], fname), expect,
                            devices=False)[0]
        saved = join(saved, owner, group["size"], path)
    return saved, how


def group_runs(store, rec) -> list[dict] | None:
    """The runs of every rank of a data-parallel record, by rank; None
    for a record of one process."""
    info = rec["info"]
    size = info.world_size
    if not size or size < 2:
        return None
    leader = info.group or rec["run_id"]
    runs = [store.run(rank_run_id(leader, r)) for r in range(size)]
    missing = [r for r, run in enumerate(runs) if run is None]
    if missing:
        raise FlorError(f"run {leader} was recorded by {size} ranks, and the store has no "
                        f"rows of rank {missing[0]} ({rank_run_id(leader, missing[0])})")
    return runs


MAGIC = b"\x89FLR\r\n\x1a\n"


def sources(path: str) -> list[str]:
    """The earlier files whose blobs a checkpoint refers to (docs/FORMAT.md:
    the header's n_sources and table_off, the table's source names); raises
    ValueError for a file that is not a readable flor checkpoint."""
    with open(path, "rb") as f:
        head = f.read(192)
        if len(head) < 96 or head[:8] != MAGIC:
            raise ValueError(f"{path} is not a flor checkpoint")
        version, n = int.from_bytes(head[8:12], "little"), int.from_bytes(head[92:96], "little")
        if version < 2 or n == 0:
            return []
        table_off = int.from_bytes(head[40:48], "little")
        table_len = int.from_bytes(head[48:56], "little")
        f.seek(table_off)
        table = f.read(min(table_len, 16 + n * (8 + 256)))
    out, p = [], 16
    for _ in range(n):
        if p + 2 > len(table):
            raise ValueError(f"{path}: its table is truncated")
        size = table[p] | table[p + 1] << 8
        name = table[p + 2:p + 2 + size].decode("ascii", "replace")
        if len(name) != size or "/" in name or not name:
            raise ValueError(f"{path}: source {len(out)} is malformed")
        out.append(name)
        p += (2 + size + 7) // 8 * 8
    return out


def _missing(ckpt: str, name: str | None) -> str | None:
    """What of checkpoint `name` in directory `ckpt` is missing, or None."""
    if not name:
        return "no file"
    path = os.path.join(ckpt, name)
    try:
        refs = sources(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except (OSError, ValueError) as e:
        return str(e)
    gone = [r for r in refs if not os.path.isfile(os.path.join(ckpt, r))]
    return f"{name} refers to {gone[0]}, which is missing" if gone else None


def unusable(store, runs) -> dict:
    """{(block, ctx, occurrence): why} of the executions that replay must run
    on every rank: one that some rank ran checkpointed on another rank but
    not on it, or whose file is missing.  Replay skips an execution on every
    rank or on none (a rank re-executing a body with collectives alone would
    wait for the others forever)."""
    seen: dict = {}
    for rank, run in enumerate(runs):
        ckpt = store.layout.ckpt_dir(run["run_id"])
        for d in store.rows("decisions", run["run_id"]):
            what = (d["block"], d["ctx"], d["occurrence"])
            if not d["checkpoint"]:
                why = f"rank {rank} did not checkpoint it"
            else:
                gone = _missing(ckpt, d["file"])
                why = f"the checkpoint of rank {rank}: {gone}" if gone else None
            seen.setdefault(what, []).append(why)
    out = {}
    for what, whys in seen.items():
        bad = [w for w in whys if w is not None]
        if bad and len(bad) < len(whys):  # some rank can restore it, another cannot
            out[what] = bad[0]
    return out


def share_plan(segments):
    """Under torchrun: rank 0's `segments`, and a free port for each
    segment's process group, for every rank.  Returns (segments, ports)."""
    import socket

    store = _agent_store()
    key = _prefix() + "replay"
    if int(os.environ["RANK"]) == 0:
        chosen = []
        socks = []
        for _ in segments:  # held open together: distinct ports
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
            chosen.append(s.getsockname()[1])
        for s in socks:
            s.close()
        store.set(key, json.dumps({"segments": segments, "ports": chosen}))
    got = json.loads(store.get(key).decode())
    return got["segments"], got["ports"]
