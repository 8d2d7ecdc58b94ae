"""What every ``kvboost-rag`` subcommand shares: argument types that reject bad values with one line, the
one-line error policy, and one way to print a speedup. Nothing heavy is imported here (``--help`` is fast).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from kvboost_rag.app.fmt import speedup

REPAIRS = ("none", "selective", "cacheblend", "full")  # kvboost_core.config.REPAIRS, without importing it


class UserError(Exception):
    """A mistake in the command line or its inputs: reported as one ``error:`` line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump): ``kvboost-rag: error: ...`` and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------------------------------- arg types
def _number(name: str, parse: Callable[[str], Any], lo: float, hi: float | None, expect: str,
            bound: str) -> Callable[[str], Any]:
    """An argparse type: ``parse`` the text, then require lo <= value (<= hi); NaN fails every comparison."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expect}, got {text!r}") from None
        if not (value >= lo and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    convert.__name__ = name
    return convert


positive_int = _number("positive_int", int, 1, None, "a positive integer", ">= 1")
nonnegative_int = _number("nonnegative_int", int, 0, None, "an integer >= 0", ">= 0")
ratio = _number("ratio", float, 0.0, 1.0, "a number in [0, 1]", "in [0, 1]")
nonnegative_float = _number("nonnegative_float", float, 0.0, None, "a number >= 0", ">= 0")


STORE_FORMS = "memory | disk:PATH[?max_bytes=20GiB] | redis://HOST:PORT/DB[?ttl=SECONDS]"


def store_spec(text: str) -> str:
    """A single tier spec (the same forms kvboost_core.store.factory accepts)."""
    if text == "memory" or (text.startswith("disk:") and len(text) > len("disk:")) \
            or text.startswith(("redis://", "rediss://")):
        return text
    raise argparse.ArgumentTypeError(f"unsupported store {text!r}; use {STORE_FORMS}")


def repairs_list(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in REPAIRS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown repair mode(s) {bad or [text]}; choose from {', '.join(REPAIRS)}")
    return names


# ---------------------------------------------------------------------------------------------- output
def format_speedup(full_s: float, reuse_s: float) -> str:
    """The one way the CLI prints a TTFT speedup: full-prefill time over reuse time, "N.NNx faster", or
    "N.NNx slower" when reuse took longer (:func:`kvboost_rag.app.fmt.speedup`; it printed "0.86x faster");
    "n/a" when either time is missing."""
    if not all(math.isfinite(t) and t > 0 for t in (full_s, reuse_s)):
        return "n/a"
    return speedup(full_s, reuse_s)


def fidelity_table(summary: dict[str, dict[str, float]]) -> str:
    """``FidelityReport.summary()`` as a table whose speedup column reads like the demo's (full/reuse)."""
    head = (f"{'repair':<12}{'prompts':>8}{'max|Δlogit|':>13}{'mean KL':>11}{'top-1':>8}{'greedy':>8}"
            f"{'reuse':>8}{'recomp':>8}{'TTFT speedup':>15}")
    lines = [head, "-" * len(head)]
    for repair, s in summary.items():
        ttft_ratio = float(s["ttft_ratio"])  # reuse TTFT / full TTFT
        speed = format_speedup(1.0, ttft_ratio) if ttft_ratio > 0 else "n/a"
        lines.append(f"{repair:<12}{int(s['prompts']):>8}{s['max_abs_diff']:>13.3g}{s['mean_kl']:>11.4f}"
                     f"{s['top1_agree']:>8.1%}{s['greedy_match']:>8.1%}{s['reuse_ratio']:>8.1%}"
                     f"{s['recomputed_share']:>8.1%}{speed:>15}")
    lines.append("TTFT speedup: full-prefill TTFT / reuse TTFT (median over prompts)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- errors
_USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ValueError, TypeError, OSError, ImportError,
                                                 KeyError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyError):
        text = f"missing key {text}"
    return text.splitlines()[0]


def run_guarded(fn: Callable[[], int], *, debug: bool, prog: str = "kvboost-rag") -> int:
    """Run a subcommand: a user error is one ``error:`` line on stderr and exit status 2; anything else one
    line too, exit status 1. ``--debug`` re-raises (the full traceback)."""
    if debug:
        return fn()
    try:
        return fn()
    except SystemExit as exc:  # raise SystemExit("message") in the commands: a user error
        if isinstance(exc.code, str):
            print(f"{prog}: error: {_first_line(Exception(exc.code))}", file=sys.stderr)
            return 2
        return int(exc.code or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as exc:
        print(f"{prog}: error: {_first_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, the traceback is one flag away
        print(f"{prog}: internal error: {type(exc).__name__}: {_first_line(exc)} (rerun with --debug for the "
              "traceback)", file=sys.stderr)
        return 1
