"""The prefix-aware chunked KV cache (ChunkAttention) on hydrajax sharing layouts.

  prefix_tree    ChunkCache: the host prefix tree over a device chunk pool; plans and layouts
  allocator      ChunkAllocator: free list, reservations, contiguous runs; CapacityError
  device_layout  LayoutPolicy, device_layout: plans as TreeLayouts with few static shapes
  pool           copy_slots (copy on write of KV), pool_bytes

Attention over the pool is `hydrajax.tree_attention(q, pool_k, pool_v, cache.device_layout())`.
"""

from hydrajax.chunk_cache.allocator import CapacityError, ChunkAllocator
from hydrajax.chunk_cache.device_layout import LayoutPolicy, device_layout, next_power_of_two
from hydrajax.chunk_cache.pool import copy_slots, pool_bytes
from hydrajax.chunk_cache.prefix_tree import (
    Admission, ChunkCache, ChunkCacheConfig, Fork, PrefixMatch,
)
