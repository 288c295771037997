"""The ``kivi-fast`` command line: one subcommand per experiment (``kivi-fast --help`` lists them)."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under kivi_fast.experiments, one-line help)
COMMANDS = {
    "toy": ("toy_mixture", "1-D Gaussian mixture: KIVI implicit posterior vs. a Gaussian VI baseline (Sec. 5.1)"),
    "uci": ("uci", "BNN regression on the UCI benchmarks (Sec. 5.2.1, Table 1)"),
    "uci-batch": ("uci_batch", "many uci splits in parallel, one single-threaded process per split"),
    "uci-report": ("uci_report", "collect uci run folders into results/uci/ and one table beside the paper"),
    "uci-kl-probe": ("uci_kl_probe", "what plain KIVI's weight-KL estimate sees and does on a UCI set (diagnostic)"),
    "blr": ("logistic2d", "2-D Bayesian logistic regression: KIVI vs. factorized VI vs. HMC (App. F.1)"),
    "reverse-ablation": ("reverse_ablation", "the reverse ratio trick: fit q to the prior with and without it"),
    "kl-accuracy": ("kl_accuracy", "accuracy of the KL estimate against known KLs (Gaussians, a planar flow)"),
    "boston-posterior": ("boston_posterior", "parallel-coordinates picture of Boston posteriors and |mu|/sigma"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kivi-fast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(f"kivi_fast.experiments.{module_name}")
        except ModuleNotFoundError as err:
            if err.name != f"kivi_fast.experiments.{module_name}":
                raise
            p.set_defaults(_missing=module_name)
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        parser.error(f"the experiment {args.command!r} is not available in this version")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
