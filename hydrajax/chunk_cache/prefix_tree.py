"""The former home of `ChunkCache`: its names, re-exported from `hydrajax.chunk_cache.cache`."""

from hydrajax.chunk_cache.cache import (  # noqa: F401 (re-exported)
    Admission, ChunkCache, ChunkCacheConfig, Fork, PrefixMatch,
)
