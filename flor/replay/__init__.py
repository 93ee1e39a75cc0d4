"""The parent process of ``python -m flor replay``; docs/ARCHITECTURE.md names
its modules."""
