"""What the experiments' command lines share: checked argument types, the common options, wording.

Every numeric option is parsed by one of the types below, so a bad value is an argparse usage error
(exit status 2, the usage and a one-line message), never a traceback; checks that need more than one
option or the data raise :class:`UsageError` from ``run``, which the command line turns into the same.
"""

from __future__ import annotations

import argparse
import math

from .._validate import MIN_LAM


class UsageError(Exception):
    """A bad combination of arguments found after parsing (e.g. a split the data set does not have)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where its help already says it or there is none to show
    (flags, and options whose None default the help explains)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return super()._get_help_string(action)


def _number(kind, text: str, what: str, ok) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_float_at_most(high: float):
    """An argparse type: a number in (0, ``high``]."""
    def parse(text: str) -> float:
        return _number(float, text, f"a number in (0, {high:g}]", lambda v: 0 < v <= high)
    return parse


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    what = {0: "an integer >= 0", 1: "a positive integer"}.get(low, f"an integer >= {low}")

    def parse(text: str) -> int:
        return _number(int, text, what, lambda v: v >= low)

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    return _number(float, text, "a positive number", lambda v: v > 0)


def nonnegative_float(text: str) -> float:
    return _number(float, text, "a number >= 0", lambda v: v >= 0)


def kivi_lam(text: str) -> float:
    """KIVI's ridge coefficient: the estimator's own range (kivi_fast._validate.MIN_LAM and above)."""
    return _number(float, text, f"a number >= {MIN_LAM:g} (KIVI's lam)", lambda v: v >= MIN_LAM)


def kivi_clip(text: str) -> float:
    """KIVI's lower clip of the density ratio, in (0, 1)."""
    return _number(float, text, "a number in (0, 1)", lambda v: 0 < v < 1)


# Seeds below 2**32 are numpy's range (np.random.seed, which Pyro's HMC calls), and the seeds the
# trainers derive from them (seed * 1000 + split, seed * 100_003 + cell, ...) stay within torch's 64 bits
# (grad-accuracy's larger products are taken modulo 2**64).
SEED_LIMIT = 2**32
MAX_THREADS = 1024  # torch.set_num_threads crashes the process (no exception) at 100000


def random_seed(text: str) -> int:
    """A random seed: an integer in [0, 2**32)."""
    return _number(int, text, f"an integer from 0 to {SEED_LIMIT - 1} (a seed)", lambda v: 0 <= v < SEED_LIMIT)


def thread_count(text: str) -> int:
    """Torch CPU threads: an integer in [1, MAX_THREADS]."""
    return _number(int, text, f"an integer from 1 to {MAX_THREADS} (CPU threads)", lambda v: 1 <= v <= MAX_THREADS)


def apply_quick(args, settings: dict) -> None:
    """With ``--quick``, each number setting at most its quick value (a smaller one given stays), and each
    other setting (a list, a choice) its quick value unless the user gave one, which wins.

    The options given are those the command line names (``args._given``, from ``cli.given_options``;
    args made another way name none, and the presets replace them). Numbers are capped instead: at most
    the quick value keeps a quick run quick whatever the command line says."""
    if not args.quick:
        return
    given = getattr(args, "_given", frozenset())
    for key, value in settings.items():
        current = getattr(args, key)
        if _is_number(current) and _is_number(value):
            setattr(args, key, min(current, value))
        elif key not in given:
            setattr(args, key, value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_prior_samples(option: str, n: int, methods: str) -> None:
    """Prior samples that kivi_fast.kl's Gaussian contrast fits (``methods``: what takes them): fewer than
    contrast.MIN_PRIOR_SAMPLES is a usage error naming the option, not a failure at the first step."""
    from ..contrast import MIN_PRIOR_SAMPLES

    if n < MIN_PRIOR_SAMPLES:
        raise UsageError(f"{option} {n}: {methods} (kivi_fast.kl's Gaussian contrast of the prior's samples) needs "
                         f"at least {MIN_PRIOR_SAMPLES} (the inverse of a variance fitted to fewer has no finite mean)")


def plural(n: int, word: str, words: str | None = None) -> str:
    """``plural(1, "split")`` -> "1 split", ``plural(3, "split")`` -> "3 splits"."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def add_common(parser: argparse.ArgumentParser, *, quick: str, name: str | None = None, out: bool = True,
               progress: str = "no progress bars") -> None:
    """The options every experiment has: ``--quick`` (what it does: ``quick``), ``--no-progress``,
    and, with ``out``, ``--out`` / ``--run-dir`` (run folders named ``name``-<time>)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--no-progress", action="store_true", help=progress)
    if out:
        parser.add_argument("--out", default="runs", help="root folder of the run folders")
        parser.add_argument("--run-dir", default=None,
                            help=f"write into (and resume from) this folder (default: OUT/{name}-<time>)")
