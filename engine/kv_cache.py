"""KV block allocator with a prefix cache: ref-counted blocks, chained hashes, LRU.

Only *full* blocks are ever shared (their tokens can no longer change), so a
request never writes into a block another request reads: no copy-on-write.
A freed block keeps its hash and stays findable until it is reused; the free
list is ordered so that blocks without a hash are reused first, then cached
blocks least-recently freed first.

The blocks a running request fills as it decodes are registered lazily: a
decode that opens a block notes its request, and the noted requests' filled
blocks are hashed before the next lookup (so every lookup sees every block
filled so far), when the host waits for the device anyway, and when a request
frees its blocks. A steady decode batch that nobody looks up hashes nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from engine.request import Request

_NO_PARENT = bytes(32)  # the parent of a prompt's first block


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """A full block's key: SHA-256 of its parent's key and its tokens (vLLM's default).
    A non-cryptographic hash (Python's) lets a client craft a prompt whose blocks
    collide with another's, and so read or poison their KV; it even maps -1 and -2
    alike."""
    return _chain(parent, array("q", tokens).tobytes())


def _chain(parent: bytes | None, tokens: bytes) -> bytes:
    return hashlib.sha256(b"B" + (parent or _NO_PARENT) + tokens).digest()


def last_block_key(root: bytes | None, tokens: Sequence[int], block_size: int) -> bytes:
    """The key of the last of tokens' blocks (whole blocks only), chained from root."""
    raw, width, key = array("q", tokens).tobytes(), 8 * block_size, root
    for at in range(0, len(raw), width):
        key = _chain(key, raw[at : at + width])
    return key


def adapter_root(lora_index: int) -> bytes:
    """The root a LoRA adapter's blocks chain from: its KV is not the base model's."""
    return hashlib.sha256(b"L" + lora_index.to_bytes(8, "little")).digest()


def salted_root(parent: bytes | None, salt: str) -> bytes:
    """The root a request's blocks chain from under vLLM's cache_salt: only requests of
    the same salt (and adapter) share cached blocks."""
    return hashlib.sha256(b"S" + (parent or _NO_PARENT) + salt.encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        # Running requests that may have filled blocks since they last registered them
        # (see note_filled); a request leaves it when it frees its blocks.
        self.unhashed: dict[Request, None] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def find_cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks holding a prefix of req's tokens (nothing is claimed yet).

        At least the last token is always left to compute (its logits are needed),
        and whole blocks only, so the block it lands in is a fresh one."""
        if not self.enable_prefix_caching:
            return []
        self.hash_unhashed()  # what running requests filled is findable from now on
        bs = self.block_size
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        raw, width = array("q", tokens[: max_blocks * bs]).tobytes(), 8 * bs
        blocks: list[int] = []
        parent = req.hash_root
        for i in range(max_blocks):
            parent = _chain(parent, raw[i * width : (i + 1) * width])
            block = self.cached.get(parent)
            if block is None:
                break
            blocks.append(block)
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(blocks) * bs
        return blocks

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give req blocks for num_new_tokens more tokens (after claiming cached_blocks).

        Returns False, changing nothing, when there are not enough free blocks."""
        revived = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        num_computed = req.num_computed_tokens + len(cached_blocks) * self.block_size
        have = len(req.block_ids) + len(cached_blocks)
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - have
        if max(needed, 0) + revived > self.num_free_blocks:
            return False
        for block in cached_blocks:
            if self.ref_count[block] == 0:
                del self.free_blocks[block]
            self.ref_count[block] += 1
            req.block_ids.append(block)
        if cached_blocks:
            req.block_hashes = [self.block_hash[b] for b in req.block_ids]
            req.num_computed_tokens = num_computed
            if not req.num_output_tokens:  # once it has output, it was reported
                req.num_cached_tokens = num_computed
        if needed > 0:
            self.grow([req], [needed])
        return True

    def grow(self, reqs: list[Request], num_blocks: list[int]) -> list[int] | None:
        """Append num_blocks[i] fresh blocks to reqs[i]'s, for all of them (returns the
        blocks, in order) or, when too few are free, for none (None)."""
        total = sum(num_blocks)
        if total > self.num_free_blocks:
            return None
        # The next free blocks, held once and no longer findable by hash.
        free, hashes, cached = self.free_blocks, self.block_hash, self.cached
        ref_count, fresh = self.ref_count, []
        for _ in range(total):
            block, _ = free.popitem(last=False)
            old_hash = hashes[block]
            if old_hash is not None:
                if cached.get(old_hash) == block:
                    del cached[old_hash]
                hashes[block] = None
            ref_count[block] = 1
            fresh.append(block)
        at = 0
        for req, n in zip(reqs, num_blocks):
            req.block_ids += fresh[at : at + n]
            at += n
        return fresh

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks req has filled since the last call.

        Called once the host knows the step's tokens; the scheduler may already have
        scheduled later ones, so only known tokens count. A block's KV may still be
        being written by a launched step: any reader runs after it on the stream."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = req.block_hashes
        # Ids both known and computed (or scheduled): what the prefix cache may hold.
        tokens = req.token_slice(len(hashes) * bs, req.num_computed_tokens)
        cached, block_hash = self.cached, self.block_hash
        parent = hashes[-1] if hashes else req.hash_root
        full = len(tokens) // bs * bs  # no block filled up: none
        raw, width = array("q", tokens[:full]).tobytes(), 8 * bs
        for at in range(0, len(raw), width):
            parent = _chain(parent, raw[at : at + width])
            if parent not in cached:
                block = req.block_ids[len(hashes)]
                cached[parent] = block
                block_hash[block] = parent
            hashes.append(parent)

    def note_filled(self, reqs: list[Request]) -> None:
        """reqs' last blocks may have filled (decodes opened the next ones): registered
        lazily, as the module docstring says (hashing is most of a block opening's work)."""
        if self.enable_prefix_caching:
            self.unhashed.update(dict.fromkeys(reqs))

    def hash_unhashed(self) -> None:
        pending, self.unhashed = self.unhashed, {}
        for req in pending:
            self.cache_full_blocks(req)

    def free(self, req: Request) -> None:
        self.unhashed.pop(req, None)
        self.cache_full_blocks(req)  # what it filled since it last registered blocks
        # Tail blocks first, so a shared prefix outlives the suffixes behind it.
        for block in reversed(req.block_ids):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
                if self.block_hash[block] is None:
                    self.free_blocks.move_to_end(block, last=False)
        req.block_ids = []
        req.block_hashes = []
