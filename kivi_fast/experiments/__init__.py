"""Experiments of the paper, each a subcommand of the ``kivi-fast`` command line (see ``kivi_fast.cli``).

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and writes its results (JSON),
figures (PNG) and checkpoints to a run folder made by :func:`kivi_fast.experiments.runs.run_folder`.
"""
