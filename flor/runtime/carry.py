"""What the main loop carries from one iteration into the next, and its
iteration checkpoints.

At the end of a main-loop iteration the record may checkpoint the state the
loop carries (the adaptive rule decides, as for blocks).  A replay worker
whose segment starts just after a checkpointed iteration restores it and
starts there, instead of pseudoresuming every earlier iteration; so does
``record --resume``.  What is carried comes from a *carrier*:

- manual API: ``flor.generator(range(n), state=(model, optimizer, ...))``,
  restored in place (`Carried` below);
- hands-free: the main loop body's side-effect set from the static analysis,
  read from the loop's frame (flor/runtime/handsfree.py), with the names it
  rebinds handed back to the body's first statement.

An iteration checkpoint is a block checkpoint (flor/runtime/blockstate.py)
of the block ``iteration_key(loop)`` at the context of the iteration, plus

    {"fingerprint": ...,  # of the modules and optimizers in the loop's scope
     "carried": [...],    # the digest of each carried object (flor/runtime/digest.py),
                          # None where it has none
     "carried_version": v,  # of those digests (absent: version 1)
     "ord": n,            # the run's order counter at the end of the iteration
     "iteration": i,
     "named": b}          # whether "sig" holds the script's names (hands-free), not
                          # types (absent: a record made before flor said)

A restore is verified: the state in scope after it must have the recorded
fingerprint, and every object put back (in place or to rebind) its
recorded digest, or the worker stops with FlorReplayError (and the replay
queue runs the segment again from its start, without the checkpoint).
What could not be verified (an object with no digest, a record that took
none) is returned, for the worker to say so.
"""
from __future__ import annotations

from ..context import encode, iteration_key
from ..errors import FlorReplayError, note
from . import blockstate, digest

__all__ = ["Carried", "payload", "ctx_of", "restore", "resume_at", "fingerprint", "digests"]


class Carried:
    """The manual API's carrier: the objects passed as ``state=``."""

    #: Whether an iteration checkpoint holds the parameters' gradients: the
    #: manual API's loops are found from the script's source instead
    #: (Recording.grad_loops), as its blocks are.
    grads = False
    #: Its signature is the objects' types, not names: flor.checkpoint keys
    #: them by position.
    named = False

    def __init__(self, objs):
        self.objs = tuple(objs)

    def capture(self, scope):
        """(objects, signature, rebind flags) to checkpoint."""
        return list(self.objs), blockstate.signature(self.objs), [False] * len(self.objs)

    def labels(self, sig) -> list[str]:
        """How errors name the objects."""
        return [f"state[{i}] (a {label.rsplit('.', 1)[-1]})" for i, label in enumerate(sig)]

    def apply(self, saved, scope):
        """Restore the objects in place: (nothing to rebind, the restored objects)."""
        return None, blockstate.apply(saved, list(self.objs), None, scope)


def fingerprint(scope, version=blockstate.FINGERPRINT) -> int:
    """Of the modules and optimizers in the scope of the loop's frame."""
    if scope is None:
        return 0
    return blockstate.fingerprint(blockstate.state_owners([], scope), version)


def _covered(scope) -> set:
    """The tensors the fingerprint of the loop's scope reads."""
    return digest.covered(blockstate.state_owners([], scope) if scope is not None else [])


def digests(objs, scope, version=digest.VERSION) -> list:
    """The digest of each of `objs` (None where it has none); the tensors of
    the modules and optimizers in scope count by shape only, as their
    fingerprint covers them."""
    skip = _covered(scope)
    out = []
    for o in objs:
        try:
            out.append(digest.digest(o, skip, version))
        except digest.Opaque:
            out.append(None)
    return out


def _unverified(objs, scope, sig, recorded, version) -> tuple[list, list]:
    """(labels whose restored state differs from the record's digests of
    `version`, labels that could not be verified, with why)."""
    if recorded is None:
        return [], [f"{label} (the record took no digest of it)" for label in sig]
    if version not in digest.VERSIONS:
        return [], [f"{label} (the record's digests are of version {version}, which this "
                     "flor does not make)" for label in sig]
    skip = _covered(scope)
    differ, unverified = [], []
    for label, o, want in zip(sig, objs, recorded):
        try:
            got = digest.digest(o, skip, version)
        except digest.Opaque as e:
            unverified.append(f"{label} ({e}: flor cannot digest it)")
            continue
        if want is None:
            unverified.append(f"{label} (the record could not digest it)")
        elif got != want:
            differ.append(label)
    return differ, unverified


def ctx_of(loop: str, run: int, i: int) -> str:
    """The context of iteration i of the main loop (where its checkpoint is)."""
    return encode([["L", loop, run, i]])


def tag(loop: str, run: int, i: int) -> bytes:
    """The header tag of the checkpoint of iteration i."""
    return blockstate.tag(iteration_key(loop), ctx_of(loop, run, i), 0)


def payload(loop, run, i, objs, sig, fp, ord_, carried, version=digest.VERSION,
            grads=None, named=False) -> dict:
    """The iteration checkpoint of iteration i (`carried`: the digests of
    `objs`, of `version`; `grads`: the gradients of their parameters, where
    the next iteration reads them; `named`: whether `sig` holds the script's
    names for `objs`, as a hands-free carrier's does, rather than types)."""
    out = blockstate.payload(iteration_key(loop), ctx_of(loop, run, i), 0, sig, objs, grads)
    out.update(fingerprint=fp, carried=carried, carried_version=version, ord=ord_,
               iteration=i, named=bool(named))
    return out


def restore(saved, carrier, loop, run, i, scope, where):
    """Put the state carried out of iteration i back, from its checkpoint
    `saved` (named `where` in errors), and verify it.  Returns (what to
    rebind or None, the labels of what could not be verified)."""
    if not blockstate.belongs(saved, iteration_key(loop), ctx_of(loop, run, i), 0):
        raise FlorReplayError(f"{where} is not the checkpoint of iteration {i} of the loop "
                              f"at {loop}")
    _, sig, _ = carrier.capture(scope)
    unheld = blockstate.unheld(sig)
    if unheld:  # a record made before flor told these apart
        raise FlorReplayError(f"{where}: the loop at {loop} carries what no checkpoint holds "
                              f"({'; '.join(unheld)}): it cannot be used")
    if sig != saved["sig"]:
        raise FlorReplayError(f"{where} holds {saved['sig']}, and the loop at {loop} now "
                              f"carries {sig}: the program changed; it cannot be used")
    values, objs = carrier.apply(saved, scope)
    if values is not None:  # as the body will see it, with the names it rebinds
        scope = carrier.scope_after(values, scope)
    got = fingerprint(scope, blockstate.fingerprint_version(saved["fingerprint"]))
    if got != saved["fingerprint"]:
        raise FlorReplayError(
            f"{where}: the state restored from it does not have the fingerprint the record "
            f"computed at the end of iteration {i} (the loop carries state flor did not "
            "capture); it cannot be used")
    differ, unverified = _unverified(objs, scope, carrier.labels(sig), saved.get("carried"),
                                     saved.get("carried_version", 1))
    if differ:
        raise FlorReplayError(
            f"{where}: what it put back differs from what the record had at the end of "
            f"iteration {i}: {', '.join(differ)} (the checkpoint does not hold all of their "
            "state); it cannot be used")
    return values, unverified


def resume_at(context, it, frame, carrier, start, read, where):
    """Start the main loop `frame` at iteration `start` from the iteration
    checkpoint of start - 1 (a replay segment, or ``record --resume``):
    draw (and drop) the loop's items before it from `it`, read the
    checkpoint (``read(tag)``), restore and verify it.  Returns the names
    to rebind for the body's first statement (or None), the labels of what
    it put back and of what it could not verify."""
    loop, run = frame[1], frame[2]
    for i in range(start):
        context.set_index(frame, i)
        try:
            next(it)
        except StopIteration:
            raise FlorReplayError(f"the main loop at {loop} ended after {i} iterations; "
                                  f"its iteration checkpoint is of iteration {start - 1}") from None
    saved = read(tag(loop, run, start - 1))
    values, unverified = restore(saved, carrier, loop, run, start - 1, frame.scope, where)
    if unverified:
        note(f"{where}: restored without verifying {'; '.join(unverified)}")
    return values, carrier.labels(saved["sig"]), unverified
