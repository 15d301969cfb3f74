"""Builders of `SharingPlan`s: explicit prompt trees and token lists.

Both lay the flat KV buffer out as: shared segments in depth-first order, then
one private region of `private_capacity` tokens per row (page-aligned, one
page per row).
"""

import dataclasses
from typing import Sequence

import numpy as np

from hydrajax.layout import Segment, SharingPlan, as_int
from hydrajax.validation import token_ids

# Pages of plan_from_tokens and the segment starts of generate's plans are multiples of this
# (the Mosaic GPU kernels' TMA tiles).
PAGE_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class PromptNode:
  """A node of a Hydragen-style sharing tree with any fan-out per node.

  Attributes:
    length: tokens in this node's segment (0 is allowed: an empty segment).
    children: child nodes; a node without children is a leaf.
    num_samples: for a leaf, how many sequences (rows) continue from it.
    label: a name for the rendering.
    tokens: optional token ids of the segment (len(tokens) == length), for generation.
  """

  length: int
  children: tuple['PromptNode', ...] = ()
  num_samples: int = 1
  label: str = ''
  tokens: tuple[int, ...] | None = None

  def __post_init__(self):
    object.__setattr__(self, 'length', as_int(self.length, 'PromptNode.length'))
    object.__setattr__(self, 'num_samples', as_int(self.num_samples, 'PromptNode.num_samples'))
    children = (self.children,) if isinstance(self.children, PromptNode) else self.children
    object.__setattr__(self, 'children', tuple(children))
    for child in self.children:
      if not isinstance(child, PromptNode):
        raise ValueError(
            f'PromptNode.children must be PromptNodes, got {child!r} ({type(child).__name__})')
    if self.length < 0:
      raise ValueError(f'PromptNode.length must be >= 0, got {self.length}')
    if self.tokens is not None:
      object.__setattr__(self, 'tokens', token_ids(self.tokens, 'PromptNode.tokens'))
      if len(self.tokens) != self.length:
        raise ValueError(f'PromptNode.tokens has {len(self.tokens)} ids but length is {self.length}')
    if self.num_samples < 1:
      raise ValueError(f'PromptNode.num_samples must be >= 1, got {self.num_samples}')
    if self.children and self.num_samples != 1:
      raise ValueError('num_samples applies to leaves only; give inner nodes children instead')


def _private_region(num_rows: int, first_token: int, capacity: int, lengths, align: int = 1):
  """(page size, pages, lengths, kv_tokens): one page of `capacity` tokens (rounded up to a
  multiple of `align`) per row after the shared tokens."""
  capacity = as_int(capacity, 'private_capacity')
  lengths = [np.asarray(lengths).item()] * num_rows if np.ndim(lengths) == 0 else list(lengths)
  lengths = [as_int(n, 'private_lengths') for n in lengths]
  if len(lengths) != num_rows:
    raise ValueError(f'private_lengths needs {num_rows} entries, got {len(lengths)}')
  if any(not 0 <= n <= capacity for n in lengths):
    raise ValueError(f'private_lengths must be in [0, private_capacity={capacity}], got {lengths}')
  page = -(-max(1, capacity) // align) * align
  first_page = -(-first_token // page)
  pages = tuple((first_page + b,) for b in range(num_rows))
  return page, pages, tuple(int(n) for n in lengths), (first_page + num_rows) * page


def plan_tree(
    roots: PromptNode | Sequence[PromptNode],
    *,
    private_capacity: int,
    private_lengths: int | Sequence[int] = 0,
    segment_align: int = 1,
) -> SharingPlan:
  """Plans explicit levels, e.g. few-shot prompt -> problems -> samples.

  Args:
    roots: one tree, or a forest of independent trees (sharing groups).
    private_capacity: tokens reserved per row for its own suffix (max new tokens).
    private_lengths: valid private tokens per row now (an int for all rows).
    segment_align: each segment's first KV token is a multiple of this (gaps are left
      unused), so that pages of this size address a node's own tokens: a prefill row that
      writes a node attends those tokens as private pages (`models.generate`, pages of
      `PAGE_ALIGN`, which the Mosaic GPU kernels take).
  """
  roots = (roots,) if isinstance(roots, PromptNode) else roots
  if not isinstance(roots, (list, tuple)) or not roots or any(
      not isinstance(root, PromptNode) for root in roots):
    raise ValueError(f'roots must be a PromptNode or a non-empty sequence of them, got {roots!r}')
  roots = tuple(roots)
  segment_align = as_int(segment_align, 'segment_align')
  if segment_align < 1:
    raise ValueError(f'segment_align must be >= 1, got {segment_align}')
  segments: list[Segment | None] = []
  next_token = 0
  next_row = 0
  # Depth-first with an explicit stack (a 10K-deep chain must not hit the recursion limit): an
  # entry with an index closes that node's segment once its children are done.
  work = [(root, -1, 0, None) for root in reversed(roots)]
  while work:
    node, parent, position, index = work.pop()
    if index is not None:
      kv_start, row_begin = segments[index]
      segments[index] = Segment(
          kv_start, node.length, row_begin, next_row, parent, position,
          node.label or f'node{index}',
      )
      continue
    index = len(segments)
    next_token = -(-next_token // segment_align) * segment_align
    segments.append((next_token, next_row))  # rows are known after the children
    next_token += node.length
    if not node.children:
      next_row += node.num_samples
    work.append((node, parent, position, index))
    work.extend((c, index, position + node.length, None) for c in reversed(node.children))
  page, pages, lengths, total = _private_region(next_row, next_token, private_capacity, private_lengths)
  return SharingPlan(next_row, tuple(segments), page, pages, lengths, total)


@dataclasses.dataclass(frozen=True)
class TokenPlan:
  """A plan found from token lists, with what a prefill needs.

  Attributes:
    plan: the sharing plan (rows in depth-first order).
    order: order[row] is the index of the input sequence at that row.
    segment_tokens: token ids of each shared segment.
    private_tokens: per row, its unshared prompt tail (the start of its private KV).
  """

  plan: SharingPlan
  order: tuple[int, ...]
  segment_tokens: tuple[tuple[int, ...], ...]
  private_tokens: tuple[tuple[int, ...], ...]



def plan_from_tokens(sequences: Sequence[Sequence[int]], *, max_new_tokens: int = 0) -> TokenPlan:
  """Finds shared prefixes by longest common prefix (a radix tree of the prompts).

  A run of tokens common to two or more sequences becomes a shared segment; what
  only one sequence holds is its private tail, followed by room for
  `max_new_tokens` generated tokens; the page size (one page per row) is that
  rounded up to a multiple of `PAGE_ALIGN`, so that every kernel accepts the layout.
  """
  if isinstance(sequences, (str, bytes)) or not hasattr(sequences, '__iter__'):
    raise ValueError(f'sequences must be a list of token-id lists, got {sequences!r}')
  seqs = [token_ids(s, f'sequences[{i}]') for i, s in enumerate(sequences)]
  if not seqs:
    raise ValueError('plan_from_tokens needs at least one sequence')
  max_new_tokens = as_int(max_new_tokens, 'max_new_tokens')
  if max_new_tokens < 0:
    raise ValueError(f'max_new_tokens must be >= 0, got {max_new_tokens}')
  segments: list[Segment] = []
  segment_tokens: list[tuple[int, ...]] = []
  order: list[int] = []
  tails: list[tuple[int, ...]] = []
  next_token = 0

  def lcp(ids: list[int], depth: int) -> int:
    first = seqs[ids[0]]
    n = min(len(seqs[i]) for i in ids) - depth
    for k in range(n):
      if any(seqs[i][depth + k] != first[depth + k] for i in ids[1:]):
        return k
    return n

  # Depth-first with an explicit stack (deep prefix chains must not hit the recursion limit);
  # a ('close', ...) entry ends a segment once the rows under it are placed.
  work: list[tuple] = [('visit', list(range(len(seqs))), 0, -1)]
  while work:
    entry = work.pop()
    if entry[0] == 'close':
      _, index, kv_start, common, row_begin, parent, position = entry
      segments[index] = Segment(
          kv_start, common, row_begin, len(order), parent, position, f'lcp{index}'
      )
      continue
    _, ids, depth, parent = entry
    if len(ids) == 1:
      order.append(ids[0])
      tails.append(seqs[ids[0]][depth:])
      continue
    common = lcp(ids, depth)
    index = parent
    if common > 0:
      index = len(segments)
      segments.append(None)
      segment_tokens.append(seqs[ids[0]][depth : depth + common])
      work.append(('close', index, next_token, common, len(order), parent, depth))
      next_token += common
    depth += common
    by_next: dict[int, list[int]] = {}
    for i in ids:
      if len(seqs[i]) > depth:
        by_next.setdefault(seqs[i][depth], []).append(i)
    for i in ids:  # identical sequences: all share the segment, nothing private
      if len(seqs[i]) == depth:
        order.append(i)
        tails.append(())
    work.extend(('visit', by_next[token], depth, index) for token in sorted(by_next, reverse=True))
  capacity = max(len(t) for t in tails) + max_new_tokens
  # Pages of a multiple of 8 tokens: what the Mosaic GPU kernels' TMA tiling reads.
  page, pages, lengths, total = _private_region(
      len(order), next_token, capacity, [len(t) for t in tails], align=PAGE_ALIGN
  )
  plan = SharingPlan(len(order), tuple(segments), page, pages, lengths, total)
  return TokenPlan(plan, tuple(order), tuple(segment_tokens), tuple(tails))
