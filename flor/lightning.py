"""PyTorch Lightning: the epochs of ``Trainer.fit`` as flor's main loop.

Lightning runs the training loop itself, so flor follows it through a
callback, through Lightning's public hooks:

- each epoch is an iteration of a main loop (keyed by the line of the
  script that called ``fit``); at its end the record may checkpoint what
  Lightning itself saves to resume (module, optimizers, LR schedulers,
  loop progress, callbacks' state, precision plugin) with the random
  state, and a replay worker whose segment starts at epoch a restores the
  checkpoint of epoch a - 1 through Lightning's own resume;
- an epoch's training and validation is a block: a replay that does not
  need them (no code that runs in them was changed) skips the epoch's
  batches (``on_train_batch_start`` returning -1, as Lightning documents)
  and restores the block's checkpoint before the epoch-end hooks run, so
  that a probe in ``on_train_epoch_end`` sees the trained state.

In a hands-free record or replay (``python -m flor record train.py``) the
callback is added to every Trainer through Lightning's entry point for
external callbacks; ``callbacks=[flor.lightning.Flor()]`` adds it
explicitly (the manual API: ``python train.py`` records).  Outside a flor
record or replay it does nothing.
"""
from __future__ import annotations

import os
import shutil

from .errors import FlorReplayError
from .libraries import EpochLoop, script_frame
from .libraries import session as _session
from .libraries import set_values
from .libraries import values as _values
from .runtime.blockstate import UNHELD, apply, signature
from .runtime.session import Inert, Session

__all__ = ["Flor", "callbacks"]


class _FitState:
    """The carrier of the main loop (flor/runtime/carry.py): the module,
    and Lightning's checkpoint of the rest, with the loops' progress as it
    was at the end of the epoch (Lightning resumes from that point)."""

    grads = False  # Lightning steps the optimizer at an epoch's last batch

    def __init__(self, fit):
        self.fit = fit

    def capture(self, scope):
        fit = self.fit
        why = _not_resumable(fit.trainer)
        if why:  # never checkpointed: replay workers pseudoresume the epochs before theirs
            objs = [fit.module, {}]
            return objs, signature(objs) + [f"{why}, {UNHELD}"], [False, False]
        rest = fit.connector.dump_checkpoint(weights_only=False)
        rest.pop("state_dict", None)
        if fit.loops_at_end is not None:
            rest["loops"] = dict(rest["loops"], fit_loop=fit.loops_at_end)
        rest["flor_module_attrs"] = _module_attrs(fit.module)
        rest["flor_callback_values"] = _callback_values(fit.trainer)
        rest["flor_globals"] = fit.held_globals()
        objs = [fit.module, rest]
        return objs, signature(objs), [False, False]

    def labels(self, sig):
        return ["the LightningModule", "Lightning's checkpoint of the trainer"]

    def apply(self, saved, scope):
        fit = self.fit
        live = {}
        out = apply(saved, [fit.module, live], None, scope)
        checkpoint = dict(out[1])
        fit.attrs = (checkpoint.pop("flor_module_attrs"), checkpoint.pop("flor_callback_values"),
                     checkpoint.pop("flor_globals"))
        fit.put_back()  # (and again once the sanity check ran)
        checkpoint["state_dict"] = fit.module.state_dict()
        fit.connector._loaded_checkpoint = checkpoint  # Lightning restores it next
        return None, out


def _not_resumable(trainer) -> str | None:
    """Why Lightning's resume from an epoch's end would not continue as the
    record did, if it would not: a fit by max_steps resumes with one more
    batch of the finished epoch; persistent DataLoader workers keep a
    random state of their own across epochs."""
    if trainer.max_steps != -1:
        return "Lightning's progress in a fit by max_steps"
    if _persistent_workers(trainer):
        return "the random state of the DataLoader's persistent workers"
    return None


def _persistent_workers(trainer) -> bool:
    """Whether the training DataLoader's worker processes live across
    epochs: their random state (a random augmentation's) is in no
    checkpoint, and an epoch restored instead of run leaves it behind."""
    return any(getattr(loader, "persistent_workers", False) and loader.num_workers > 0
               for loader in _loaders(trainer.train_dataloader))


def _loaders(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _loaders(v)]
    return [] if value is None else [value]


class _Fit(EpochLoop):
    """One ``Trainer.fit``: its main loop, and the epoch block in it."""

    def __init__(self, s, trainer, module, frame):
        self.trainer, self.module = trainer, module
        self.connector = trainer._checkpoint_connector
        self.loops_at_end = None
        self.attrs = None  # the module's attributes a resume put back
        self.discarded = False
        self.skipping = False
        super().__init__(s, frame, _FitState(self))

    def put_back(self):
        """The attributes of the module and of the script's callbacks, and
        the script's globals, that a resume restores besides Lightning's own
        checkpoint."""
        if self.attrs is not None:
            _set_module_attrs(self.module, self.attrs[0])
            _set_callback_values(self.trainer, self.attrs[1])
            self.put_back_globals(self.attrs[2])

    def first(self):
        """Enter the main loop: at iteration 0, or, for a replay segment
        that starts later, at its first iteration after restoring the
        iteration checkpoint before it (Lightning resumes from it)."""
        self.epoch = self.next()
        if self.epoch is not None and self.epoch > 0:
            # Until that epoch starts, what runs is not this process's work.
            self.resumed_at, self.s.discard = self.epoch, True

    def epoch_start(self, epoch):
        s = self.s
        if self.epoch is not None and epoch < self.epoch:
            return  # (a resume's set-up, before the restored epoch)
        if self.epoch is None or epoch > self.epoch:
            self.epoch = self.next()
        if self.epoch != epoch:  # (a replay of more epochs than the record ran)
            raise FlorReplayError(f"Lightning started epoch {epoch}, and the main loop of the "
                                  f"fit at {self.where} is at iteration {self.epoch}")
        if epoch == self.resumed_at:
            s.discard = False
        self.in_block = True
        if not self.step_into():
            # What the epoch's hooks print until the block's end is the
            # record's, which replay shows from the store.
            self.skipping, self.discarded, s.discard = True, s.discard, True
            self.module.on_train_batch_start = _skip_rest_of_epoch

    def epoch_end(self):
        """Our on_train_epoch_end, before the module's and the others':
        close the block, restoring it if it was skipped."""
        self.loops_at_end = self.trainer.fit_loop.state_dict()
        if not self.in_block:
            return
        self.in_block = False
        skipped = self.skipping
        if skipped:
            self._unskip()
        trainer = self.trainer
        # A skipped epoch's restore fills a fresh dict: the live one shares
        # tensors with what Lightning holds (a callback's best score is a
        # logged metric), which a restore in place would overwrite.
        extra = {} if skipped else dict(_extra(trainer), globals=self.held_globals())
        objs = [self.module, *trainer.optimizers, *_schedulers(trainer), extra]
        sig = signature(objs)
        if _persistent_workers(trainer):  # an epoch's restore would not reach them
            sig.append(f"the random state of the DataLoader's persistent workers, {UNHELD}")
        out = self.s.end(objs, self.frame, sig=sig, as_list=True)
        if skipped:
            _apply_extra(trainer, out[-1])
            self.put_back_globals(out[-1]["globals"])
        self.loops_at_end = self.trainer.fit_loop.state_dict()

    def _unskip(self):
        self.skipping = False
        self.s.discard = self.discarded
        self.module.__dict__.pop("on_train_batch_start", None)

    def left(self):
        if self.skipping:
            self._unskip()


def _skip_rest_of_epoch(batch, batch_idx):
    return -1


def _schedulers(trainer):
    return [config.scheduler for config in trainer.lr_scheduler_configs]


def _module_attrs(module) -> dict:
    """What the LightningModule holds that its state dict leaves out and
    training changes: its own values, and the state of its torchmetrics
    metrics (kept out of state dicts) by submodule."""
    metrics = {name: {"state": dict(m.metric_state), "updates": m._update_count}
               for name, m in module.named_modules()
               if hasattr(m, "metric_state") and hasattr(m, "_update_count")}
    return {"values": _values(module), "metrics": metrics}


def _set_module_attrs(module, attrs):
    set_values(module, attrs["values"])
    for name, saved in attrs["metrics"].items():
        m = module.get_submodule(name)
        for k, v in saved["state"].items():
            setattr(m, k, v)
        m._update_count = saved["updates"]
        m._computed = None


def _user_callbacks(trainer) -> list:
    """The script's own callbacks that keep their state in attributes,
    not in a state_dict Lightning saves (a history a callback appends to)."""
    return [cb for cb in trainer.callbacks if type(cb).__module__ == "__main__"
            and not cb.state_dict()]


def _callback_values(trainer) -> dict:
    return {cb.state_key: _values(cb) for cb in _user_callbacks(trainer)}


def _set_callback_values(trainer, values):
    for cb in _user_callbacks(trainer):
        set_values(cb, values.get(cb.state_key, {}))


def _extra(trainer) -> dict:
    """What an epoch changes besides the module, optimizers and schedulers:
    the module's own attributes, the loops' progress, the callbacks' state,
    the metrics logged so far, and whether a callback asked training to
    stop."""
    conn = trainer._logger_connector
    return {"module_attrs": _module_attrs(trainer.lightning_module),
            "loops": trainer.fit_loop.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks
                          if cb.state_dict()},
            "callback_values": _callback_values(trainer),
            "callback_metrics": _numbers(trainer.callback_metrics),
            "logged_metrics": _numbers(conn.logged_metrics),
            "progress_bar_metrics": _numbers(conn.progress_bar_metrics),
            "should_stop": trainer.should_stop,
            "epoch_log": _numbers(trainer._results.metrics(False)["log"]) if trainer._results
            else {}}


def _load_progress(loop, state, prefix=""):
    """The progress of `loop` and its children from `state` (a loop's
    state_dict), without what Loop.load_state_dict adds for a resume: it
    marks every loop as restarting, and a fit by max_steps stays so."""
    loop._load_from_state_dict(state.copy(), prefix)
    for name, child in vars(loop).items():
        if hasattr(child, "_load_from_state_dict") and hasattr(child, "on_iteration_done"):
            _load_progress(child, state, prefix + name + ".")


def _numbers(metrics) -> dict:
    """Logged metrics as (number, dtype) pairs: what a block's fingerprint
    covers is its training state, not what was logged (a hindsight
    ``self.log`` adds a key), and a number restores a 0-d tensor exactly."""
    import torch

    return {k: (v.item(), str(v.dtype).rsplit(".", 1)[-1])
            if isinstance(v, torch.Tensor) and v.dim() == 0 else v for k, v in metrics.items()}


def _tensors(metrics) -> dict:
    import torch

    return {k: torch.tensor(v[0], dtype=getattr(torch, v[1])) if isinstance(v, tuple) else v
            for k, v in metrics.items()}


def _apply_extra(trainer, extra):
    _set_module_attrs(trainer.lightning_module, extra["module_attrs"])
    loop = trainer.fit_loop
    _load_progress(loop, extra["loops"])
    _set_callback_values(trainer, extra["callback_values"])
    states = extra["callbacks"]
    _move_callbacks(trainer, states)
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    conn = trainer._logger_connector
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        live = getattr(conn, "_" + name)
        live.clear()
        live.update(_tensors(extra[name]))
    trainer.should_stop = extra["should_stop"]
    # What the epoch logged with on_epoch=True, which Lightning hands its
    # loggers after the epoch-end hooks (at the step before, as it does):
    # the skipped batches logged nothing for it to hand them.
    if extra["epoch_log"]:
        loop.epoch_loop._batches_that_stepped -= 1
        try:
            conn.log_metrics(_tensors(extra["epoch_log"]))
        finally:
            loop.epoch_loop._batches_that_stepped += 1


def _move_callbacks(trainer, states):
    for cb in trainer.callbacks:
        if cb.state_key in states:
            states[cb.state_key] = _moved(states[cb.state_key], getattr(cb, "dirpath", None))


def _moved(state, dirpath):
    """A callback's state from the record, with the paths under the
    directory it wrote to (a ModelCheckpoint's, in the record's logger
    version) moved to the directory it writes to now (this run's).  A file
    it names that this run has not written (its epoch was restored, or ran
    in another worker) is copied there from the record's directory, as a
    plain run would have it: `trainer.test(ckpt_path="best")` finds it."""
    old = state.get("dirpath") if isinstance(state, dict) else None
    if not (isinstance(old, str) and isinstance(dirpath, str)) or old == dirpath:
        return state

    def move(v):
        if isinstance(v, str) and (v == old or v.startswith(old + os.sep)):
            new = dirpath + v[len(old):]
            if v != old and os.path.isfile(v) and not os.path.exists(new):
                os.makedirs(os.path.dirname(new), exist_ok=True)
                shutil.copyfile(v, new)
            return new
        if isinstance(v, dict):
            return {move(k): move(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(move(x) for x in v)
        return v

    return move(state)


def _make(base):
    class Flor(base):
        """Flor's callback: epochs as the main loop, each epoch's training a
        block (see flor.lightning)."""

        def __init__(self):
            super().__init__()
            self._fit = None
            self._added = False  # by the entry point, not by the script

        def setup(self, trainer, pl_module, stage):
            if stage != "fit" or self._fit is not None:
                return
            # The script's own Flor() records as the manual API does (a
            # plain `python train.py`); the one flor adds never starts a record.
            s = _session() if self._added else Session.get()
            if s is None or isinstance(s, Inert):
                return
            if any(isinstance(cb, Flor) and cb is not self and cb._fit is not None
                   for cb in trainer.callbacks):
                return  # (the script's, and the one flor added)
            cbs = trainer.callbacks
            cbs.remove(self)
            cbs.insert(0, self)  # our epoch-end hook runs before any other
            self._fit = _Fit(s, trainer, pl_module, script_frame(s))
            self._fit.first()

        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            # Lightning resumes from flor's iteration checkpoint: the
            # callbacks' paths are moved to where they write now.
            if self._fit is not None:
                _move_callbacks(trainer, checkpoint.get("callbacks", {}))

        def on_train_start(self, trainer, pl_module):
            # A resumed segment: Lightning's sanity check ran the validation
            # hooks since the restore
            if self._fit is not None:
                self._fit.put_back()

        def on_train_epoch_start(self, trainer, pl_module):
            if self._fit is not None:
                self._fit.epoch_start(trainer.current_epoch)

        def on_train_epoch_end(self, trainer, pl_module):
            if self._fit is not None:
                self._fit.epoch_end()

        def on_train_end(self, trainer, pl_module):
            if self._fit is not None:
                fit, self._fit = self._fit, None
                fit.end()

        def on_exception(self, trainer, pl_module, exception):
            if self._fit is not None:
                fit, self._fit = self._fit, None
                fit.abandon()

    Flor.__qualname__ = Flor.__name__ = "Flor"
    Flor.__module__ = __name__
    return Flor


_classes: dict = {}


def _flor_class(package: str):
    """Flor's callback class for `package` (lightning.pytorch or
    pytorch_lightning: each Trainer takes only its own package's callbacks)."""
    if package not in _classes:
        import importlib

        _classes[package] = _make(importlib.import_module(package).Callback)
    return _classes[package]


def __getattr__(name):
    if name == "Flor":
        return _flor_class("lightning.pytorch")
    raise AttributeError(name)


def _callbacks_for(package):
    if _session() is None:
        return []
    cb = _flor_class(package)()
    cb._added = True
    return [cb]


def callbacks():
    """Lightning's entry point for external callbacks: Flor's, in a flor
    record or replay; none otherwise."""
    return _callbacks_for("lightning.pytorch")


def pytorch_lightning_callbacks():
    """The same for the ``pytorch_lightning`` package."""
    return _callbacks_for("pytorch_lightning")
