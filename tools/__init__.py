"""Command-line tools for looking at runs and checkpoints (a package so data/ scripts can import tools.cli)."""
