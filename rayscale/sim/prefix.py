"""Per-replica prefix caches for the simulated engines: vLLM's automatic prefix caching at block level.

The rules modelled are vLLM V1's (vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``,
vllm/v1/core/block_pool.py and kv_cache_utils.py's ``FreeKVCacheBlockQueue``):

- only full blocks are cached and looked up; a request's hit is its longest run of cached blocks from the
  first one (``find_longest_cache_hit``), and at most ``prompt - 1`` tokens, because the last prompt token
  is always computed to get the first token's logits;
- the hit tokens are not prefilled: the request's prefill starts at the hit (num_computed_tokens);
- blocks live in the replica's KV cache; when a new block is needed the least recently used cached block
  is evicted first, and a request's blocks are freed tail first, so that its prefix outlives its suffix;
- the engine counts every looked-up prompt's tokens as queries and its hit tokens as hits, exported as
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (vllm/v1/metrics/loggers.py).

The block is the trace's hash block (Mooncake: 512 tokens, not vLLM's 16): a trace names shared prefixes
only at that grain. Two simplifications keep it cheap (one ordered dict per replica, a few dictionary
operations per prompt block at admission): recency is the request's admission, not its finish; and the
cache holds up to the replica's whole KV capacity in blocks, where vLLM keeps the blocks of running
requests out of eviction and caches a prompt's blocks as their prefill completes, not at admission.
Routing is the simulator's (Ray Serve's, without affinity: rayscale does not deploy Ray Serve LLM's
PrefixCacheAffinityRouter), so a request finds its prefix only on the replica that last served it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]


class PrefixCaches:
    """The prefix caches of all replicas of one model, over its requests' block hashes (trace order)."""

    def __init__(self, hash_ids: npt.NDArray[np.object_], prompt: I64, block_tokens: int) -> None:
        if len(hash_ids) != len(prompt):
            raise ValueError("prefix cache: one tuple of block hashes per request")
        if block_tokens < 1:
            raise ValueError(f"prefix cache: block_tokens must be >= 1, got {block_tokens}")
        self.hashes: list[tuple[int, ...]] = hash_ids.tolist()
        self.prompt: list[int] = prompt.tolist()
        self.block_tokens = block_tokens
        self.caches: list[OrderedDict[int, None]] = []
        self.capacity: list[int] = []  # blocks per replica: its KV cache in blocks
        # Per replica, as vLLM's counters: prompt tokens looked up, and tokens found cached.
        self.queries: list[int] = []
        self.hits: list[int] = []
        self.total_queries = 0
        self.total_hits = 0

    def add_replica(self, kv_tokens: int) -> int:
        """A new replica with an empty cache of ``kv_tokens`` tokens; returns its index."""
        self.caches.append(OrderedDict())
        self.capacity.append(max(kv_tokens // self.block_tokens, 0))
        self.queries.append(0)
        self.hits.append(0)
        return len(self.caches) - 1

    def clear(self, r: int) -> None:
        """Replica r is gone, and its KV cache with it."""
        self.caches[r] = OrderedDict()

    def admit(self, q: int, r: int) -> int:
        """Request q starts on replica r: the prompt tokens it finds cached (not prefilled); its full blocks
        become the replica's most recently used, its first block last (evicted last)."""
        hs = self.hashes[q]
        p = self.prompt[q]
        bs = self.block_tokens
        cache = self.caches[r]
        full = min(len(hs), p // bs)
        top = min(full, (p - 1) // bs) if p > 0 else 0
        hit = 0
        while hit < top and hs[hit] in cache:
            hit += 1
        for i in range(full - 1, -1, -1):
            h = hs[i]
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        over = len(cache) - self.capacity[r]
        for _ in range(over):
            cache.popitem(last=False)
        tokens = hit * bs
        self.queries[r] += p
        self.hits[r] += tokens
        self.total_queries += p
        self.total_hits += tokens
        return tokens

    def admit_many(self, req: I64, rep: I64) -> I64:
        """``admit`` for each request of ``req`` on its replica in ``rep``, in order."""
        out = np.empty(len(req), dtype=np.int64)
        for k, (q, r) in enumerate(zip(req.tolist(), rep.tolist(), strict=True)):
            out[k] = self.admit(q, r)
        return out
