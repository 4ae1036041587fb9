"""argparse helpers shared by the ``kvpage`` subcommands.

``CLIParser`` lets every ``BooleanOptionalAction`` flag take an optional value, as vLLM's
flags do: ``--flag``, ``--flag True``, ``--flag=false``, ``--flag 0`` and ``--no-flag`` all
work. It rewrites argv before argparse reads it (``--x true`` -> ``--x``, ``--x=0`` ->
``--no-x``); a value that is not a boolean word is a usage error. A word after ``--x``
that is not a boolean (a positional model, say) is left alone.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


class UsageError(ValueError):
    """A bad command line: reported with the subcommand's usage, exit status 2."""


def parse_bool(word: str) -> Optional[bool]:
    """``True``/``False`` for a boolean word (any case), None for anything else."""
    lowered = word.lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    return None


def normalize_bool_flags(args: Sequence[str], flags: set[str]) -> list[str]:
    """Rewrite the valued forms of the boolean ``flags`` (``--x``) to ``--x`` / ``--no-x``.

    Raises ``UsageError`` for ``--x=word`` with a non-boolean word, or ``--no-x=...``.
    Everything after a bare ``--`` is left as it is.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + list(args[i:])
        name, eq, value = arg.partition("=")
        if name in flags:
            if not eq and i + 1 < len(args) and parse_bool(args[i + 1]) is not None:
                value, eq = args[i + 1], "="
                i += 1
            if eq:
                truth = parse_bool(value)
                if truth is None:
                    raise UsageError(f"argument {name}: expected a boolean (true/false/1/0), got {value!r}")
                name = name if truth else "--no-" + name[2:]
            out.append(name)
        elif name.startswith("--no-") and "--" + name[5:] in flags and eq:
            raise UsageError(f"argument {name}: takes no value (use {'--' + name[5:]}={value})")
        else:
            out.append(arg)
        i += 1
    return out


class CLIParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose boolean flags accept an optional value (see the module doc)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        flags = {s for a in self._actions if isinstance(a, argparse.BooleanOptionalAction)
                 for s in a.option_strings if not s.startswith("--no-")}
        try:
            args = normalize_bool_flags(args, flags) if flags else args
        except UsageError as exc:
            self.error(str(exc))
        return super().parse_known_args(args, namespace)

    def explicit_dests(self, args: Sequence[str]) -> set[str]:
        """Destinations of the options that ``args`` names (to tell a given flag from a default)."""
        found = set()
        for arg in args:
            if arg == "--":
                break
            action = self._option_string_actions.get(arg.partition("=")[0])
            if action is not None:
                found.add(action.dest)
        return found


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, fractions)."""
    return _bounded_float(text, allow_zero=False)


def memory_share(text: str) -> float:
    """A share of device memory: a number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a share of memory is in (0, 1], got {value:g}")
    return value


class _FollowsChunkedPrefill:
    """``--max-step-ms``'s default: ``auto`` with chunked prefill, ``off`` without (not a str,
    so argparse passes it through untouched and ``config_from_args`` can tell it apart)."""

    def __repr__(self) -> str:
        return "auto"


AUTO_STEP_TARGET = _FollowsChunkedPrefill()


def step_target(text: str):
    """``--max-step-ms``: a number of milliseconds > 0, ``auto`` or ``off`` (None)."""
    if text == "off":
        return None
    if text == "auto":
        return text
    return _bounded_float(text, allow_zero=False)


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _bounded_float(text, allow_zero=True)


def _bounded_float(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number {'>=' if allow_zero else '>'} 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count)."""
    return _int_in(text, 1, None, "an integer", "must be >= 1")


def block_size(text: str) -> int:
    """Tokens per KV block: a power of two."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"a block size is a power of two, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port)."""
    return _int_in(text, 0, 65535, "a port number", "a port is in 0-65535")


def _int_in(text: str, low: int, high: Optional[int], expected: str, out_of_range: str) -> int:
    """``text`` as an integer in ``[low, high]`` (no upper bound when ``high`` is None)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{out_of_range}, got {value}")
    return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, except where the help says it already (a
    ``None`` default, or a help that ends with its own ``(default: ...)``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "(default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)
