"""The Hugging Face Trainer: the epochs of ``Trainer.train`` as flor's main
loop.

The Trainer runs the training loop itself and offers no hook to skip an
epoch's batches or to add a callback to every Trainer, so in a flor record
or replay flor wraps five of its methods and one function once
``transformers.trainer`` is imported (runtime/effects.py puts them back at
the session's end):

- ``Trainer.__init__`` adds flor's callback, first among the Trainer's
  callbacks, through the Trainer's own ``add_callback``;
- ``Trainer._run_epoch`` (transformers 5: one epoch's batches, then the
  epoch-end hooks, logging and evaluation): each epoch is an iteration of a
  main loop, keyed by the line of the script that called ``train``, and
  its batches are a block that ends at the callback's ``on_epoch_end``;
  a replay that does not need them (no code that runs in them changed)
  does not run them, restores the block's checkpoint and runs what the
  Trainer does after them (``on_epoch_end``, then the epoch's logging,
  evaluation and saving) as it does;
- ``Trainer.train``: a training that raises leaves its block and main
  loop without checkpoints;
- ``Trainer._maybe_log_save_evaluate``: the gradient norm and learning
  rate it was last given, which the epoch's end logs;
- ``Trainer._save_checkpoint`` and ``transformers.trainer.rotate_checkpoints``:
  in a replay split among workers (which share the Trainer's output
  directory) a worker's rotation deletes only the checkpoint directories it
  saved itself, never one another worker saved or is writing.

What a checkpoint holds is what the Trainer's own resume restores: the
model (and its config), the optimizer and the LR scheduler (the ones
Accelerate wraps), the gradient scaler, ``TrainerState`` and
``TrainerControl``, the loss the Trainer has summed and not logged yet, and
the random state (the block's); besides, the values the callbacks keep in
their attributes (a history the script's callback appends to,
EarlyStoppingCallback's patience counter).
A replay worker whose segment starts at epoch a restores the iteration
checkpoint of epoch a - 1 when the first epoch begins and runs nothing of
the epochs before.  Outside a flor record or replay nothing is wrapped.
"""
from __future__ import annotations

import ast
import copy
import inspect
import os
import shutil
import textwrap

from .errors import FlorReplayError
from .libraries import EpochLoop, script_frame, session, set_values, values
from .runtime.blockstate import apply, set_rng_state, signature
from .runtime.effects import follower

__all__ = ["follow", "followed", "unfollowable"]

_KEY = "_flor_train"  # the Trainer's attribute that holds its _Train while it trains
_LAST = "_flor_last"  # (grad_norm, learning_rate) last given to _maybe_log_save_evaluate
# What the skip path passes on to the Trainer's epoch end (transformers 5).
_EPOCH_ARGS = ("model", "epoch", "trial", "ignore_keys_for_eval", "start_time")


def unfollowable(trainer_class) -> str | None:
    """Why flor cannot follow this Trainer's epochs, if it cannot: it needs
    transformers 5's ``_run_epoch`` and ``_maybe_log_save_evaluate``."""
    run_epoch = getattr(trainer_class, "_run_epoch", None)
    log = getattr(trainer_class, "_maybe_log_save_evaluate", None)
    if run_epoch is None or log is None:
        return "this transformers has no Trainer._run_epoch (flor follows transformers 5)"
    params = inspect.signature(run_epoch).parameters
    if not set(_EPOCH_ARGS) <= set(params):
        return "its Trainer._run_epoch takes other arguments than transformers 5's"
    return None


def followed(modules) -> set:
    """{"transformers.trainer"} when that module is among `modules` and its
    Trainer is one flor follows."""
    module = modules.get("transformers.trainer")
    trainer_class = getattr(module, "Trainer", None)
    return {"transformers.trainer"} if trainer_class and not unfollowable(trainer_class) else set()


def follow(module, patch):
    """Wrap the Trainer of `module` (transformers.trainer) with `patch(owner,
    name, make)` (runtime/effects.py), when flor can follow it.  Registered
    with the session's import hook when this module is imported."""
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None or unfollowable(trainer_class):
        return
    patch(trainer_class, "__init__", _init)
    patch(trainer_class, "train", _train)
    patch(trainer_class, "_run_epoch", _run_epoch)
    patch(trainer_class, "_maybe_log_save_evaluate", _log_save_evaluate)
    saved: set = set()  # the global steps this process saved a checkpoint at
    patch(trainer_class, "_save_checkpoint", lambda original: _saving(original, saved))
    patch(module, "rotate_checkpoints", lambda original: _rotating(original, saved))


def _split_replay() -> bool:
    """Whether this process is one of several replay workers (local, or
    run by a scheduler with ``--part``)."""
    s = session()
    plan = getattr(getattr(s, "policy", None), "plan", None)
    return bool(s is not None and s.replaying and len(getattr(plan, "segments", ())) > 1)


def _saving(original, saved):
    def _save_checkpoint(self, *args, **kwargs):
        saved.add(self.state.global_step)
        return original(self, *args, **kwargs)
    return _save_checkpoint


def _rotating(original, saved):
    """transformers' rule (keep at most ``save_total_limit`` checkpoints,
    the most recent and the best among them, deleting the oldest) over the
    checkpoints this worker saved: the others' belong to other workers,
    which may be writing them."""
    def rotate_checkpoints(*args, **kwargs):
        if not _split_replay():
            return original(*args, **kwargs)
        given = inspect.signature(original).bind(*args, **kwargs)
        given.apply_defaults()
        a = given.arguments
        limit = a.get("save_total_limit")
        if limit is None or limit <= 0:
            return None
        prefix = a.get("checkpoint_prefix", "checkpoint")
        own = [p for p in (os.path.join(a["output_dir"], f"{prefix}-{step}")
                           for step in sorted(saved)) if os.path.isdir(p)]
        best = a.get("best_model_checkpoint")
        protected = set(own[-1:]) | ({os.path.normpath(best)} if best else set())
        extra = len(own) - max(limit, len(protected))
        for path in own:
            if extra <= 0:
                break
            if os.path.normpath(path) not in protected:
                shutil.rmtree(path, ignore_errors=True)
                extra -= 1
        return None
    return rotate_checkpoints


def _init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if session() is not None and not any(isinstance(cb, _callback_class())
                                             for cb in self.callback_handler.callbacks):
            self.add_callback(_callback_class()(self))
            callbacks = self.callback_handler.callbacks
            callbacks.insert(0, callbacks.pop())  # our epoch-end hook runs before any other
    return __init__


def _train(original):
    def train(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            t = self.__dict__.pop(_KEY, None)
            if t is not None:
                t.abandon()
            raise
    return train


def _run_epoch(original):
    def run_epoch(self, *args, **kwargs):
        t = self.__dict__.get(_KEY)
        if t is None:
            return original(self, *args, **kwargs)
        return t.run_epoch(original, self, args, kwargs)
    return run_epoch


def _log_save_evaluate(original):
    def maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        learning_rate = kwargs.get("learning_rate", args[5] if len(args) > 5 else None)
        self.__dict__[_LAST] = (grad_norm, learning_rate)
        return original(self, tr_loss, grad_norm, *args, **kwargs)
    return maybe_log_save_evaluate


def _inner(obj):
    """The optimizer or scheduler Accelerate wraps (it delegates to it)."""
    if obj is not None and type(obj).__module__.startswith("accelerate."):
        return getattr(obj, "optimizer", None) or getattr(obj, "scheduler", obj)
    return obj


def _callbacks(trainer) -> list:
    """The Trainer's callbacks but flor's: the script's, and transformers'
    own (EarlyStoppingCallback's patience counter is one of its values)."""
    return [cb for cb in trainer.callback_handler.callbacks if type(cb).__module__ != __name__]


def _library(cls) -> bool:
    return cls.__module__.split(".")[0] in ("transformers", "accelerate", "builtins", "flor")


def _callback_values(cb) -> dict:
    return values(cb, own=not _library(type(cb)))


_assigned: dict = {}  # a Trainer subclass -> the attributes its own methods assign


def _own_attributes(trainer) -> dict:
    """What a Trainer subclass of the script keeps on the Trainer: the
    attributes its own methods assign (``self.batch_losses = []``)."""
    names = _assigned.get(type(trainer))
    if names is None:
        names = _assigned[type(trainer)] = set()
        for cls in type(trainer).__mro__:
            if _library(cls):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
            except (OSError, TypeError, SyntaxError):
                continue
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id == "self")
    own = values(trainer, own=True)
    return {k: v for k, v in own.items() if k in names}


class _TrainState:
    """The carrier of the main loop (flor/runtime/carry.py): what the
    Trainer's resume restores, as it is at the end of an epoch."""

    grads = False  # the Trainer steps the optimizer at an epoch's last batch

    def __init__(self, t):
        self.t = t

    def capture(self, scope):
        objs = self.t.objects(self.t.extra())
        return objs, signature(objs), [False] * len(objs)

    def labels(self, sig):
        return ["the model", "the optimizer", "the LR scheduler",
                *(["the model's config"] if len(sig) == 5 else []), "the Trainer's state"]

    def apply(self, saved, scope):
        """Restore in place; the objects returned (which the restore's
        verification digests) are the live ones, as the record captured
        them (a module a callback holds is live, not its state dict)."""
        out = apply(saved, self.t.objects({}), None, scope)
        # Put back again when the segment's first epoch begins (the
        # callbacks' on_epoch_begin of the epochs before it ran since).
        self.t.restored = (copy.deepcopy(out[-1]), saved["rng"])
        self.t.put_back(out[-1])
        return None, self.t.objects(self.t.extra())


class _Train(EpochLoop):
    """One ``Trainer.train``: its main loop, and the epoch block in it."""

    def __init__(self, s, trainer, frame):
        self.trainer = trainer
        self.begun = 0  # epochs the Trainer began
        self.restored = None  # (what put_back put back, the random state) at a segment's start
        super().__init__(s, frame, _TrainState(self))

    # -- what a checkpoint holds --------------------------------------------

    def objects(self, extra) -> list:
        """The model, optimizer, LR scheduler, the model's config (a model's
        forward may set it: ``problem_type``) and `extra`."""
        tr = self.trainer
        config = getattr(tr.model, "config", None)
        return [tr.model, _inner(tr.optimizer), _inner(tr.lr_scheduler),
                *([config] if config is not None else []), extra]

    def extra(self) -> dict:
        """What an epoch changes besides the model, optimizer and scheduler."""
        tr = self.trainer
        scaler = getattr(tr.accelerator, "scaler", None)
        return {"state": {k: v for k, v in vars(tr.state).items() if k != "stateful_callbacks"},
                "control": dict(vars(tr.control)),
                "tr_loss": tr._tr_loss, "total_loss": tr._total_loss_scalar,
                "last_logged": tr._globalstep_last_logged, "flos": tr.current_flos,
                "last": tr.__dict__.get(_LAST, (None, None)),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "callbacks": [_callback_values(cb) for cb in _callbacks(tr)],
                "trainer": _own_attributes(tr),
                "globals": self.held_globals()}

    def put_back(self, extra):
        tr = self.trainer
        for k, v in extra["state"].items():
            setattr(tr.state, k, v)
        for k, v in extra["control"].items():
            setattr(tr.control, k, v)
        tr._tr_loss, tr._total_loss_scalar = extra["tr_loss"], extra["total_loss"]
        tr._globalstep_last_logged, tr.current_flos = extra["last_logged"], extra["flos"]
        tr.__dict__[_LAST] = tuple(extra["last"])
        scaler = getattr(tr.accelerator, "scaler", None)
        if scaler is not None and extra["scaler"] is not None:
            scaler.load_state_dict(extra["scaler"])
        for cb, saved in zip(_callbacks(tr), extra["callbacks"]):
            set_values(cb, saved)
        set_values(tr, extra["trainer"])
        self.put_back_globals(extra["globals"])

    # -- the main loop --------------------------------------------------------

    def epoch_begin(self):
        """Our on_epoch_begin, before any other callback's.  At the first
        epoch (the optimizer, scheduler and state exist, every callback's
        on_train_begin ran) the main loop is entered at iteration 0, or, for
        a replay segment that starts later, at its first iteration after
        restoring the iteration checkpoint before it (put back again when
        that epoch begins: the callbacks' on_epoch_begin of the epochs
        before it ran since)."""
        epoch, self.begun = self.begun, self.begun + 1
        if epoch == 0:
            self.epoch = self.next()
            if self.epoch is not None and self.epoch > 0:
                # Until that epoch begins, what runs is not this process's work.
                self.resumed_at, self.s.discard = self.epoch, True
        elif self.epoch is not None and epoch > self.epoch:
            self.epoch = self.next()
        if self.epoch is not None and epoch < self.epoch:
            return  # (a resumed segment's epochs before its first)
        if self.epoch != epoch:  # (a replay of more epochs than the record ran)
            raise FlorReplayError(f"the Trainer began epoch {epoch}, and the main loop of the "
                                  f"training at {self.where} is at iteration {self.epoch}")
        if epoch == self.resumed_at:
            self.s.discard = False
            extra, rng = self.restored
            self.put_back(extra)
            set_rng_state(rng)

    def run_epoch(self, original, trainer, args, kwargs):
        epoch = self.begun - 1
        if self.epoch is None or epoch < self.epoch:
            return None  # the restored iteration checkpoint stands for it
        self.in_block = True
        if self.step_into():
            return original(trainer, *args, **kwargs)  # (the block ends at on_epoch_end)
        # Skipped: the epoch's end state from its checkpoint, then what the
        # Trainer does after the epoch's batches.
        self.in_block = False
        out = self.s.end(self.objects({}), self.frame, sig=self._sig(), as_list=True)
        self.put_back(out[-1])
        given = inspect.signature(original).bind(trainer, *args, **kwargs).arguments
        grad_norm, learning_rate = trainer.__dict__.get(_LAST, (None, None))
        trainer.control = trainer.callback_handler.on_epoch_end(trainer.args, trainer.state,
                                                                 trainer.control)
        trainer._maybe_log_save_evaluate(trainer._tr_loss, grad_norm,
                                         *(given[k] for k in _EPOCH_ARGS),
                                         learning_rate=learning_rate)
        return None

    def _sig(self):
        return signature(self.objects({}))

    def epoch_end(self):
        """Our on_epoch_end, before any other callback's: the block ends."""
        if not self.in_block:
            return
        self.in_block = False
        self.s.end(self.objects(self.extra()), self.frame, sig=self._sig(), as_list=True)



_classes: list = []


def _callback_class():
    """Flor's callback class (a transformers TrainerCallback), made once
    transformers is imported."""
    if not _classes:
        from transformers import TrainerCallback

        class Flor(TrainerCallback):
            """Flor's callback: the epochs of a training as the main loop (see
            flor.huggingface)."""

            def __init__(self, trainer):
                self.trainer = trainer

            def _train(self):
                return self.trainer.__dict__.get(_KEY)

            def on_train_begin(self, args, state, control, **kwargs):
                s = session()
                if s is not None and _KEY not in self.trainer.__dict__:
                    self.trainer.__dict__[_KEY] = _Train(s, self.trainer, script_frame(s, 2))

            def on_epoch_begin(self, args, state, control, **kwargs):
                if self._train() is not None:
                    self._train().epoch_begin()

            def on_epoch_end(self, args, state, control, **kwargs):
                if self._train() is not None:
                    self._train().epoch_end()

            def on_train_end(self, args, state, control, **kwargs):
                t = self.trainer.__dict__.pop(_KEY, None)
                if t is not None:
                    t.end()

        Flor.__module__ = __name__
        _classes.append(Flor)
    return _classes[0]


follower("transformers.trainer", follow)
