"""Flag parsing that the app's commands share: python -m train, python -m sample, python -m benchmarks.*.

A bad flag is one line on stderr and exit code 2, before any work: Parser.error prints which flag and why,
the types below say the bound that would work, Help shows each flag's default.
"""

from __future__ import annotations

import argparse
import math
import sys


class Parser(argparse.ArgumentParser):
  """Exits with code 2 and one line on a bad flag."""

  def error(self, message: str):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)


class Help(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each flag's default, except where there is none to show (the help says what applies)."""

  def _get_help_string(self, action):
    if action.default is None or action.default == [] or isinstance(action.default, bool):
      return action.help
    return super()._get_help_string(action)


def description(doc: str) -> str:
  """A module docstring's first paragraph as one line, for argparse's description (its first line alone may
  stop mid-sentence)."""
  return " ".join(doc.split("\n\n")[0].split())


def int_at_least(low: int):
  """argparse type of an int flag that must be >= low."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value
  return parse


def float_above(low: float, *, inclusive: bool = False, note: str = ""):
  """argparse type of a finite number > low (>= low where inclusive); `note` follows the bound in the message."""
  bound = f"{'>=' if inclusive else '>'} {low:g}{note}"

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
      raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return value
  return parse


positive_float = float_above(0)  # argparse type of a finite number > 0


def path(otherwise: str):
  """argparse type of a path flag: refuses an empty one (an unset shell variable) or one of spaces only (a variable
  quoted with a space around it), which would otherwise run as if the flag were not given, or write to a folder
  whose name shows as nothing; `otherwise` says what does what the empty path was taken for."""
  def parse(text: str) -> str:
    if not text.strip():
      what = "an empty path (an unset variable?)" if not text else f"a path of spaces only ({text!r})"
      raise argparse.ArgumentTypeError(f"{what}; {otherwise}")
    return text
  return parse


def address(otherwise: str):
  """argparse type of a host:port flag, as jax.distributed.initialize takes it: a host and a port number (without
  the port, jax fails with an IndexError); empty, as `path` refuses it."""
  def parse(text: str) -> str:
    host, colon, port = path(otherwise)(text).rpartition(":")
    if not colon or not host.strip() or not port.isdigit() or not 0 < int(port) < 65536:
      raise argparse.ArgumentTypeError(f"expected host:port, e.g. 10.0.0.1:1234 (process 0's host and a free port "
                                       f"there), got {text!r}")
    return text
  return parse
