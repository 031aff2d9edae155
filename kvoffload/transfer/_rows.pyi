"""The transfer path's C helpers (kvoffload/transfer/_rows.c): the CPU row copier
and block_map.plan_copy's fast path, where it was built."""

import numpy as np
import numpy.typing as npt

def copy_rows(
    src: memoryview,
    dst: memoryview,
    src_rows: npt.NDArray[np.int64],
    dst_rows: npt.NDArray[np.int64],
    row_bytes: int,
    /,
) -> int:
    """Copy row ``src_rows[i]`` of ``src`` to row ``dst_rows[i]`` of ``dst``
    for every ``i`` (any contiguous buffers; the index buffers int64); returns
    the number of runs (rows consecutive on both sides) copied. ``IndexError``
    before any byte moves if an index is out of range; ``RuntimeError`` if an
    index changes during the copy (the rows before it copied)."""

def plan_rows(
    src_ids: npt.NDArray[np.int64],
    src_factor: int,
    src_first: int,
    src_last: int,
    src_limit: int,
    dst_ids: npt.NDArray[np.int64],
    dst_factor: int,
    dst_first: int,
    dst_last: int,
    dst_limit: int,
    src_out: npt.NDArray[np.int64],
    dst_out: npt.NDArray[np.int64],
    /,
) -> bool:
    """Expand both sides' block ids into rows (block ``b`` to ``b*factor ..
    b*factor+factor-1``, less the first ``first`` and last ``last`` rows of
    the side) into the outs; ``False`` (outs undefined) when an id lies
    outside ``[0, limit)`` (``limit < 0``: no bound), its last row would pass
    int64, or a destination id repeats. ``ValueError`` for bad factors, skips or out lengths."""
