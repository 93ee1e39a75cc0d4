"""Pure functions of source text: what a program does and what changed in it;
docs/ARCHITECTURE.md names its modules."""
