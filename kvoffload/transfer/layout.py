"""Where the block dimension sits in each layer's KV tensor.

vLLM allocates one tensor per attention layer in one of two layouts:
``"blocks_first"`` = ``(num_blocks, ...)`` (K and V inside a block) and
``"kv_first"`` = ``(2, num_blocks, ...)`` (K and V split). This module works on
shapes only, so it has no torch dependency and is unit-testable on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, get_args

from kvoffload._checks import is_int
from kvoffload.errors import ConfigError

Layout = Literal["blocks_first", "kv_first"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)

__all__ = [
    "LAYOUTS",
    "AttentionBackendLike",
    "Layout",
    "block_dim",
    "layout_from_backend",
    "resolve_layouts",
]

# Probe values for get_kv_cache_shape: distinct from each other and from 2 so
# that the position of the block count in the answer is unmistakable.
_PROBE_BLOCKS = 1237
_PROBE_ARGS = {"block_size": 16, "num_kv_heads": 8, "head_size": 128}


class AttentionBackendLike(Protocol):
    """What vLLM's attention backends offer that we need (duck-typed)."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...


def block_dim(layout: Layout) -> int:
    """Index of the block dimension in a tensor of ``layout``."""
    return 0 if layout == "blocks_first" else 1


def layout_from_backend(name: str, backend: AttentionBackendLike) -> Layout:
    """Ask a vLLM attention backend where it puts the block dimension.

    Raises :class:`~kvoffload.errors.ConfigError` if the probe shape is
    neither ``(num_blocks, ...)`` nor ``(2, num_blocks, ...)``.
    """
    shape = tuple(backend.get_kv_cache_shape(num_blocks=_PROBE_BLOCKS, **_PROBE_ARGS))
    if shape and shape[0] == _PROBE_BLOCKS:
        return "blocks_first"
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == _PROBE_BLOCKS:
        return "kv_first"
    raise ConfigError(
        f"layer {name!r}: attention backend's KV cache shape {shape} for "
        f"{_PROBE_BLOCKS} blocks is neither (num_blocks, ...) nor (2, num_blocks, ...)"
    )


def _candidates(shape: Sequence[int]) -> dict[Layout, int]:
    """Layouts a shape can be read as, with the block count each implies."""
    out: dict[Layout, int] = {}
    if len(shape) >= 1:
        out["blocks_first"] = shape[0]
    # (2, num_blocks) alone would give blocks with no content, so K/V split
    # needs at least one dimension after the block dimension.
    if len(shape) >= 3 and shape[0] == 2:
        out["kv_first"] = shape[1]
    return out


def resolve_layouts(
    shapes: Mapping[str, Sequence[int]],
    layouts: Layout | Mapping[str, Layout] | None = None,
    num_gpu_blocks: int | None = None,
    attn_backends: Mapping[str, AttentionBackendLike] | None = None,
) -> tuple[dict[str, Layout], int]:
    """Decide each layer's layout and the common number of GPU blocks.

    Sources, strongest first: ``layouts`` (one for all layers or one per
    layer), ``attn_backends`` (vLLM's probe), then the shapes themselves. A
    shape ``(2, n, ...)`` reads as kv_first with ``n`` blocks or as
    blocks_first with 2 blocks; all layers must agree on one block count, so it
    is settled by ``num_gpu_blocks`` or by another layer whose shape reads only
    one way. Raises :class:`~kvoffload.errors.ConfigError` when no layer is
    given, an argument has the wrong type (``num_gpu_blocks`` an int >= 1),
    a layout is unknown, the shapes disagree on the block count, or a layer
    stays ambiguous.
    """
    if not shapes:
        raise ConfigError("gpu_caches is empty: need at least one layer's KV tensor")
    if num_gpu_blocks is not None and (not is_int(num_gpu_blocks) or num_gpu_blocks < 1):
        raise ConfigError(f"num_gpu_blocks must be None or an int >= 1, got {num_gpu_blocks!r}")
    if not (layouts is None or isinstance(layouts, str | Mapping)):
        raise ConfigError(
            f"layouts must be None, one of {LAYOUTS} or a mapping of layer name to layout, "
            f"got {layouts!r}"
        )
    if not (attn_backends is None or isinstance(attn_backends, Mapping)):
        raise ConfigError(
            f"attn_backends must be None or a mapping of layer name to backend, "
            f"got {attn_backends!r}"
        )

    fixed: dict[str, Layout] = {}
    if isinstance(layouts, str):
        fixed = dict.fromkeys(shapes, layouts)
    elif layouts is not None:
        missing = sorted(set(shapes) - set(layouts))
        extra = sorted(set(layouts) - set(shapes))
        if missing or extra:
            raise ConfigError(
                f"layouts must name exactly the layers of gpu_caches; "
                f"missing {missing}, unknown {extra}"
            )
        fixed = dict(layouts)
    elif attn_backends is not None:
        missing = sorted(set(shapes) - set(attn_backends))
        if missing:
            raise ConfigError(f"attn_backends has no backend for layers {missing}")
        fixed = {name: layout_from_backend(name, attn_backends[name]) for name in shapes}
    for name, layout in fixed.items():
        if layout not in LAYOUTS:
            raise ConfigError(f"layer {name!r}: unknown layout {layout!r}; use one of {LAYOUTS}")

    options: dict[str, dict[Layout, int]] = {}
    for name, shape in shapes.items():
        cands = _candidates(shape)
        if name in fixed:
            if fixed[name] not in cands:
                raise ConfigError(
                    f"layer {name!r}: shape {tuple(shape)} cannot be {fixed[name]} "
                    "(kv_first needs (2, num_blocks, ...) with at least 3 dimensions)"
                )
            cands = {fixed[name]: cands[fixed[name]]}
        if not cands:
            raise ConfigError(f"layer {name!r}: a KV tensor needs a block dimension, got {shape}")
        options[name] = cands

    if num_gpu_blocks is None:
        # A count every layer can read is the only one possible; layers that
        # read one way only pin it.
        common = set.intersection(*(set(c.values()) for c in options.values()))
        if not common:
            detail = "; ".join(
                f"{n}: {tuple(shapes[n])} -> {sorted(set(c.values()))}" for n, c in options.items()
            )
            raise ConfigError(f"layers disagree on the number of GPU blocks ({detail})")
        if len(common) > 1:
            raise ConfigError(
                f"ambiguous KV layout: the shapes {sorted({tuple(s) for s in shapes.values()})} "
                f"fit {sorted(common)} GPU blocks (kv_first or blocks_first); pass "
                "num_gpu_blocks=..., layouts=... or attn_backends=..."
            )
        (num_gpu_blocks,) = common
        if num_gpu_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, the shapes say {num_gpu_blocks}")

    resolved: dict[str, Layout] = {}
    for name, cands in options.items():
        matching = [layout for layout, n in cands.items() if n == num_gpu_blocks]
        if not matching:
            raise ConfigError(
                f"layer {name!r}: shape {tuple(shapes[name])} does not hold "
                f"{num_gpu_blocks} GPU blocks as {' or '.join(cands)}"
            )
        if len(matching) > 1:
            raise ConfigError(
                f"layer {name!r}: shape {tuple(shapes[name])} holds {num_gpu_blocks} blocks "
                "both as kv_first and as blocks_first; pass layouts=... to say which"
            )
        resolved[name] = matching[0]
    return resolved, num_gpu_blocks
