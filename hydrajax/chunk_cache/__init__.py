"""The prefix-aware chunked KV cache (ChunkAttention) on hydrajax sharing layouts.

  cache          ChunkCache: the host side of a device chunk pool, composed of the modules below
  trie           the prefix tree over chunk token ids: matching, copy sources
  allocator      ChunkAllocator: free list, reservations, contiguous runs; CapacityError
  eviction       retained (cached) chunks, LRU eviction
  row_order      depth-first row order, per-row arrays, shared segments
  layout_cache   plans, device layouts, and the cached decode layout
  pool           copy_slots (copy on write of KV), pool_bytes

Plans become device layouts with `SharingPlan.to_device(policy=LayoutPolicy(...))`
(`hydrajax.layout`). Attention over the pool is
`hydrajax.tree_attention(q, pool_k, pool_v, cache.device_layout())`.
"""

from hydrajax.chunk_cache.allocator import CapacityError, ChunkAllocator
from hydrajax.chunk_cache.cache import (
    Admission, ChunkCache, ChunkCacheConfig, Fork, PrefixMatch,
)
from hydrajax.chunk_cache.pool import copy_slots, pool_bytes
