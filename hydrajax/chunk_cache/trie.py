"""The prefix tree of a chunk cache: nodes are chunks, keyed by their token ids.

Node = one chunk at a chunk-aligned depth d: it holds a sequence's tokens
`[d * C, d * C + fill)`. A sequence is a root-to-node path. `ChunkTrie` holds
the root and the token ids of every chunk, and finds the longest prefix of a
prompt that the tree already holds (full chunks to share, and the best chunk
to copy a partial match from).
"""

import numpy as np


class Node:
  """One chunk of the prefix tree."""

  __slots__ = ('chunk', 'parent', 'depth', 'first', 'children', 'by_first', 'holders', 'tails',
               'ready', 'row_begin', 'row_end')

  def __init__(self, chunk: int, parent: 'Node | None', depth: int, first: int = -1):
    self.chunk = chunk
    self.parent = parent
    self.depth = depth  # chunk level: tokens [depth * C, depth * C + fill)
    self.first = first  # first token id (index key in the parent)
    self.children: list[Node] = []
    self.by_first: dict[int, list[Node]] = {}
    self.holders: set[int] = set()  # live sequences whose path contains this chunk (none: cached)
    self.tails: list[int] = []  # sequences whose path ends here, in row order
    self.ready = True  # KV computed
    self.row_begin = self.row_end = 0  # holders' rows (set for shared nodes)

  def add_child(self, child: 'Node', index: int | None = None) -> None:
    if index is None:
      self.children.append(child)
    else:
      self.children.insert(index, child)
    self.by_first.setdefault(child.first, []).append(child)

  def remove_child(self, child: 'Node') -> None:
    self.children.remove(child)
    self.remove_child_key(child)

  def remove_child_key(self, child: 'Node') -> None:
    same = self.by_first[child.first]
    same.remove(child)
    if not same:
      del self.by_first[child.first]


class ChunkTrie:
  """The root of the tree and the token ids each chunk of a pool of `num_chunks` holds."""

  def __init__(self, num_chunks: int, chunk_size: int):
    self.chunk_size = chunk_size
    self.root = Node(-1, None, -1)
    self.tokens = np.zeros((num_chunks, chunk_size), np.int32)  # token ids held by each chunk
    self.fill = np.zeros(num_chunks, np.int32)  # tokens held by each chunk (0: free)

  def full_matches(self, node: Node, first: int, key: bytes, allow_pending: bool) -> list[Node]:
    """Children of `node` that are full chunks holding exactly the tokens `key` (int32 bytes)."""
    return [
        child for child in node.by_first.get(first, ())
        if (child.ready or allow_pending) and self.fill[child.chunk] == self.chunk_size
        and self.tokens[child.chunk].tobytes() == key
    ]

  def best_copy(self, node: Node, tokens: np.ndarray,
                allow_pending: bool) -> tuple[Node | None, int]:
    """The child of `node` sharing the most leading tokens with the next chunk of `tokens`."""
    c, n = self.chunk_size, len(tokens)
    lo = (node.depth + 1) * c
    rest = tokens[lo : lo + c]
    src, best = None, 0
    for child in node.by_first.get(int(rest[0]), ()):
      if not (child.ready or allow_pending):
        continue
      m = min(int(self.fill[child.chunk]), len(rest))
      diff = np.flatnonzero(self.tokens[child.chunk, :m] != rest[:m])
      common = int(diff[0]) if diff.size else m
      if common > best:
        src, best = child, common
    best = min(best, n - lo - 1)  # the last prompt token is always prefilled
    return (src, best) if best > 0 else (None, 0)

  def walk(self, tokens: np.ndarray, allow_pending: bool) -> tuple[list[Node], Node | None, int]:
    """Longest shareable prefix: (matched full-chunk nodes, copy source node, tokens to copy).

    Full chunks are shared up to the chunk before the one holding the last
    prompt token. Identical full chunks can exist twice (a prompt that ends on
    a chunk boundary copies and completes its last chunk), so every matching
    path is followed, level by level; the deepest wins, then the longest copy
    from a child of its last chunk.
    """
    c, n = self.chunk_size, len(tokens)
    limit = (n - 1) // c  # full chunks that may be shared
    keys = tokens[: limit * c].astype(np.int32)
    frontier, depth = [self.root], 0  # the nodes that match `depth` chunks
    while depth < limit:
      lo = depth * c
      key, first = keys[lo : lo + c].tobytes(), int(keys[lo])
      deeper = [m for node in frontier for m in self.full_matches(node, first, key, allow_pending)]
      if not deeper:
        break
      frontier, depth = deeper, depth + 1
    common, node, src = -1, None, None
    for candidate in frontier:
      copy_src, copy_len = self.best_copy(candidate, tokens, allow_pending)
      if copy_len > common:
        common, node, src = copy_len, candidate, copy_src
    matched = []
    while node is not self.root:
      matched.append(node)
      node = node.parent
    return matched[::-1], src, common
