"""A run's seal: what replay takes from the run store as the record left
it, bound by an HMAC under the user's key (flor/trust.py).

Replay runs the recorded script with the recorded arguments, instruments it
from the recorded analysis, and compares the edited script with the
recorded sources.  Anyone who can write the store could change those (an
argument in flor.db, a ``source.py`` that hides a change), and replay would
follow.  So a record seals them: the run's ``seal`` file holds an
HMAC-SHA256, under the key that signs its checkpoints, of

    {"run": run id, "script": script name, "argv": [...],
     "main_loop": [main loop, its run],
     "files": {name: SHA-256 of the file, for source.py, instrumented.py,
               handsfree.json, handsfree-modules.json and modules/**}}

made again whenever one of them changes (the record's start, a flush that
stored a module's source or the main loop so far, its end), and replay
recomputes it before it plans: a seal that is missing or does not verify
is refused, naming the run and what replay would have trusted, unless
FLOR_TRUST_STORE=1 says to trust the store (a record made before flor
sealed runs, a store copied from another user); where no key is here to
verify it, replay says that it trusts the store.

A replay's plan, which its workers read from the store, is sealed the same
way (`seal_plan`, `check_plan`), with the compiled script saved beside it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

from . import trust
from .errors import FlorError

__all__ = ["SEAL_FILE", "TRUST_ENV", "seal_run", "check_run", "seal_plan", "check_plan",
           "Tampered"]

SEAL_FILE = "seal"
_RUN_CONTEXT = b"flor run v1\0"
_PLAN_CONTEXT = b"flor plan v1\0"
_FILES = ("source.py", "instrumented.py", "handsfree.json", "handsfree-modules.json")


class Tampered(FlorError):
    """What replay takes from the store is not what the record sealed."""


def _digest(path: str) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except FileNotFoundError:
        return None
    return h.hexdigest()


def _contents(layout, row) -> dict:
    """What the seal of the record `row` covers, read from the store now."""
    run_dir = layout.run_dir(row["run_id"])
    files = {name: _digest(os.path.join(run_dir, name)) for name in _FILES}
    base = os.path.join(run_dir, "modules")
    for dirpath, _, names in os.walk(base):
        for name in names:
            path = os.path.join(dirpath, name)
            files["modules/" + os.path.relpath(path, base).replace(os.sep, "/")] = _digest(path)
    return {"run": row["run_id"], "script": row["script_name"], "argv": list(row["argv"]),
            "main_loop": [row["main_loop"], row["main_run"]],
            "files": {k: v for k, v in sorted(files.items()) if v is not None}}


def _mac(key: bytes, context: bytes, data) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, context + text, hashlib.sha256).hexdigest()


def _key():
    """The user's key, or None where there is none or it cannot be used
    (record warns about an unusable key where it signs checkpoints)."""
    try:
        return trust.signing_key(create=False)
    except (OSError, FlorError):
        return None


def seal_run(store, run_id):
    """Seal the record `run_id` as the store holds it now (nothing without a key)."""
    key = _key()
    row = store.run(run_id)
    if key is None or row is None:
        return
    path = os.path.join(store.layout.run_dir(run_id), SEAL_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(_mac(key, _RUN_CONTEXT, _contents(store.layout, row)) + "\n")
    os.replace(path + ".tmp", path)


TRUST_ENV = "FLOR_TRUST_STORE"  # "1": replay a record its seal cannot vouch for, with a note


def check_run(store, row) -> str | None:
    """Verify the seal of the record `row`: None if it verifies, a note
    where no key is here to verify it (or FLOR_TRUST_STORE=1 says to trust
    the store); raises Tampered where it does not verify or is missing."""
    run_id = row["run_id"]
    trusted = os.environ.get(TRUST_ENV) == "1"
    try:
        with open(os.path.join(store.layout.run_dir(run_id), SEAL_FILE)) as f:
            sealed = f.read().strip()
    except FileNotFoundError:
        sealed = None
    key = _key()
    if key is None:
        return (f"no signing key here ({trust.key_path()}) to verify run {run_id}: replay "
                "trusts its arguments and sources as the store holds them")
    if sealed is not None and hmac.compare_digest(
            _mac(key, _RUN_CONTEXT, _contents(store.layout, row)), sealed):
        return None
    why = (f"run {run_id} has no seal (a record made before flor sealed runs, or its seal "
           "was removed)" if sealed is None else
           f"the seal of run {run_id} does not verify with your key: its arguments "
           f"({' '.join(row['argv'])!r}), main loop or stored sources (source.py, the "
           "instrumented script and analysis, modules/) changed after the record stored "
           "them, or another user's key sealed it (a copied store), or the record was killed "
           "while it stored them")
    if trusted:
        return f"{why}; {TRUST_ENV}=1: replay trusts the store as it holds them"
    raise Tampered(f"{why}. Replay would run what the store now says, so it refuses; if you "
                   f"trust this store, replay it with {TRUST_ENV}=1, or record the script "
                   "again")


def seal_plan(data: dict, code: bytes | None) -> dict:
    """`data` (a plan's JSON) with a seal over it and the compiled script
    `code` saved beside it (no seal without a key)."""
    key = _key()
    if key is None:
        return data
    body = dict(data, code=hashlib.sha256(code).hexdigest() if code is not None else None)
    return dict(data, seal=_mac(key, _PLAN_CONTEXT, body))


def check_plan(data: dict, code: bytes | None, path: str) -> dict:
    """The plan's JSON `data` read from `path` without its seal; raises
    Tampered where the seal is missing or does not verify (where no key is
    here the plan is taken as it is: workers on a machine without the key
    load checkpoints in safe mode anyway)."""
    data = dict(data)
    sealed = data.pop("seal", None)
    key = _key()
    if key is None:
        return data
    body = dict(data, code=hashlib.sha256(code).hexdigest() if code is not None else None)
    if sealed is None or not hmac.compare_digest(_mac(key, _PLAN_CONTEXT, body), sealed):
        raise Tampered(f"the replay plan {path} (or the compiled script beside it) changed "
                       "after the replay wrote it, and its seal does not verify with your key: "
                       "the worker refuses it")
    return data
