"""argparse errors in one line, for the tools' command lines (plan, doctor, top).

argparse's own usage dump is two lines and does not say which rule was broken;
a tool's user should get one line on stderr and exit code 2, as for every other
bad input.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make argparse's own errors (unknown flag, missing value) one line too."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
