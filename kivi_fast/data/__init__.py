"""Data sets of the experiments, read from the project's ``data/`` folder (never from elsewhere)."""
