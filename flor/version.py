"""Flor's version (pyproject.toml holds the same)."""
__version__ = "0.2.0"
