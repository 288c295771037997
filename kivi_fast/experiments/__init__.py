"""The paper's experiments, one module per subcommand of the ``kivi-fast`` command line
(:mod:`kivi_fast.cli`), and their helpers.

Commands (``kivi-fast <command>`` runs ``<command>.py``, with - as _): ``toy``, ``uci``, ``uci_batch``,
``uci_report``, ``uci_kl_probe``, ``blr``, ``reverse_ablation``, ``kl_accuracy``, ``boston_posterior``.
Each exposes ``add_arguments(parser)`` and ``run(args) -> int`` and writes its results (JSON), figures
(PNG) and checkpoints to a run folder made by :func:`kivi_fast.experiments.runs.run_folder`.

Helpers: ``runs`` (run folders, JSON, checkpoints that load without unpickling code), ``options``
(checked argument types and the options every command has), ``datasets`` (the UCI data sets and where
they are found), ``regression`` (the BNN-regression harness the uci commands share), ``hmc`` (ground
truth by HMC), ``sample_metrics`` (distances between sample sets).
"""
