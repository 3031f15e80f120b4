"""Kubernetes resource quantities as byte counts: the one grammar of the project (pure logic).

The operator (``vram.request``, printer columns) and the worker (``--residual-slack``) both use
this module. It lives in the worker package because both images install that package and the
worker must not import the operator's; it imports the standard library only, so the operator
takes nothing else of the worker with it.

Public API (stable):

- ``QuantityError(ValueError)``: raised for text that is not a non-negative quantity.
- ``parse_quantity(value: str | int) -> int``: ``"16Gi"``, ``"500M"``, ``"1.5e9"``, ``"1024"`` or an
  int to a whole number of bytes. Fractions round up, as ``resource.Quantity.Value()`` does.
- ``format_bytes(n: int) -> str``: a short human string with a binary suffix for printer
  columns (``"3.2Gi"``, ``"512Mi"``, ``"0"``, ``"-1.5Gi"`` for memory taken); within 5 % of
  ``n`` and, when ``n >= 0``, parseable again.
- ``format_quantity(n: int) -> str``: the exact canonical form (largest binary suffix that
  divides ``n``), so ``parse_quantity(format_quantity(n)) == n``.
- ``QUANTITY_PATTERN``: the regular expression the CRD uses for non-negative quantity strings.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

__all__ = [
    "QUANTITY_PATTERN",
    "QuantityError",
    "format_bytes",
    "format_quantity",
    "parse_quantity",
]

QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_FORMAT_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_MAX_EXPONENT = 30  # keeps "1e999999" from building a huge integer


class QuantityError(ValueError):
    """The value is not a non-negative Kubernetes quantity."""


def parse_quantity(value: str | int) -> int:
    """Return the number of bytes ``value`` names, rounding fractions up."""
    if isinstance(value, bool):
        raise QuantityError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"quantity must not be negative: {value}")
        return value
    if not isinstance(value, str):
        raise QuantityError(f"not a quantity: {value!r} (expected a string like '16Gi')")
    text = value.strip()
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise QuantityError(
            f"not a quantity: {value!r} (expected a number with an optional suffix "
            "Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E or an exponent like 1.5e9)"
        )
    number_text, suffix = m.group(1), m.group(5) or ""
    try:
        number = Decimal(number_text)
    except InvalidOperation as exc:  # pragma: no cover - the pattern rules this out
        raise QuantityError(f"not a quantity: {value!r}") from exc
    if suffix in _BINARY:
        amount = number * (Decimal(1024) ** _BINARY[suffix])
    elif suffix in _DECIMAL:
        amount = number.scaleb(_DECIMAL[suffix])
    elif suffix:
        exponent = int(suffix[1:])
        if exponent > _MAX_EXPONENT:
            raise QuantityError(f"quantity too large: {value!r}")
        amount = number.scaleb(exponent)
    else:
        amount = number
    return int(amount.to_integral_value(rounding=ROUND_CEILING))


def format_bytes(n: int) -> str:
    """Format ``n`` bytes for a printer column: one decimal below 10 units, else whole units.

    Negative counts (memory taken by a wake) keep their sign: ``"-3.2Gi"``.
    """
    if n < 0:
        return f"-{format_bytes(-n)}"
    value = Decimal(n)
    index = 0
    while value >= 1024 and index < len(_FORMAT_SUFFIXES) - 1:
        value /= 1024
        index += 1
    if index == 0:
        return str(n)
    if value < 10:
        text = f"{value.quantize(Decimal('0.1'))}"
        if text == "10.0":
            text = "10"
        elif text.endswith(".0"):
            text = text[:-2]
    else:
        text = f"{value.quantize(Decimal('1'))}"
    if text == "1024" and index < len(_FORMAT_SUFFIXES) - 1:
        text, index = "1", index + 1
    return f"{text}{_FORMAT_SUFFIXES[index]}"


def format_quantity(n: int) -> str:
    """Format ``n`` bytes exactly, using the largest binary suffix that divides it."""
    if n < 0:
        raise QuantityError(f"byte count must not be negative: {n}")
    index = 0
    while n and n % 1024 == 0 and index < len(_FORMAT_SUFFIXES) - 1:
        n //= 1024
        index += 1
    return f"{n}{_FORMAT_SUFFIXES[index]}"
