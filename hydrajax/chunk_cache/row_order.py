"""Row order of a chunk cache: live sequences depth-first, and the shared segments over them.

Live sequences are kept in depth-first order of the tree (children in list
order, then the sequences whose tail is the node), so every chunk's holders
are a contiguous row range. A shared segment is a maximal run of chunks with
identical holders that are physically contiguous in the pool.
"""

import numpy as np

from hydrajax.chunk_cache.trie import Node
from hydrajax.layout import Segment


def dfs_order(root: Node) -> list[int]:
  """Sequence ids depth-first: per node its children in order, then its tails."""
  order: list[int] = []
  stack = [(root, iter(root.children))]
  while stack:
    node, children = stack[-1]
    child = next(children, None)
    if child is None:
      order.extend(node.tails)
      stack.pop()
    elif len(child.holders) <= 1:  # a private subtree (its one holder's) or a cached one
      order.extend(child.holders)
    else:
      stack.append((child, iter(child.children)))
  return order


def order_rows(root: Node) -> tuple[list[int], list[Node]]:
  """The order of `dfs_order`, and the shared nodes (>= 2 holders) in depth-first pre-order.

  Sets each shared node's `row_begin` and `row_end` (its holders' row range).
  """
  rows: list[int] = []
  shared_nodes: list[Node] = []
  stack = [(root, iter(root.children))]
  while stack:
    node, children = stack[-1]
    for child in children:  # resumes where it stopped when the node is back on top
      if len(child.holders) >= 2:
        child.row_begin = len(rows)
        shared_nodes.append(child)
        stack.append((child, iter(child.children)))
        break
      rows.extend(child.holders)  # a private subtree (one holder) or a cached one (none)
    else:
      rows.extend(node.tails)
      node.row_end = len(rows)
      stack.pop()
  return rows, shared_nodes


def segments(shared_nodes: list[Node], chunk_size: int,
             index: list[int] | None = None) -> tuple[Segment, ...]:
  """The shared segments of `order_rows`'s shared nodes, rows renumbered by `index`.

  `index` maps a global row to a plan row (None: the identity); a node whose
  rows all fall outside the selection is left out.
  """
  c = chunk_size
  # Per segment: [kv_start, length, row_begin, row_end, parent, position, last chunk].
  segs: list[list[int]] = []
  seg_of: dict[int, int] = {}
  for node in shared_nodes:
    begin, end = node.row_begin, node.row_end
    if index is not None:
      begin, end = index[begin], index[end]
      if begin == end:
        continue
    parent = seg_of.get(id(node.parent), -1)
    p = segs[parent] if parent >= 0 else None
    if p is not None and p[2] == begin and p[3] == end and p[6] + 1 == node.chunk:
      p[1] += c
      p[6] = node.chunk
      seg_of[id(node)] = parent
      continue
    seg_of[id(node)] = len(segs)
    segs.append([node.chunk * c, c, begin, end, parent, node.depth * c, node.chunk])
  return tuple(
      Segment(s[0], s[1], s[2], s[3], s[4], s[5], f'chunks {s[0] // c}..{s[6]}') for s in segs
  )


class RowArrays:
  """Per-row host arrays of `max_rows` rows, in row order, with page tables `max_pages` wide."""

  def __init__(self, max_rows: int, max_pages: int):
    self.lengths = np.zeros(max_rows, np.int64)  # tokens
    self.tails = np.zeros(max_rows, np.int64)  # chunk of the row's last node
    self.shared = np.zeros(max_rows, np.int64)  # shared tokens (leading chunks, >= 2 holders)
    self.pages = np.zeros((max_rows, max_pages), np.int32)  # private chunks
    self.npages = np.zeros(max_rows, np.int64)

  def permute(self, src: np.ndarray) -> None:
    """Row r of the first len(src) rows takes what row src[r] held."""
    b = len(src)
    if b:
      for arr in (self.lengths, self.tails, self.shared, self.pages, self.npages):
        arr[:b] = arr[src]

  def set_path(self, row: int, path: list[Node], chunk_size: int) -> None:
    """Recomputes a row's tail, shared tokens and page table from its path."""
    shared = 0
    while shared < len(path) and len(path[shared].holders) >= 2:
      shared += 1
    private = [node.chunk for node in path[shared:]]
    self.tails[row] = path[-1].chunk
    self.shared[row] = shared * chunk_size
    self.pages[row, : len(private)] = private
    self.pages[row, len(private) :] = 0
    self.npages[row] = len(private)
