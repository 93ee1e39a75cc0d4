"""What flor knows of the code of training libraries that run the training
loop themselves: which of the script's functions they call only outside
the block flor makes of an epoch's training (flor/lightning.py)."""
from __future__ import annotations

__all__ = ["LIGHTNING_EPOCH_END"]

# The hooks Lightning calls after an epoch's training and validation (or
# after the last epoch): a change only there, or in what only they call,
# leaves each epoch's training to be restored.
LIGHTNING_EPOCH_END = frozenset({"on_train_epoch_end", "on_train_end", "on_fit_end"})
