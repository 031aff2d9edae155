"""GPUKVStore: the engine's "GPU" side (prefix cache and verifiable contents)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvoffload.abstract import BlockHash
from kvoffload.errors import ConfigError
from kvoffload.runtime.kv_store import GPUKVStore, block_pattern, hash_seed
from kvoffload.transfer.layout import Layout

LAYOUTS: tuple[Layout, ...] = ("kv_first", "blocks_first")


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.blake2b(name.encode(), digest_size=16).digest())


def make_store(num_blocks: int = 4, layout: Layout = "kv_first", **kw: object) -> GPUKVStore:
    args: dict[str, object] = {
        "num_blocks": num_blocks,
        "block_size": 4,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_size": 4,
        "dtype": "float16",
        "layout": layout,
        "device": "cpu",
    }
    args.update(kw)
    return GPUKVStore(**args)  # type: ignore[arg-type]


def accounted(kv: GPUKVStore) -> bool:
    """Every block is exactly one of free, cached or pinned."""
    ids = list(kv._free) + list(kv._cached.values()) + list(kv._pinned.values())
    return sorted(ids) == list(range(kv.num_blocks))


# --------------------------------------------------------------------------- shape


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_store_tensor_shapes_follow_the_layout(layout: Layout) -> None:
    kv = make_store(num_blocks=5, layout=layout)
    assert list(kv.tensors) == ["layer.0", "layer.1"]
    expected = (2, 5, 4, 2, 4) if layout == "kv_first" else (5, 2, 4, 2, 4)
    for t in kv.tensors.values():
        assert tuple(t.shape) == expected
        assert t.dtype == torch.float16
    # K and V of one block, over both layers
    assert kv.block_bytes == 2 * 2 * 4 * 2 * 4 * 2


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"layout": "heads_first"}, "layout"),
        ({"device": "tpu"}, "device"),
        ({"num_blocks": 0}, "num_gpu_blocks"),
        ({"head_size": 1, "num_kv_heads": 1, "block_size": 1}, "multiple of 4 bytes"),
    ],
)
def test_kv_store_rejects_bad_config(kw: dict[str, object], word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        make_store(**kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- prefix cache


def test_kv_store_prefix_hit_counts_leading_resident_blocks() -> None:
    kv = make_store(num_blocks=4)
    a, b, c, d = h("a"), h("b"), h("c"), h("d")
    assert kv.prefix_hit([a, b]) == 0
    ids = kv.allocate([a, b, c])
    # pinned blocks count (another request of the same step computed them)
    assert kv.prefix_hit([a, b, d, c]) == 2
    kv.unpin(ids)
    assert kv.prefix_hit([a, b, c, d]) == 3
    assert kv.prefix_hit([b, a]) == 2
    assert kv.prefix_hit([d, a]) == 0


def test_kv_store_allocate_takes_free_blocks_then_the_least_recently_used() -> None:
    kv = make_store(num_blocks=3)
    a, b, c, x, y = h("a"), h("b"), h("c"), h("x"), h("y")
    ids = kv.allocate([a, b, c])
    assert sorted(ids) == [0, 1, 2]
    assert kv.available() == 0
    kv.unpin(ids)  # cached, LRU first: a b c
    assert kv.available() == 3
    # a hit makes a most recently used: b c a
    hit = kv.pin_cached([a])
    assert hit == [ids[0]]
    kv.unpin(hit)
    (bx,) = kv.allocate([x])
    assert bx == ids[1]  # b's block was the least recently used
    assert kv.prefix_hit([b]) == 0
    assert kv.prefix_hit([c]) == 1
    (by,) = kv.allocate([y])
    assert by == ids[2]
    assert kv.available() == 1  # only a is left to reuse
    assert accounted(kv)


def test_kv_store_pinned_blocks_are_never_reused() -> None:
    kv = make_store(num_blocks=2)
    a, b, c = h("a"), h("b"), h("c")
    ids = kv.allocate([a, b])
    kv.unpin(ids[1:])
    assert kv.available() == 1
    (bc,) = kv.allocate([c])
    assert bc == ids[1]
    assert kv.prefix_hit([a]) == 1
    assert kv.available() == 0


def test_kv_store_pin_adds_a_reference_that_unpin_must_release() -> None:
    kv = make_store(num_blocks=2)
    a = h("a")
    ids = kv.allocate([a])
    kv.pin(ids)  # a store job reads the block
    kv.unpin(ids)  # the request is done with it
    assert kv.available() == 1  # still pinned by the job
    kv.unpin(ids)  # the job finished
    assert kv.available() == 2
    assert kv.prefix_hit([a]) == 1
    assert accounted(kv)


def test_kv_store_pin_cached_of_a_pinned_block_shares_it() -> None:
    kv = make_store(num_blocks=2)
    a = h("a")
    ids = kv.allocate([a])
    again = kv.pin_cached([a])
    assert again == ids
    kv.unpin(ids)
    assert kv.available() == 1
    kv.unpin(again)
    assert kv.available() == 2


def test_kv_store_allocate_reuses_a_stale_cached_block_of_the_same_hash() -> None:
    # A later block of a chain can stay cached after an earlier one was
    # evicted; allocating it again used to take a second block and orphan the
    # first (its cache entry was overwritten), shrinking the cache for good.
    kv = make_store(num_blocks=4)
    a, b, x, y, z = h("a"), h("b"), h("x"), h("y"), h("z")
    kv.unpin(kv.allocate([a, b]))
    kv.unpin(kv.allocate([x, y]))
    kv.unpin(kv.pin_cached([b]))  # LRU first: a x y b
    (bz,) = kv.allocate([z])  # evicts a; b stays cached
    assert kv.prefix_hit([a, b]) == 0
    ids = kv.allocate([a, b])
    assert len(set(ids)) == 2
    assert accounted(kv)
    kv.unpin(ids)
    kv.unpin([bz])
    assert kv.available() == kv.num_blocks
    assert kv.cached_blocks == kv.num_blocks
    assert accounted(kv)


def test_kv_store_allocate_of_a_hash_pinned_elsewhere_shares_its_block() -> None:
    # Used to overwrite the pinned entry: the first unpin then deleted the
    # second owner's entry and the second unpin raised KeyError.
    kv = make_store(num_blocks=4)
    a = h("a")
    first = kv.allocate([a])
    second = kv.allocate([a])
    assert second == first
    kv.unpin(first)
    kv.unpin(second)
    assert kv.available() == kv.num_blocks
    assert kv.prefix_hit([a]) == 1
    assert accounted(kv)


def test_kv_store_clear_drops_cached_blocks_and_keeps_pinned_ones() -> None:
    kv = make_store(num_blocks=4)
    a, b, c = h("a"), h("b"), h("c")
    ids = kv.allocate([a, b, c])
    kv.unpin(ids[:2])
    assert kv.clear() == 2
    assert kv.prefix_hit([a]) == 0
    assert kv.prefix_hit([c]) == 1
    assert kv.cached_blocks == 1
    assert kv.available() == 3
    kv.unpin(ids[2:])
    assert kv.available() == 4
    assert accounted(kv)


def test_kv_store_discard_frees_the_block_and_forgets_its_hash() -> None:
    kv = make_store(num_blocks=2)
    a = h("a")
    ids = kv.allocate([a])
    kv.discard(ids)
    assert kv.prefix_hit([a]) == 0
    assert kv.available() == 2
    assert accounted(kv)


# --------------------------------------------------------------------------- contents


def test_block_pattern_depends_on_seed_salt_and_position() -> None:
    seeds = torch.tensor([1, 2], dtype=torch.int64)
    p = block_pattern(seeds, 8, 0)
    assert p.shape == (2, 8)
    assert p.dtype == torch.int32
    assert not torch.equal(p[0], p[1])
    assert not torch.equal(p, block_pattern(seeds, 8, 1))
    assert len(set(p[0].tolist())) == 8
    assert torch.equal(p, block_pattern(seeds, 8, 0))
    assert hash_seed(h("a")) < 2**56


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_kv_store_verify_passes_for_computed_blocks(layout: Layout, dtype: str) -> None:
    kv = make_store(num_blocks=4, layout=layout, dtype=dtype)
    hashes = [h("a"), h("b"), h("c")]
    ids = kv.allocate(hashes)
    kv.compute(ids, hashes)
    assert kv.verify(ids, hashes) == 0
    assert kv.verify([], []) == 0
    # swapped hashes: both blocks are wrong
    assert kv.verify(ids[:2], hashes[1::-1]) == 2
    # a never-written block does not pass for a hash
    (free,) = kv.allocate([h("d")])
    assert kv.verify([free], [h("d")]) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("kv_index", [0, 1])
def test_kv_store_verify_detects_one_flipped_byte(
    layout: Layout, layer: int, kv_index: int
) -> None:
    kv = make_store(num_blocks=4, layout=layout)
    hashes = [h("a"), h("b"), h("c")]
    ids = kv.allocate(hashes)
    kv.compute(ids, hashes)
    t = kv.tensors[f"layer.{layer}"]
    bid = ids[1]
    block = t[kv_index, bid] if layout == "kv_first" else t[bid, kv_index]
    raw = block.view(-1).view(torch.uint8)
    raw[7] ^= 0x10  # one bit of one byte, deep inside the block
    assert kv.verify(ids, hashes) == 1
    raw[7] ^= 0x10
    assert kv.verify(ids, hashes) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_store_compute_touches_only_the_named_blocks(layout: Layout) -> None:
    kv = make_store(num_blocks=4, layout=layout)
    a, b = h("a"), h("b")
    ids = kv.allocate([a, b])
    kv.compute(ids[:1], [a])
    assert kv.verify(ids[:1], [a]) == 0
    assert kv.verify(ids[1:], [b]) == 1
    for t in kv.tensors.values():
        rest = t[:, ids[1]] if layout == "kv_first" else t[ids[1]]
        assert not rest.any()
