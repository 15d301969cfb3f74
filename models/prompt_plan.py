"""Host-side plan of generation from a prompt forest: the forest, its KV layout, the prefill
schedule and the decode rows (no model, no device work: `models.generate` runs it).

Prompts are a forest of `hydrajax.PromptNode`s carrying token ids (see
`prompt_node`), or plain token lists whose shared prefixes
`hydrajax.plan_from_tokens` finds. Every leaf continues into `num_samples`
sequences (rows, depth-first). The KV buffer is the one `plan_tree` lays out:
each tree node's tokens once, then a private region of `max_new_tokens` (rounded
up to PRIVATE_ALIGN) per row. `models.data_parallel` splits such a forest over dp shards.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import hydrajax
from hydrajax import PromptNode, Segment, SharingPlan
from hydrajax.builders import PAGE_ALIGN
from hydrajax.layout import as_int
from hydrajax.validation import token_ids

# Private regions are rounded up to this many tokens: the KV buffer length and the
# page size are then multiples of it, as the Pallas kernels' TMA tiling wants.
PRIVATE_ALIGN = 64
# Prefill rows attend their own node's tokens as private pages of this many tokens; every
# node's first KV token is a multiple of it.
PREFILL_PAGE = PAGE_ALIGN
# Token ids ride to the device as int32: without a vocab (`plan_prompts`) they must fit it.
ID_LIMIT = 2**31


def prompt_node(tokens: Sequence[int], children: Sequence[PromptNode] = (), *,
                num_samples: int = 1, label: str = '') -> PromptNode:
  """A `PromptNode` holding its token ids (integers >= 0: 3.7 is refused, not cut to 3)."""
  tokens = token_ids(tokens, 'tokens')
  return PromptNode(len(tokens), tuple(children), num_samples, label, tokens)


# ---------------------------------------------------------------------------
# Prompt forests


@dataclasses.dataclass
class ForestNode:
  """A node of a prompt forest as generation plans it: its tokens, children, and on a leaf
  its samples and its prompt's index in the output."""

  tokens: tuple[int, ...]
  children: list['ForestNode']
  num_samples: int = 1
  prompt_id: int = -1  # leaves: output group


def _from_prompt_nodes(roots: Sequence[PromptNode], vocab_size: int) -> list[ForestNode]:
  leaf_count = 0

  def convert(node: PromptNode, name: str) -> ForestNode:
    nonlocal leaf_count
    if node.tokens is None and node.length:
      raise ValueError('generate needs token ids on every PromptNode (use prompt_node(tokens))')
    if node.tokens:  # inner nodes and leaves may be empty
      _checked_ids(f'{name}.tokens', node.tokens, vocab_size)
    out = ForestNode(node.tokens or (), [], node.num_samples)
    if node.children:
      out.children = [convert(c, f'{name}.children[{i}]') for i, c in enumerate(node.children)]
    else:
      out.prompt_id, leaf_count = leaf_count, leaf_count + 1
    return out

  return [convert(r, f'prompts[{i}]') for i, r in enumerate(roots)]


def _checked_ids(name: str, tokens, vocab_size: int) -> list[int]:
  """A prompt's ids checked as the engine checks one (at least one id, in the vocab)."""
  return list(token_ids(tokens, name, vocab_size=vocab_size, allow_empty=False))


def _from_token_lists(sequences: Sequence[Sequence[int]], num_samples: int) -> list[ForestNode]:
  """A forest from the radix tree `plan_from_tokens` finds (children ordered by first row)."""
  tp = hydrajax.plan_from_tokens(sequences)
  plan = tp.plan
  nodes = [ForestNode(tuple(t), []) for t in tp.segment_tokens]
  # parent segment (-1: root) -> (first row, node)
  keyed: dict[int, list[tuple[int, ForestNode]]] = {}
  for j, seg in enumerate(plan.segments):
    keyed.setdefault(seg.parent, []).append((seg.row_begin, nodes[j]))
  for row in range(plan.num_rows):
    path = plan.path(row)
    leaf = ForestNode(tuple(tp.private_tokens[row]), [], num_samples, tp.order[row])
    keyed.setdefault(path[-1] if path else -1, []).append((row, leaf))
  for j, node in enumerate(nodes):
    node.children = [n for _, n in sorted(keyed.get(j, []), key=lambda x: x[0])]
  return [n for _, n in sorted(keyed.get(-1, []), key=lambda x: x[0])]


def _to_prompt_nodes(forest: list[ForestNode]) -> list[PromptNode]:
  def convert(n: ForestNode) -> PromptNode:
    return prompt_node(n.tokens, [convert(c) for c in n.children],
                       num_samples=1 if n.children else n.num_samples)
  return [convert(n) for n in forest]


def _preorder(forest: list[ForestNode]) -> list[tuple[ForestNode, int, tuple[int, ...]]]:
  """(node, depth, ancestor preorder indices) in preorder: the segment order of `plan_tree`."""
  out = []

  def visit(n: ForestNode, depth: int, ancestors: tuple[int, ...]) -> None:
    index = len(out)
    out.append((n, depth, ancestors))
    for c in n.children:
      visit(c, depth + 1, ancestors + (index,))

  for r in forest:
    visit(r, 0, ())
  return out


@dataclasses.dataclass(frozen=True)
class TreePrompts:
  """A prompt forest planned for decoding (host side).

  Attributes:
    plan: the decode plan (every node a segment; a private page of `max_new_tokens` rounded
      up to PRIVATE_ALIGN per row).
    nodes: (tokens, depth, ancestor segment indices) per segment, in segment order.
    row_node: per row, the deepest non-empty segment on its path (its last prompt token).
    prompt_lengths: [B] prompt tokens per row.
    prompt_ids, sample_ids: [B] output grouping of the rows.
  """

  plan: SharingPlan
  nodes: tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...]
  row_node: np.ndarray
  prompt_lengths: np.ndarray
  prompt_ids: np.ndarray
  sample_ids: np.ndarray

  @property
  def num_rows(self) -> int:
    return self.plan.num_rows

  @property
  def kv_tokens(self) -> int:
    return self.plan.kv_tokens


def longest_prompt(forest: Sequence[ForestNode]) -> int:
  """Tokens of the longest root-to-leaf prompt of the forest."""
  return max((len(n.tokens) + longest_prompt(n.children) for n in forest), default=0)


def prompt_forest(prompts, *, num_samples: int = 1,
                  vocab_size: int = ID_LIMIT) -> list[ForestNode]:
  """The forest of a `PromptNode` forest with tokens, or of token lists (shared prefixes found).

  Every token id must be an integer in [0, vocab_size): ValueError naming `prompts` otherwise.
  """
  if as_int(num_samples, 'num_samples') < 1:
    raise ValueError(f'num_samples must be >= 1, got {num_samples}')
  if isinstance(prompts, PromptNode):
    prompts = [prompts]
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, '__iter__'):
    raise ValueError(f'prompts must be a PromptNode forest or a list of token-id lists, got '
                     f'{prompts!r}')
  prompts = list(prompts)
  if not prompts:
    raise ValueError('prompts must not be empty')
  if all(isinstance(p, PromptNode) for p in prompts):
    if num_samples != 1:
      raise ValueError('with PromptNode trees, give num_samples on the leaves (num_samples=1 here)')
    return _from_prompt_nodes(prompts, vocab_size)
  if any(isinstance(p, PromptNode) for p in prompts):
    raise ValueError('prompts must be all PromptNodes or all token lists')
  if not hasattr(prompts[0], '__len__'):  # one flat prompt instead of a list of them
    raise ValueError(f'prompts must be a list of token-id lists, got a list of {prompts[0]!r}: '
                     f'give one prompt as [tokens]')
  ids = [_checked_ids(f'prompts[{i}]', p, vocab_size) for i, p in enumerate(prompts)]
  return _from_token_lists(ids, num_samples)


def plan_prompts(prompts, *, max_new_tokens: int, num_samples: int = 1) -> TreePrompts:
  """Plans a forest of `PromptNode`s with tokens, or token lists, for `max_new_tokens`."""
  check_max_new_tokens(max_new_tokens)
  return plan_forest(prompt_forest(prompts, num_samples=num_samples), max_new_tokens)


def check_max_new_tokens(max_new_tokens) -> int:
  if as_int(max_new_tokens, 'max_new_tokens') < 1:
    raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}')
  return int(max_new_tokens)


def private_capacity(max_new_tokens: int) -> int:
  """Tokens of a row's private region (and the decode plan's page size)."""
  return -(-max_new_tokens // PRIVATE_ALIGN) * PRIVATE_ALIGN


def plan_forest(forest: list[ForestNode], max_new_tokens: int) -> TreePrompts:
  """Plans a forest (of `prompt_forest`) for `max_new_tokens`."""
  order = _preorder(forest)
  plan = hydrajax.plan_tree(_to_prompt_nodes(forest),
                            private_capacity=private_capacity(max_new_tokens),
                            segment_align=PREFILL_PAGE)
  row_node, prompt_ids, sample_ids = [], [], []
  for j, (node, _, ancestors) in enumerate(order):
    if node.children:
      continue
    path = [a for a in ancestors + (j,) if order[a][0].tokens]
    if not path:
      raise ValueError(f'prompt {node.prompt_id} is empty: every sequence needs >= 1 prompt token')
    row_node += [path[-1]] * node.num_samples
    prompt_ids += [node.prompt_id] * node.num_samples
    sample_ids += list(range(node.num_samples))
  lengths = [plan.private_position(r) for r in range(plan.num_rows)]
  return TreePrompts(
      plan=plan,
      nodes=tuple((n.tokens, d, a) for n, d, a in order),
      row_node=np.array(row_node, np.int32),
      prompt_lengths=np.array(lengths, np.int32),
      prompt_ids=np.array(prompt_ids, np.int32),
      sample_ids=np.array(sample_ids, np.int32),
  )


# ---------------------------------------------------------------------------
# Prefill


@dataclasses.dataclass(frozen=True)
class PrefillCall:
  """The inputs of one prefill model call (host arrays) and where its last-token logits go."""

  tokens: np.ndarray  # [B, T] int32
  positions: np.ndarray  # [B, T] int32
  write_slots: np.ndarray  # [B, T] int32, >= L for padding
  plan: SharingPlan  # private pages of PREFILL_PAGE tokens: each row's own node
  max_private_pages: int
  last_index: np.ndarray  # [B] int32: index in T of the row's last token, or -1
  segment_ids: np.ndarray  # [B] the segment (node) each row prefills, -1 for a dummy row


def prefill_calls(tp: TreePrompts, chunk: int) -> list[PrefillCall]:
  """The prefill schedule: rounds of up to T = `chunk` tokens of every node that is ready.

  A node is ready in a round when each of its ancestors is complete by the end
  of that round: the model writes every row's K/V of a layer before that
  layer's attention, so a child may run in the round that finishes its parent.
  A tree whose nodes all fit in one chunk is prefilled in one call. Rows are
  padded to the largest round (dummy rows write nothing), so that rounds of
  one tree share a compile.
  """
  t, width = prefill_shape([tp], chunk)
  rounds = prefill_rounds(tp, t)
  num_rows = max(len(r) for r in rounds)
  return [prefill_call(tp, work, t, width, num_rows) for work in rounds]


def prefill_shape(trees: Sequence[TreePrompts], chunk: int) -> tuple[int, int]:
  """(T, private width in tokens) of the prefill calls of these trees (one shape for all of
  them). T is a multiple of PREFILL_PAGE (`chunk` rounded down, at least one page)."""
  if chunk < 1:
    raise ValueError(f'prefill_chunk must be >= 1, got {chunk}')
  page = PREFILL_PAGE
  longest = max(len(toks) for tp in trees for toks, _, _ in tp.nodes)
  t = min(max(page, chunk // page * page), -(-longest // page) * page)
  return t, -(-longest // t) * t


def prefill_rounds(tp: TreePrompts, t: int) -> list[list[tuple[int, int]]]:
  """Per round, (node, first token) of every node prefilled in it (see `prefill_calls`)."""
  sizes = {j: len(toks) for j, (toks, _, _) in enumerate(tp.nodes) if toks}
  done = dict.fromkeys(sizes, 0)
  rounds = []
  while any(done[j] < n for j, n in sizes.items()):
    ready = [
        j for j, n in sizes.items()
        if done[j] < n and all(sizes[a] - done[a] <= t for a in tp.nodes[j][2] if a in sizes)
    ]
    rounds.append([(j, done[j]) for j in ready])
    for j in ready:
      done[j] = min(done[j] + t, sizes[j])
  return rounds


def prefill_call(tp: TreePrompts, work: list[tuple[int, int]], t: int, width: int,
                 num_rows: int) -> PrefillCall:
  """One round's call: `work` rows, then dummy rows (which write nothing) up to `num_rows`."""
  plan, length = tp.plan, tp.plan.kv_tokens
  sizes = {j: len(toks) for j, (toks, _, _) in enumerate(tp.nodes) if toks}
  tokens = np.zeros((num_rows, t), np.int32)
  positions = np.zeros((num_rows, t), np.int32)
  slots = np.full((num_rows, t), length, np.int32)
  last = np.full((num_rows,), -1, np.int32)
  ids = np.full((num_rows,), -1, np.int32)
  page = PREFILL_PAGE
  pages = [(0,) * (width // page)] * num_rows
  lengths = [t] * num_rows
  for r, (j, start) in enumerate(work):
    toks, seg = tp.nodes[j][0], plan.segments[j]
    offsets = start + np.arange(t)
    valid = offsets < len(toks)
    tokens[r, valid] = np.asarray(toks, np.int32)[offsets[valid]]
    positions[r] = seg.position + offsets
    slots[r, valid] = seg.kv_start + offsets[valid]
    if start <= len(toks) - 1 < start + t:
      last[r] = len(toks) - 1 - start
    ids[r] = j
    own = np.arange(0, width, page)  # the node's tokens, page by page (kv_start is aligned)
    pages[r] = tuple(int(p) for p in np.where(own < len(toks), (seg.kv_start + own) // page, 0))
    lengths[r] = start + t
  segments = []  # the ancestors of this round's rows, restricted to them
  for a in sorted({a for j, _ in work for a in tp.nodes[j][2] if a in sizes}):
    rows = [r for r, (j, _) in enumerate(work) if a in tp.nodes[j][2]]
    s = plan.segments[a]
    segments.append(Segment(s.kv_start, s.kv_length, rows[0], rows[-1] + 1, -1, s.position))
  segments = [dataclasses.replace(s, parent=_parent(segments, i)) for i, s in enumerate(segments)]
  step_plan = SharingPlan(num_rows, tuple(segments), page, tuple(pages), tuple(lengths), length)
  return PrefillCall(tokens, positions, slots, step_plan, width // page, last, ids)


def _parent(segments: list[Segment], i: int) -> int:
  """The nearest earlier segment whose rows contain segment i's rows (ancestors come first)."""
  s = segments[i]
  for k in range(i - 1, -1, -1):
    p = segments[k]
    if p.row_begin <= s.row_begin and s.row_end <= p.row_end:
      return k
  return -1


# ---------------------------------------------------------------------------
# Decode rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSpec:
  """Per-row constants of decoding: where generated token j of row b goes.

  Token j is at sequence position `positions[b] + j`, flat slot
  `write_base[b] + j` (tree) and makes the row's private length
  `private_base[b] + j + 1`. `sequence_ids` seed the row's random draws.
  """

  positions: jax.Array  # [B] int32
  write_base: jax.Array  # [B] int32
  private_base: jax.Array  # [B] int32
  sequence_ids: jax.Array  # [B] int32


def sequence_ids(tp) -> np.ndarray:
  """A row's identity for its random draws: (prompt, sample), independent of the row order
  and of the dp shard (padding rows, prompt -1, get 0)."""
  real = tp.prompt_ids >= 0
  width = int(tp.sample_ids[real].max(initial=0)) + 1
  return np.where(real, tp.prompt_ids * width + tp.sample_ids, 0).astype(np.int32)


def tree_rows(tp: TreePrompts, decode_plan: SharingPlan | None = None) -> RowSpec:
  """The rows of `tp.plan`, decoded with `decode_plan` (the plan after a `SharingPolicy`).

  A demoted segment's pages lead the row's private pages in `decode_plan`, so the row's
  private length starts at those tokens; the generated tokens still go to its own page.
  """
  plan = tp.plan
  decode_plan = plan if decode_plan is None else decode_plan
  base = [plan.private_pages[r][0] * plan.page_size for r in range(plan.num_rows)]
  lead = np.subtract(decode_plan.private_lengths, plan.private_lengths).astype(np.int32)
  return RowSpec(
      positions=jnp.asarray(tp.prompt_lengths),
      write_base=jnp.asarray(np.array(base, np.int32)),
      private_base=jnp.asarray(lead),
      sequence_ids=jnp.asarray(sequence_ids(tp)),
  )
