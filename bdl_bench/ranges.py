"""The range of a numeric option: what a config key or a method's option accepts, and the one-line error
for a value outside it (:mod:`bdl_bench.config_checks`, :meth:`bdl_bench.methods.base.Method.check_options`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: finite, at least ``low`` (more than ``low`` when ``low_open``),
    at most ``high`` (less than ``high`` when ``high_open``), an integer when ``integer``, or ``null``
    when ``nullable``."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            text = (
                f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"a finite {kind.split()[1]}"
        return text + (" or null" if self.nullable else "")


COUNT = Range(1, integer=True)  # sizes and sample counts
NON_NEGATIVE_INT = Range(0, integer=True)  # seeds, intervals where 0 means "off"
POSITIVE = Range(0, low_open=True)  # learning rates, precisions, scales
UNIT_OPEN = Range(0, 1, low_open=True, high_open=True)  # rates strictly between 0 and 1


def out_of_range(key: str, value: Any, allowed: Range) -> str:
    """``<key>=<value> is out of range: it must be <range>`` (``not a number`` for a non-number)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return f"{key}={value!r} is {'out of range' if number else 'not a number'}: it must be {allowed.describe()}"
