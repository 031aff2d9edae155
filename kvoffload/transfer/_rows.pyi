"""The CPU row copier in C: kvoffload.transfer.host_copy.c_copy_rows when it was built."""

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
    before any byte moves if an index is out of range."""
