"""How the plan's numbers read in its text: the formulas, the flags' reasons,
the warnings and the report all say sizes and counts the same way."""

from __future__ import annotations

from tandem.tools.plan.devices import GB


def gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
