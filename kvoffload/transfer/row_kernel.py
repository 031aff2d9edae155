"""One CUDA kernel that copies scattered rows between device memory and the
pinned CPU mirror, for jobs whose mirror rows are not consecutive.

A copy engine moves one contiguous range per ``cudaMemcpyAsync``, at a few
microseconds of fixed cost each: a job of 256 random 16 KiB blocks is 256
copies per layer view that each carry 0.3 us of bytes. Pinned host memory is
mapped into the device's address space (unified virtual addressing), so a
kernel can read and write it directly over PCIe; this one copies every row of
a job for one layer view in one launch, whatever the fragmentation on either
side, with no staging buffer. It is written in Triton, which the CUDA builds
of torch depend on. :func:`available` checks once per device that Triton
builds it and that it moves bytes both ways through pinned memory there;
where not, the handler keeps its copy-engine path.

The kernel runs on the SMs, which the model's own kernels also use, while
copy engines do not: by default the handler uses it only for jobs of several
short mirror runs (:data:`MAX_RUN_BYTES`), where it is measured faster
(``bench/transfer.py --path``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["MAX_RUN_BYTES", "available", "copy_rows"]

#: The handler prefers the kernel for a job of two or more mirror runs that
#: average fewer bytes than this (per layer view); one run, or longer runs, go
#: to the copy engines. Measured on an H200 over PCIe 5 (docs/transfer.md):
#: on random ids the kernel was 6-20x the copy engines' speed at 16 KiB rows
#: and 1.1x at 1 MiB, even at 2 MiB, and slower for a single run.
MAX_RUN_BYTES = 2 << 20
#: Words (of the view's dtype) one program copies.
_BLOCK = 1024


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_rows_kernel(src, dst, rows, n_rows, row_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        # rows holds the source row ids, then the destination row ids
        r = tl.program_id(0)
        s = tl.load(rows + r)
        d = tl.load(rows + n_rows + r)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        words = tl.load(src + s * row_words + offs, mask=mask)
        tl.store(dst + d * row_words + offs, words, mask=mask)

    return copy_rows_kernel


@functools.cache
def available(device: torch.device) -> bool:
    """Whether the kernel copies rows both ways between pinned host memory
    and ``device`` (a CUDA device): Triton builds it and the bytes arrive.
    Checked once per device, with a tiny copy; logged when it is not."""
    try:
        _kernel()  # first: "no Triton" is the likeliest reason, say that one
        with torch.cuda.device(device):  # Triton launches on the current device
            kernel_rows = torch.tensor([[1, 0], [0, 1]], device=device)
            host = torch.arange(2 * 32, dtype=torch.int64).reshape(2, 32).pin_memory()
            on_device = torch.zeros((2, 32), dtype=torch.int64, device=device)
            back = torch.zeros((2, 32), dtype=torch.int64).pin_memory()
            copy_rows(host, on_device, kernel_rows)
            copy_rows(on_device, back, kernel_rows)
            torch.cuda.synchronize(device)
        if not torch.equal(back, host):
            raise RuntimeError(f"a probe copy came back wrong: {back.tolist()}")
    except Exception as e:  # no Triton, no compiler, no mapped pinned memory...
        logger.warning(
            "the scattered-row copy kernel is not usable on %s (%s: %s); "
            "scattered jobs go to the copy engines",
            device,
            type(e).__name__,
            e,
        )
        return False
    return True


def copy_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[rows[1]] = src[rows[0]]`` for 2-D contiguous tensors with rows of
    the same width and dtype, one of them pinned host memory or both on the
    device; ``rows`` is a ``(2, n)`` int64 tensor on the device. Queued on
    the current stream of the current device (the handler's stream context
    sets both)."""
    n = rows.shape[1]
    if n == 0:
        return
    row_words = src.shape[1]
    grid = (n, (row_words + _BLOCK - 1) // _BLOCK)
    _kernel()[grid](src, dst, rows, n, row_words, BLOCK=_BLOCK)
