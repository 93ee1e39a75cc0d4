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
in rank r (flor/replay/plan.py picks it).  The plan uses only the executions
that every rank that ran them checkpointed and whose files exist
(`consistent`), and rank 0's segments and worker ports (`share_plan`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys

from ..errors import CheckpointCorrupt, FlorError

__all__ = ["Group", "world", "rank_run_id", "replicated", "split", "join", "unusable",
           "group_runs", "share_plan"]

PREFIX = "flor/"
OWNER = 0  # the rank that writes replicated state
TIMEOUT_S = 600  # how long a rank waits for rank 0 to create the run


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
        self.leader: str | None = None

    @classmethod
    def from_env(cls) -> "Group | None":
        w = world()
        return cls(*w) if w is not None else None

    def wait_leader(self) -> str | None:
        """Rank r > 0: the run id of rank 0, once rank 0 has made its run.
        Rank 0: None (it makes the run, then `publish`es it)."""
        if self.rank == 0:
            return None
        try:
            self.leader = self.store.get(PREFIX + "run").decode()
        except RuntimeError as e:
            raise FlorError(f"rank {self.rank} waited {TIMEOUT_S} s for rank 0 to start "
                            f"recording ({e})") from None
        return self.leader

    def publish(self, run_id: str):
        self.leader = run_id
        self.store.set(PREFIX + "run", run_id)

    def info(self, run_id) -> dict:
        return {"group": self.leader or run_id, "rank": self.rank, "world_size": self.size}

    def agree(self, key: str, ctx: str, occurrence: int, mine: bool) -> tuple[bool, int]:
        """(checkpoint?, the rank that decided): the decision of the first
        rank to reach this execution."""
        what = PREFIX + "d/" + hashlib.sha1(f"{key}\0{ctx}\0{occurrence}".encode()).hexdigest()
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
    shared = {id(p) for o in objs if isinstance(o, ddp) for p in o.parameters()}
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


def group_runs(store, rec) -> list[dict] | None:
    """The runs of every rank of a data-parallel record, by rank; None
    for a record of one process."""
    info = json.loads(rec["info"] or "{}")
    size = info.get("world_size")
    if not size or size < 2:
        return None
    leader = info.get("group") or rec["run_id"]
    runs = [store.run(rank_run_id(leader, r)) for r in range(size)]
    missing = [r for r, run in enumerate(runs) if run is None]
    if missing:
        raise FlorError(f"run {leader} was recorded by {size} ranks, and the store has no "
                        f"rows of rank {missing[0]} ({rank_run_id(leader, missing[0])})")
    return runs


def unusable(store, runs) -> dict:
    """{(block, ctx, occurrence): why} of the executions that replay must run
    on every rank: one that some rank ran checkpointed on another rank but
    not on it, or whose file is missing.  Replay skips an execution on every
    rank or on none (a rank re-executing a body with collectives alone would
    wait for the others forever)."""
    seen: dict = {}
    for rank, run in enumerate(runs):
        ckpt = store.ckpt_dir(run["run_id"])
        for d in store.rows("decisions", run["run_id"]):
            what = (d["block"], d["ctx"], d["occurrence"])
            if not d["checkpoint"]:
                why = f"rank {rank} did not checkpoint it"
            elif not d["file"] or not os.path.isfile(os.path.join(ckpt, d["file"])):
                why = f"the checkpoint of rank {rank} ({d['file']}) is missing"
            else:
                why = None
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
    key = PREFIX + "replay/" + os.environ.get("TORCHELASTIC_RUN_ID", "")
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
