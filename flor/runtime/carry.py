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
     "ord": n,            # the run's order counter at the end of the iteration
     "iteration": i}

A restore is verified: the state in scope after it must have the recorded
fingerprint, or the worker stops with FlorReplayError (and the replay
queue runs the segment again without it).
"""
from __future__ import annotations

from ..context import encode, iteration_key
from ..errors import FlorReplayError
from . import blockstate

__all__ = ["Carried", "payload", "ctx_of", "restore", "fingerprint"]


class Carried:
    """The manual API's carrier: the objects passed as ``state=``."""

    def __init__(self, objs):
        self.objs = tuple(objs)

    def capture(self, scope):
        """(objects, signature, rebind flags) to checkpoint."""
        return list(self.objs), blockstate.signature(self.objs), [False] * len(self.objs)

    def apply(self, saved, scope):
        """Restore the objects in place; nothing to rebind."""
        blockstate.apply(saved, list(self.objs), None, scope)
        return None


def fingerprint(scope, version=blockstate.FINGERPRINT) -> int:
    """Of the modules and optimizers in the scope of the loop's frame."""
    if scope is None:
        return 0
    return blockstate.fingerprint(blockstate.state_owners([], scope), version)


def ctx_of(loop: str, run: int, i: int) -> str:
    """The context of iteration i of the main loop (where its checkpoint is)."""
    return encode([["L", loop, run, i]])


def tag(loop: str, run: int, i: int) -> bytes:
    """The header tag of the checkpoint of iteration i."""
    return blockstate.tag(iteration_key(loop), ctx_of(loop, run, i), 0)


def payload(loop, run, i, objs, sig, fp, ord_) -> dict:
    out = blockstate.payload(iteration_key(loop), ctx_of(loop, run, i), 0, sig, objs)
    out.update(fingerprint=fp, ord=ord_, iteration=i)
    return out


def restore(saved, carrier, loop, run, i, scope, where):
    """Put the state carried out of iteration i back, from its checkpoint
    `saved` (named `where` in errors).  Returns what to rebind, or None."""
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
    values = carrier.apply(saved, scope)
    got = fingerprint(scope, blockstate.fingerprint_version(saved["fingerprint"]))
    if got != saved["fingerprint"]:
        raise FlorReplayError(
            f"{where}: the state restored from it does not have the fingerprint the record "
            f"computed at the end of iteration {i} (the loop carries state flor did not "
            "capture); it cannot be used")
    return values
