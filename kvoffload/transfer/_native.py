"""The transfer path's C helpers (``kvoffload/transfer/_rows.c``), or ``None``
where the extension was not built or ``KVOFFLOAD_PURE_PYTHON`` is set; the
callers then run their numpy or Python reference (tests run both)."""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("KVOFFLOAD_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from kvoffload.transfer import _rows
    except ImportError:
        return None
    return _rows


rows = _load()
