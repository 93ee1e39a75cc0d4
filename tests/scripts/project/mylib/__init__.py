"""A small training library of the project's own: the shape of a class-based
trainer kept outside the script."""
