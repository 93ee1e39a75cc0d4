"""What flor knows of the code of training libraries that run the training
loop themselves: which of the script's functions they call only outside
the block flor makes of an epoch's training (flor/lightning.py,
flor/huggingface.py), and
which libraries' training flor does not follow yet."""
from __future__ import annotations

__all__ = ["EPOCH_END", "unfollowed"]

# The hooks Lightning calls after an epoch's training and validation (or
# after the last epoch), and the callbacks' hooks the Hugging Face Trainer
# calls after an epoch's batches (flor/huggingface.py): a change only
# there, or in what only they call, leaves each epoch's training to be
# restored.
EPOCH_END = frozenset({"on_train_epoch_end", "on_train_end", "on_fit_end", "on_epoch_end"})

# Modules that a script imports only where a library runs its training loop
# (imported by the library's trainer itself), and what to call it.
_TRAINERS = {
    "transformers.trainer": "the Hugging Face Trainer (transformers before 5.3)",
    "keras.src.trainers.trainer": "Keras's Model.fit",
    "fastai.learner": "fastai's Learner",
    "xgboost.training": "XGBoost's train",
    "lightgbm.engine": "LightGBM's train",
}


def unfollowed(modules, followed=frozenset()) -> list[str]:
    """The training libraries among the imported `modules` (names) whose
    loops flor does not follow: all but those whose module is `followed`
    (the Hugging Face Trainer of transformers 5.3 and later)."""
    return [what for name, what in _TRAINERS.items() if name in modules and name not in followed]
