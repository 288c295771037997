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


def apply_quick(args, settings: dict) -> None:
    """With ``--quick``, each setting at most its quick value (a smaller one given stays); lists are
    replaced."""
    if not args.quick:
        return
    for key, value in settings.items():
        current = getattr(args, key)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, current))
        setattr(args, key, min(current, value) if numbers else value)


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
