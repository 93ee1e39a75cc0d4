"""The project's training library."""
from .trainer import Trainer

__all__ = ["Trainer"]
