"""What the `info` column of a run and of a replay part says, typed, and
the other JSON columns of a run row (argv, versions).

The store parses the JSON once, when it reads a row (`Store.run`,
`Store.runs`, `Store.parts`...; `run_row`), into the object of the row's
kind, and writes these objects back as JSON (`encoded`); nothing else
decodes the column.  A key
this version does not know (a newer flor wrote it) is kept in `extra` and
written back unchanged; a key an older flor did not write reads as its
field's default.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

__all__ = ["Info", "RecordInfo", "ReplayInfo", "PartInfo", "LABELS", "run_info", "run_row",
           "encoded"]

LABELS = ("name", "labels", "note")  # what the user calls a run: its fields of both kinds


@dataclass
class Info:
    """The fields every info object shares: the keys it does not know.
    Only the keys given (to the constructor, in the JSON read, or set
    since) are written back: a run's info says what its run stored."""

    extra: dict = field(default_factory=dict)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        given = self.__dict__.get("_given")
        if given is not None:
            given.add(name)

    @classmethod
    def from_json(cls, text: str | None):
        data = json.loads(text or "{}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict:
        given = self.__dict__.get("_given", set())
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and f.name in given}
        return {**out, **self.extra}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _given(cls):
    """Have `cls` remember the keyword arguments its instances were made
    with (its fields otherwise at their defaults, and not written)."""
    init = cls.__init__

    def __init__(self, **given):
        init(self, **given)
        object.__setattr__(self, "_given", set(given) - {"extra"})

    cls.__init__ = __init__
    return cls


@_given
@dataclass
class RecordInfo(Info):
    """A record: how it ran, and what it measured at its end."""

    adaptive: bool = True
    hands_free: bool = False
    pid: int | None = None  # the recording process, to tell a killed record
    pid_start: float | None = None
    host: str | None = None
    fingerprint: int = 1  # the state fingerprint's version (records before 2 do not say)
    # 2: checkpoint header tags bound to the run (rank 0's run id: `tag_run`)
    tags: int = 1
    iteration_checkpoints: int | None = None  # kept of each run of a loop (None: before a bound)
    resumed: list = field(default_factory=list)  # iterations record --resume started at
    group: str | None = None  # data-parallel: rank 0's run id, this rank, the world size
    rank: int | None = None
    world_size: int | None = None
    failed_writes: list = field(default_factory=list)  # checkpoint files not written
    threads: int | None = None  # torch's thread count as the main loop began
    # The count OMP_NUM_THREADS made as the record started (at most the CPU
    # count; None: unset or not a count); a main loop that ran another count
    # ran the script's own (torch.set_num_threads)
    threads_asked: int | None = None
    cuda: bool = False  # whether the script initialised CUDA
    deterministic: bool = False
    flor_seconds: float | None = None  # what flor's own work cost the script
    startup_s: float | None = None  # from the start to the main loop's first iteration
    captured: dict = field(default_factory=dict)  # block: the labels its checkpoints hold
    main_ended: bool = False  # whether the main loop ran until its iterable ended
    error: str | None = None  # what ended a failed run
    # The git version of the script's repository as the record started
    # (flor/codeversion.py): root, commit, branch, dirty, untracked, and
    # diff, the file in the run directory holding the diff against commit.
    code: dict | None = None
    # What the script parsed from its command line, defaults included, or
    # the config object it built (flor/config.py): {dotted key: value}
    config: dict | None = None
    config_parsed: bool = False  # whether it holds the command line's parse
    # What the user calls it (flor/runs.py `label`): a name unique in the
    # store, tags (`tags` above is the checkpoint header tags' version) and
    # a note
    name: str | None = None
    labels: list = field(default_factory=list)
    note: str | None = None

    @property
    def follower(self) -> bool:
        """A data-parallel rank other than 0 (listed under rank 0's run)."""
        return bool(self.rank)


@_given
@dataclass
class ReplayInfo(Info):
    """A replay: its plan's outline, and what its checks concluded."""

    nparts: int = 1
    mode: str | None = None  # how its parts ran: "serial", "local", "ray", "parts"...
    segments: list = field(default_factory=list)
    probed: list = field(default_factory=list)
    restarted: dict = field(default_factory=dict)  # part (a string): why it ran again
    forked: int | None = None  # local workers forked from the fork server (the rest spawned)
    checks_passed: bool | None = None  # None until the replay concluded
    compared: int | None = None
    mismatches: int | None = None
    missing: int | None = None
    name: str | None = None  # what the user calls it, as RecordInfo's
    labels: list = field(default_factory=list)
    note: str | None = None
    seconds: float | None = None  # the replay's own measure, from start to conclusion
    rerun_seconds: float | None = None  # what re-running the script would take (estimate.py)


@_given
@dataclass
class PartInfo(Info):
    """One part of a replay: what its worker restored and ran."""

    reexecuted: int = 0  # blocks whose checkpoints the edited script could not use
    threads: int | None = None
    main_seen: bool = False  # whether the recorded main loop ran in this part
    resumed_from: list | None = None  # [iteration, seconds] of the restore
    unverified: list = field(default_factory=list)  # restored, and not verified
    restored: list = field(default_factory=list)  # the labels of what it restored
    captured: dict = field(default_factory=dict)
    error: str | None = None


def run_info(kind: str, text: str | None) -> Info:
    """The info of a run of `kind` ("record" or "replay") from its column."""
    return (RecordInfo if kind == "record" else ReplayInfo).from_json(text)


def run_row(row) -> dict:
    """A row of runs, its JSON columns parsed: argv a list, versions a dict,
    info the typed object of the run's kind."""
    out = dict(row)
    out.update(argv=json.loads(out["argv"] or "[]"), versions=json.loads(out["versions"] or "{}"),
               info=run_info(out["kind"], out["info"]))
    return out


def encoded(fields: dict) -> dict:
    """Columns of runs as stored: info and versions as JSON."""
    out = dict(fields)
    if isinstance(out.get("info"), Info):
        out["info"] = out["info"].to_json()
    if isinstance(out.get("versions"), dict):
        out["versions"] = json.dumps(out["versions"])
    return out
