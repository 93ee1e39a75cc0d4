"""What runs inside the user's script process (a record, or a replay worker);
docs/ARCHITECTURE.md names its modules."""
