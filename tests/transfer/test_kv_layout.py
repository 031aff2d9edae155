"""Layout resolution from shapes, explicit layouts and vLLM attention backends."""

from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError
from kvoffload.transfer.layout import Layout, block_dim, layout_from_backend, resolve_layouts


class FlashAttnLike:
    """(2, num_blocks, block_size, heads, head_size), like vLLM FlashAttention."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class MLALike:
    """(num_blocks, block_size, head_size), like vLLM's MLA backends."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)


class WeirdBackend:
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (block_size, num_blocks)


def test_resolve_layouts_infers_from_unambiguous_shapes() -> None:
    layouts, n = resolve_layouts({"a": (10, 16, 64), "b": (2, 10, 16, 64)})
    assert layouts == {"a": "blocks_first", "b": "kv_first"}
    assert n == 10


def test_resolve_layouts_uses_num_gpu_blocks_to_settle_kv_first() -> None:
    layouts, n = resolve_layouts({"a": (2, 10, 16, 64)}, num_gpu_blocks=10)
    assert layouts == {"a": "kv_first"}
    assert n == 10
    layouts, n = resolve_layouts({"a": (2, 10, 16, 64)}, num_gpu_blocks=2)
    assert layouts == {"a": "blocks_first"}


def test_resolve_layouts_rejects_ambiguous_shapes() -> None:
    with pytest.raises(ConfigError, match=r"ambiguous.*num_gpu_blocks"):
        resolve_layouts({"a": (2, 10, 16, 64), "b": (2, 10, 16, 64)})


def test_resolve_layouts_rejects_two_blocks_both_ways() -> None:
    with pytest.raises(ConfigError, match="both as kv_first and as blocks_first"):
        resolve_layouts({"a": (2, 2, 16, 64)}, num_gpu_blocks=2)


def test_resolve_layouts_rejects_layers_that_disagree() -> None:
    with pytest.raises(ConfigError, match="disagree on the number of GPU blocks"):
        resolve_layouts({"a": (10, 16, 64), "b": (12, 16, 64)})
    with pytest.raises(ConfigError, match="does not hold 7 GPU blocks"):
        resolve_layouts({"a": (10, 16, 64)}, num_gpu_blocks=7)


def test_resolve_layouts_two_dim_shape_is_blocks_first_only() -> None:
    layouts, n = resolve_layouts({"a": (2, 10)})
    assert layouts == {"a": "blocks_first"}
    assert n == 2


def test_resolve_layouts_explicit_layout_for_all_layers() -> None:
    layouts, n = resolve_layouts({"a": (2, 10, 4), "b": (2, 10, 8)}, "kv_first")
    assert layouts == {"a": "kv_first", "b": "kv_first"}
    assert n == 10


def test_resolve_layouts_explicit_per_layer_must_name_every_layer() -> None:
    with pytest.raises(ConfigError, match=r"missing \['b'\], unknown \['c'\]"):
        resolve_layouts({"a": (2, 10, 4), "b": (10, 4)}, {"a": "kv_first", "c": "kv_first"})


def test_resolve_layouts_explicit_layout_must_fit_shape() -> None:
    with pytest.raises(ConfigError, match="cannot be kv_first"):
        resolve_layouts({"a": (3, 10, 4)}, "kv_first")
    bad: Layout = "heads_first"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="unknown layout"):
        resolve_layouts({"a": (3, 10, 4)}, bad)


def test_resolve_layouts_attn_backends_like_vllm() -> None:
    layouts, n = resolve_layouts(
        {"a": (2, 10, 16, 8, 64), "b": (10, 16, 64)},
        attn_backends={"a": FlashAttnLike(), "b": MLALike()},
    )
    assert layouts == {"a": "kv_first", "b": "blocks_first"}
    assert n == 10


def test_layout_from_backend_rejects_unknown_shapes() -> None:
    with pytest.raises(ConfigError, match="neither"):
        layout_from_backend("x", WeirdBackend())


def test_resolve_layouts_attn_backends_must_cover_layers() -> None:
    with pytest.raises(ConfigError, match=r"no backend for layers \['b'\]"):
        resolve_layouts({"a": (10, 4), "b": (10, 4)}, attn_backends={"a": MLALike()})


def test_resolve_layouts_rejects_empty_and_zero_blocks() -> None:
    with pytest.raises(ConfigError, match="empty"):
        resolve_layouts({})
    with pytest.raises(ConfigError, match="num_gpu_blocks must be >= 1"):
        resolve_layouts({"a": (0, 4)})
    with pytest.raises(ConfigError, match="block dimension"):
        resolve_layouts({"a": ()})


def test_block_dim() -> None:
    assert block_dim("blocks_first") == 0
    assert block_dim("kv_first") == 1


class CPUAttnLike:
    """(2, num_blocks, heads, block_size, head_size), like vLLM 0.11.2's CPU
    attention (``TorchSDPABackend``)."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)


def test_resolve_layouts_vllm_cpu_cache_needs_its_attention_backend() -> None:
    # 64 blocks of 2 KV heads x 32 tokens x head size 32: read as 2 blocks
    # of (64, 2, 32, 32) just as well, so the shapes alone cannot decide
    shapes = {"l0": (2, 64, 2, 32, 32), "l1": (2, 64, 2, 32, 32)}
    with pytest.raises(ConfigError, match="ambiguous KV layout"):
        resolve_layouts(shapes)
    layouts, n = resolve_layouts(shapes, attn_backends=dict.fromkeys(shapes, CPUAttnLike()))
    assert layouts == {"l0": "kv_first", "l1": "kv_first"}
    assert n == 64
