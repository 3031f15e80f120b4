"""The ``--dtype`` choices: one list for the worker's flags and the operator's CRD
(``spec.worker.dtype``), in a module of its own so the operator's pure ``spec`` imports no part
of the worker that reads files."""

from __future__ import annotations

from typing import Final

DTYPES: Final = ("auto", "float32", "float16", "bfloat16")
