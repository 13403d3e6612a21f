"""Block allocator and prefix cache: ref counts, chained hashes, LRU reuse."""

from __future__ import annotations

import hashlib

from engine.kv_cache import BlockManager, adapter_root, chain_hash, salted_root
from engine.request import Request
from engine.sampling_params import SamplingParams


def make(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams())


def admit(bm: BlockManager, req: Request) -> list[int]:
    cached = bm.find_cached_prefix(req)
    assert bm.allocate(req, req.num_tokens - len(cached) * bm.block_size, cached)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return cached


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    req = make(list(range(10)))
    admit(bm, req)
    assert len(req.block_ids) == 3 and bm.num_free_blocks == 5
    bm.free(req)
    assert bm.num_free_blocks == 8 and req.block_ids == []


def test_full_blocks_are_shared_and_refcounted():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = make(list(range(10))), make(list(range(8)) + [99, 98, 97])
    admit(bm, a)
    cached = admit(bm, b)
    assert cached == a.block_ids[:2]  # two full blocks shared, the partial third not
    assert b.num_cached_tokens == 8
    assert bm.ref_count[a.block_ids[0]] == 2
    bm.free(a)
    assert bm.ref_count[b.block_ids[0]] == 1  # still held by b
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_last_token_is_always_recomputed():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    admit(bm, make(list(range(8))))
    again = make(list(range(8)))
    cached = admit(bm, again)
    # Both blocks are cached, but the logits of token 8 need a forward pass,
    # so only the first block is reused and the second is recomputed fresh.
    assert len(cached) == 1 and again.num_cached_tokens == 4


def test_chained_hash_depends_on_prefix():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    admit(bm, make([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make([0, 0, 0, 0, 5, 6, 7, 8, 9])  # same second block, different first
    assert admit(bm, other) == []


def test_freed_cached_blocks_survive_until_reused_lru():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    old = make([1, 2, 3, 4, 5])
    admit(bm, old)
    bm.free(old)
    assert bm.num_free_blocks == 4  # free, yet still findable
    hit = make([1, 2, 3, 4, 6])
    assert len(admit(bm, hit)) == 2
    bm.free(hit)
    # Uncached free blocks go first; cached ones are evicted only when needed.
    big = make(list(range(100, 108)))
    admit(bm, big)
    assert bm.find_cached_prefix(make([1, 2, 3, 4, 5])) == []  # evicted


def test_allocate_fails_without_side_effects():
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    req = make(list(range(12)))
    assert not bm.allocate(req, 12)
    assert req.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_caching_off_never_shares():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    admit(bm, make(list(range(9))))
    assert admit(bm, make(list(range(9)))) == []


def test_filled_blocks_are_registered_before_a_lookup_or_when_freed():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a, b = make(list(range(6))), make(list(range(6)))
    admit(bm, a)
    admit(bm, b)
    for req, new in ((a, [50, 51]), (b, [60, 61])):  # 8 tokens: the second block fills
        req.detach(new, 8, 0, 0)  # two outputs, computed
    bm.note_filled([a, b])
    assert len(a.block_hashes) == 1 and list(bm.unhashed) == [a, b]  # noted, not hashed yet
    bm.note_filled([a])  # noted again (its next block): still once
    assert list(bm.unhashed) == [a, b]
    bm.free(b)  # freeing registers what it filled, and forgets the note
    assert list(bm.unhashed) == [a]
    # A lookup hashes what was noted first: a's second block is found.
    assert bm.find_cached_prefix(make(list(range(6)) + [50, 51, 7])) == a.block_ids[:2]
    assert len(a.block_hashes) == 2 and bm.unhashed == {}
    assert len(bm.find_cached_prefix(make(list(range(6)) + [60, 61, 7]))) == 2  # b's, freed


def test_the_host_waiting_hashes_what_was_noted():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    req = make(list(range(4)))
    admit(bm, req)
    bm.grow([req], [1])
    req.detach([50, 51, 52, 53], 8, 0, 0)  # four outputs, computed: the second block fills
    bm.note_filled([req])
    bm.hash_unhashed()
    assert len(req.block_hashes) == 2 and bm.unhashed == {}


def test_noting_without_prefix_caching_keeps_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    req = make(list(range(4)))
    admit(bm, req)
    bm.note_filled([req])
    assert bm.unhashed == {}


def test_block_keys_are_sha256_of_the_parent_and_the_tokens():
    tokens = [5, 70000, 3, 9]
    first = chain_hash(None, tokens)
    raw = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    assert first == hashlib.sha256(b"B" + bytes(32) + raw).digest()
    assert chain_hash(first, tokens) == hashlib.sha256(b"B" + first + raw).digest()
    # Python's hash maps -1 and -2 alike; these keys tell every root and block apart.
    keys = {adapter_root(0), adapter_root(1), salted_root(None, "a"), salted_root(None, "b")}
    keys |= {salted_root(adapter_root(0), "a"), chain_hash(None, [-1]), chain_hash(None, [-2])}
    assert len(keys) == 7
