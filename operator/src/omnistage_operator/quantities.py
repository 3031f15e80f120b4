"""Kubernetes quantities and byte formatting: the one grammar, shared with the worker.

The code lives in :mod:`omnistage_worker.quantities` (pure, stdlib only), so that the
operator and the worker parse ``16Gi`` alike; this module keeps the operator's import path.
"""

from __future__ import annotations

from omnistage_worker.quantities import (
    QUANTITY_PATTERN,
    QuantityError,
    format_bytes,
    format_quantity,
    parse_quantity,
)

__all__ = ["QUANTITY_PATTERN", "QuantityError", "format_bytes", "format_quantity", "parse_quantity"]
