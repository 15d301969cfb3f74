"""Retention of a chunk cache: chunks no live sequence holds, kept as an LRU prefix cache.

With `retain_prefixes`, a removed sequence's full prompt chunks stay in the
tree with no holder (*cached* chunks), and a later insert matches them like
live ones. They count as available room: an operation that needs chunks
evicts them, least recently used first and leaves first (a chunk that has
cached children stays until they are gone).
"""

import numpy as np

from hydrajax.chunk_cache.allocator import ChunkAllocator
from hydrajax.chunk_cache.trie import Node


class CachedChunks:
  """The cached nodes of a tree, least recently used first, and their eviction.

  `fill` is the tree's per-chunk fill (`ChunkTrie.fill`): an evicted chunk's is
  set to 0 and the chunk given back to `alloc`.
  """

  def __init__(self, alloc: ChunkAllocator, fill: np.ndarray):
    self._alloc = alloc
    self._fill = fill
    self.lru: dict[Node, None] = {}  # cached nodes, least recently used first
    self.evicted = 0  # cached chunks freed to make room, over the cache's life

  def __len__(self) -> int:
    return len(self.lru)

  def __contains__(self, node: Node) -> bool:
    return node in self.lru

  def add(self, node: Node) -> None:
    """Caches a node nobody holds any more (most recently used)."""
    self.lru[node] = None

  def revive(self, node: Node) -> None:
    """A cached node is held again: it is no longer evictable."""
    del self.lru[node]

  def reclaim(self, chunks: int, keep: Node | None = None) -> None:
    """Evicts cached chunks until `chunks` are available (`keep` stays)."""
    if chunks > self._alloc.available:
      self.evict(chunks - self._alloc.available, keep)

  def evict(self, count: int, keep: Node | None = None) -> None:
    """Frees `count` cached chunks (fewer if there are none), least recently used leaves first."""
    freed = []
    while len(freed) < count:
      before = len(freed)
      for node in list(self.lru):  # a parent follows its children: one pass usually does
        if len(freed) == count:
          break
        if node.children or node is keep:
          continue
        del self.lru[node]
        node.parent.remove_child(node)
        freed.append(node.chunk)
      if len(freed) == before:
        break
    self._fill[freed] = 0
    self._alloc.release(freed)
    self.evicted += len(freed)
