"""The ``kivi-fast`` command line: one subcommand per experiment (``kivi-fast --help`` lists them,
``kivi-fast <command> --help`` gives each option with its default).

Bad arguments are usage errors (exit status 2); a run that cannot go on for a reason the message
names (missing data, an unusable checkpoint, a folder it cannot write) exits with status 1, without a
traceback. So does an error that no check foresaw, in one line naming its type
(KIVI_FAST_TRACEBACK=1 gives its traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# set to 1 for the traceback of an error that no check foresaw (else one line, as for the others)
TRACEBACK_ENV = "KIVI_FAST_TRACEBACK"

# subcommand -> one-line help; each is the module kivi_fast.experiments.<name with - as _>
COMMANDS = {
    "toy": "1-D Gaussian mixture: KIVI implicit posterior vs. a Gaussian VI baseline (Sec. 5.1)",
    "uci": "BNN regression on the UCI benchmarks (Sec. 5.2.1, Table 1)",
    "uci-batch": "many uci splits in parallel, one single-threaded process per split",
    "uci-report": "collect uci run folders into results/uci/ and one table beside the paper",
    "uci-kl-probe": "what plain KIVI's weight-KL estimate sees and does on a UCI set (diagnostic)",
    "blr": "2-D Bayesian logistic regression: KIVI vs. factorized VI vs. HMC (App. F.1)",
    "reverse-ablation": "the reverse ratio trick: fit q to the prior with and without it",
    "kl-accuracy": "accuracy of the KL estimate against known KLs (Gaussians, a planar flow)",
    "grad-accuracy": "accuracy of the KL estimate's gradient against known gradients, per estimator choice",
    "boston-posterior": "parallel-coordinates picture of Boston posteriors and |mu|/sigma",
    "amortized": "amortized encoders vs. the exact posterior of a linear-Gaussian model (diagnostic)",
    "vae": "the VAE on statically binarized MNIST with an implicit encoder (Sec. 5.3)",
    "vae-ais": "test log-likelihood of trained vae runs by annealed importance sampling",
    "vae-report": "collect vae runs into results/vae/: curves of all methods, summary.json, a table",
    "mnist": "BNN classification on MNIST with MMNN implicit posteriors, BBB and PC baselines (Sec. 5.2.2)",
    "mnist-report": "collect mnist runs into results/mnist/: curves, summary.json, a table beside the paper",
    "client-loop": "a constant-learning-rate training loop over many seeds: how often KIVI ends on target",
}


def module_name(command: str) -> str:
    return "kivi_fast.experiments." + command.replace("-", "_")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from .experiments.options import HelpFormatter

    parser = argparse.ArgumentParser(prog="kivi-fast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparsers = {}
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(module_name(name))
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
        subparsers[name] = p
    return parser, subparsers


def given_options(command: str, argv) -> frozenset[str]:
    """The destinations of the options the command line names, whatever their values (--quick's presets
    give way to them: options.apply_quick). Parsed again with no defaults, so only those named are set."""
    _, probe = build_parser()
    sub = probe[command]
    for action in sub._actions:
        action.default = argparse.SUPPRESS
    words = list(argv)
    named = vars(sub.parse_args(words[words.index(command) + 1:]))
    return frozenset(k for k in named if not k.startswith("_"))


def main(argv=None) -> int:
    from .experiments.options import UsageError
    from .experiments import runs
    from .experiments.runs import RunError

    import torch

    import kivi_fast

    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    args._given = given_options(args.command, sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()  # the commands set their own (runs.begin): a caller gets its back
    try:
        kivi_fast.backend()
    except ValueError as err:  # (a bad KIVI_FAST_BACKEND)
        print(f"kivi-fast {args.command}: error: {err}", file=sys.stderr)
        return 1
    try:
        return int(args._run(args) or 0)
    except UsageError as err:
        subparsers[args.command].error(str(err))  # prints the usage, exits with status 2
    except RunError as err:
        code = getattr(err, "exit_code", 1)
        print(f"kivi-fast {args.command}: {'error: ' if code == 1 else ''}{err}", file=sys.stderr)
        return code
    except KeyboardInterrupt:  # outside a trainer's loop (which saves first: runs.Interrupted)
        print(f"kivi-fast {args.command}: interrupted; a run resumes from its last checkpoint when rerun",
              file=sys.stderr)
        return 130
    except OSError as err:  # a folder or file the run cannot read or write (permissions, a file in the way, a full disk)
        where = f": {err.filename}" if err.filename else ""
        print(f"kivi-fast {args.command}: error: {err.strerror or err}{where}", file=sys.stderr)
        return 1
    except Exception as err:  # what no check foresaw (a size this machine cannot hold, damaged run files)
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        print(f"kivi-fast {args.command}: error: {type(err).__name__}: {first} (unforeseen; {TRACEBACK_ENV}=1 "
              "shows where)", file=sys.stderr)
        return 1
    finally:
        runs.release_run_folders()  # (a caller's next command, or another process, may take them)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
