"""What the transfer tests need to know of the C helpers (``_rows.c``): they
must be built unless ``KVOFFLOAD_PURE_PYTHON`` is set, and tests of the C
side are skipped only then."""

from __future__ import annotations

import os

import pytest

from kvoffload.transfer import _native

PURE = os.environ.get("KVOFFLOAD_PURE_PYTHON", "") not in ("", "0")
if _native.rows is None and not PURE:  # pragma: no cover - a failure, unless PURE
    raise ImportError(
        "kvoffload.transfer._rows is not built: run `pip install -e .` (scripts/install); "
        "set KVOFFLOAD_PURE_PYTHON=1 to run without it"
    )
needs_c = pytest.mark.skipif(PURE, reason="KVOFFLOAD_PURE_PYTHON is set: no C transfer helpers")
