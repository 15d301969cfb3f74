"""Tree attention in jnp (the XLA path): Hydragen's algorithm over a `TreeLayout`.

For every shared segment, the covered rows (times the GQA group G, times the
T query tokens) form the M dimension of one matrix-matrix product against the
segment's keys; segments with the same static capacities are batched in one
einsum. Private KV is plain masked decode attention per row. Each row then
gathers the partial states of the segments on its path (`path_item_index`) and
LSE-merges them with its private state in one pass (layouts without
`row_segments`: the states are scattered into their rows, `merge_into_rows`).

The backend protocol of `hydrajax.attention.plan`: `prepare` turns the layout
into gather indices (tokens relative to one layer's buffer, clamped into it),
masks and merge rows, once per tree change; `attend` adds the layer's
`kv_offset` to the indices and runs the products. Tokens a row does not attend
(padding, unwritten private slots, other segments' tokens in a padded block)
may hold anything, NaN included: their scores are masked and their values
zeroed before the PV product (0 * NaN would be NaN).

This is also the reference the Pallas kernels are tested against.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hydrajax.layout import TreeLayout, as_int
from hydrajax.partial_state import PartialState, merge_many, merge_stacked, normalized


def _dot_precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _attend(q, k, v, visible, scale):
  """Masked softmax attention with an (out, lse) result.

  q [Z, M, K, G, H]; k, v [Z, S, K, H]; visible [Z, M or 1, S] bool.
  Returns out [Z, M, K, G, H] float32, lse [Z, M, K, G] float32.
  """
  s = jnp.einsum(
      'zmkgh,zskh->zmkgs', q, k,
      preferred_element_type=jnp.float32, precision=_dot_precision(q.dtype),
  ) * scale
  s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
  # Values no query of the block sees may be garbage (NaN, inf): zero them, so p = 0 keeps them out.
  seen = jnp.any(visible, axis=1)[:, :, None, None]  # [Z, S, 1, 1]
  v = jnp.where(seen, v, jnp.zeros((), v.dtype))
  m = jnp.max(s, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum(
      'zmkgs,zskh->zmkgh', p.astype(v.dtype), v,
      preferred_element_type=jnp.float32, precision=_dot_precision(v.dtype),
  )
  return normalized(o, l, m)


def path_item_index(layout: TreeLayout) -> jax.Array | None:
  """[B, D] int32: for row b and path column d, where row b's state of the segment
  `layout.row_segments[b, d]` sits among the groups' states flattened and concatenated
  (group after group, each `[J * R]` with slot j*R + i holding row `row_begin[j] + i`: the
  order of `merge_into_rows`'s `rows`); -1 where the path has no segment. None when the
  layout has no `row_segments`.

  With it the rows gather their states (`merge_along_paths`, `sum_along_paths`): one dense pass,
  where scattering them into the rows is a scatter per reduction plus dense passes after it.
  """
  if layout.row_segments is None or not layout.groups:
    return None
  bases, offset = [], 0
  for g in layout.groups:  # slot of row b in segment j: offset + j*R + b - row_begin[j]
    bases.append(offset + jnp.arange(g.num_segments, dtype=jnp.int32) * g.row_capacity
                 - g.row_begin.astype(jnp.int32))
    offset += g.num_segments * g.row_capacity
  segments = layout.row_segments
  base = jnp.concatenate(bases)[jnp.maximum(segments, 0)]
  rows = jnp.arange(segments.shape[0], dtype=jnp.int32)[:, None]
  return jnp.where(segments >= 0, base + rows, -1).astype(jnp.int32)


def _along_paths(index, rows: int, *items):
  """(valid [D, B], [item[index[b, d]] as [D, B, ...] for each of `items`]): every item at
  every row's path columns in one gather per item, path column first (a program whose size
  does not grow with D: fixed-shape layouts make D the group's J, hundreds of slots)."""
  if index.ndim != 2 or index.shape[0] != rows or not jnp.issubdtype(index.dtype, jnp.integer):
    raise ValueError(f'index must be an integer [B={rows}, D] array (path_item_index), got '
                     f'{index.dtype}{list(index.shape)}')
  columns = index.T  # [D, B]
  safe = jnp.maximum(columns, 0)
  return columns >= 0, [x[safe] for x in items]


def _expand(valid, like):
  """valid [D, B] broadcastable against like [D, B, ...]."""
  return valid.reshape(valid.shape + (1,) * (like.ndim - 2))


def merge_along_paths(dense: PartialState, index, outs, lses, out_dtype=None) -> PartialState:
  """Each row's dense state (its private part) LSE-merged with the states of the segments on
  its path, gathered from the groups' states (outs [M, T, N, H], lses [M, T, N]; M = sum J*R)
  at `path_item_index`. The same result as merging `dense` with `merge_into_rows`."""
  if outs.shape[:-1] != lses.shape or outs.shape[1:] != dense.out.shape[1:]:
    raise ValueError(f'outs must be [M, {", ".join(map(str, dense.out.shape[1:]))}] and lses '
                     f'outs.shape[:-1]; got outs {list(outs.shape)}, lses {list(lses.shape)}')
  valid, (out, lse) = _along_paths(index, dense.out.shape[0], outs, lses)
  lse = jnp.where(_expand(valid, lse), lse.astype(jnp.float32), -jnp.inf)
  merged = merge_stacked(
      jnp.concatenate([dense.out.astype(jnp.float32)[None], out.astype(jnp.float32)]),
      jnp.concatenate([dense.lse.astype(jnp.float32)[None], lse]))
  return PartialState(merged.out.astype(out_dtype or dense.out.dtype), merged.lse)


def sum_along_paths(dense, index, items):
  """dense [B, ...] plus, for every row, the items [M, ...] of the segments on its path
  (gathered at `path_item_index`), in float32: what scatter-adding the items into their rows
  would give. An index past the items reads the last one (a gather clamps): pass the layout's
  own `path_item_index`."""
  if items.shape[1:] != dense.shape[1:]:
    raise ValueError(f'items must be [M, {", ".join(map(str, dense.shape[1:]))}] like dense\'s '
                     f'rows, got {list(items.shape)}')
  valid, (item,) = _along_paths(index, dense.shape[0], items)
  item = jnp.where(_expand(valid, item), item.astype(jnp.float32), 0.0)
  return dense.astype(jnp.float32) + jnp.sum(item, axis=0)


def merge_into_rows(num_rows, rows, outs, lses) -> PartialState:
  """LSE-merges partial states into their rows (rows == num_rows, or past it, are dropped).

  rows [M] int32; outs [M, T, N, H] float32; lses [M, T, N]. Rows that receive
  nothing get (0, -inf); a NaN state makes its row NaN. A state every row has once, in row
  order (its private part), needs no scatter: `merge` it with the result.
  """
  size = num_rows + 1
  m = jnp.full((size,) + lses.shape[1:], -jnp.inf, jnp.float32).at[rows].max(lses)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lses - m[rows])
  den = jnp.zeros_like(m).at[rows].add(w)
  contrib = jnp.where(w[..., None] == 0, 0.0, w[..., None] * outs)  # an empty state adds nothing
  acc = jnp.zeros((size,) + outs.shape[1:], jnp.float32).at[rows].add(contrib)
  out, lse = normalized(acc, den, m)
  return PartialState(out[:num_rows], lse[:num_rows])


# ---------------------------------------------------------------------------
# The backend protocol (see `hydrajax.attention.plan`)


@dataclasses.dataclass(frozen=True)
class XlaConfig:
  """Knobs of the XLA path.

  Attributes:
    kv_block: most kv tokens of one segment group in one product; longer groups run in blocks
      under `lax.map` and are LSE-merged (bounded memory for long segments).
  """

  kv_block: int = 4096

  def __post_init__(self):
    object.__setattr__(self, 'kv_block', as_int(self.kv_block, 'kv_block'))
    if self.kv_block < 1:
      raise ValueError(f'kv_block must be >= 1, got {self.kv_block}')


DEFAULT_CONFIG = XlaConfig()


def default_config(*, interpret: bool = False) -> XlaConfig:
  """The same on every device (the backend protocol's per-device default)."""
  del interpret
  return DEFAULT_CONFIG


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class XlaGroup:
  """One segment group's gathers: J segments of R rows, kv in NB blocks of S_b tokens."""

  rows: jax.Array  # [J, R] int32: the row of each slot, B (the dropped row) past row_count
  q_rows: jax.Array  # [J, R] int32: rows clamped into [0, B)
  tokens: jax.Array  # [NB, J, S_b] int32: buffer tokens, relative to the layer, in [0, L)
  visible: jax.Array  # [NB, J, S_b] bool: inside the segment


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class XlaPrepared:
  groups: tuple[XlaGroup, ...]
  merge_rows: jax.Array  # [sum J*R] int32: the row of every group's partial state
  path_items: jax.Array | None  # [B, D] int32 (`path_item_index`); None: scatter by merge_rows
  private_tokens: jax.Array  # [B, P*C] int32, relative to the layer, in [0, L)
  private_lengths: jax.Array  # [B] int32 (the layout's; swapped per decode step)


def unsupported_reason(shapes, layout: TreeLayout, *, interpret: bool = False) -> str | None:
  del shapes, layout, interpret
  return None  # every float dtype, shape and layout


@functools.partial(jax.jit, static_argnames=('num_rows', 'kv_tokens', 'kv_block'))
def _prepare(layout: TreeLayout, *, num_rows: int, kv_tokens: int, kv_block: int) -> XlaPrepared:
  b, last = num_rows, kv_tokens - 1
  groups, merge_rows = [], [jnp.zeros((0,), jnp.int32)]  # the private state is each row's own
  for g in layout.groups:
    r = g.row_capacity
    rows = g.row_begin[:, None] + jnp.arange(r)[None, :]  # [J, R]
    rows = jnp.where(jnp.arange(r)[None, :] < g.row_count[:, None], rows, b)  # b: dropped
    block = min(kv_block, g.kv_capacity)
    num_blocks = -(-g.kv_capacity // block)
    pos = jnp.arange(num_blocks * block).reshape(num_blocks, 1, block)  # [NB, 1, S_b]
    tokens = jnp.minimum(g.kv_start[None, :, None] + pos, last)
    visible = pos < g.kv_length[None, :, None]
    groups.append(XlaGroup(rows.astype(jnp.int32), jnp.minimum(rows, b - 1).astype(jnp.int32),
                           tokens.astype(jnp.int32), visible))
    merge_rows.append(rows.reshape(-1).astype(jnp.int32))
  c = layout.page_size
  private = (layout.private_pages[:, :, None] * c + jnp.arange(c)).reshape(b, -1)
  return XlaPrepared(
      tuple(groups), jnp.concatenate(merge_rows), path_item_index(layout),
      jnp.minimum(private, last).astype(jnp.int32), layout.private_lengths,
  )


def prepare(layout: TreeLayout, shapes, config: XlaConfig, *, interpret: bool = False):
  del interpret
  return _prepare(layout, num_rows=shapes.num_rows, kv_tokens=shapes.kv_tokens,
                  kv_block=config.kv_block)


def with_private_lengths(prepared: XlaPrepared, lengths: jax.Array) -> XlaPrepared:
  return dataclasses.replace(prepared, private_lengths=lengths)


def for_step(prepared: XlaPrepared) -> XlaPrepared:
  return prepared  # the private mask fuses into each layer's product: nothing to hoist


def _group_partials(q, k_cache, v_cache, group: XlaGroup, kv_offset, scale):
  """Partial states of one group: out [J, R, T, N, H], lse [J, R, T, N]."""
  _, t, n, h = q.shape
  kh = k_cache.shape[1]
  j, r = group.rows.shape
  qj = q[group.q_rows].reshape(j, r * t, kh, n // kh, h)  # [J, R*T, K, G, H]

  def one_block(block):
    tokens, visible = block
    tokens = tokens + kv_offset
    return _attend(qj, k_cache[tokens], v_cache[tokens], visible[:, None, :], scale)

  if group.tokens.shape[0] == 1:
    out, lse = one_block((group.tokens[0], group.visible[0]))
  else:  # bounded memory for long segments: a few partial states per row, merged below
    outs, lses = jax.lax.map(one_block, (group.tokens, group.visible))
    out, lse = merge_stacked(outs, lses)
  return out.reshape(j, r, t, n, h), lse.reshape(j, r, t, n)


def _private_partial(q, k_cache, v_cache, prepared: XlaPrepared, kv_offset, scale):
  """Causal attention of each row over its own pages: out [B, T, N, H], lse [B, T, N]."""
  b, t, n, h = q.shape
  kh = k_cache.shape[1]
  tokens = prepared.private_tokens + kv_offset  # [B, S]
  lengths = prepared.private_lengths
  pos = jnp.arange(tokens.shape[1])
  limit = jnp.minimum(lengths[:, None] - t + jnp.arange(t)[None, :] + 1, lengths[:, None])
  visible = pos[None, None, :] < limit[..., None]  # [B, T, S]
  out, lse = _attend(
      q.reshape(b, t, kh, n // kh, h), k_cache[tokens], v_cache[tokens], visible, scale
  )
  return out.reshape(b, t, n, h), lse.reshape(b, t, n)


@functools.partial(jax.jit, static_argnames=('scale',))
def _attend_all(q, k_cache, v_cache, prepared: XlaPrepared, kv_offset, *, scale):
  b, t, n, h = q.shape
  private = PartialState(*_private_partial(q, k_cache, v_cache, prepared, kv_offset, scale))
  if not prepared.groups:
    return merge_many([private], out_dtype=q.dtype)
  outs, lses = zip(*(_group_partials(q, k_cache, v_cache, group, kv_offset, scale)
                     for group in prepared.groups))
  outs = jnp.concatenate([o.reshape((-1, t, n, h)) for o in outs])
  lses = jnp.concatenate([l.reshape((-1, t, n)) for l in lses])
  if prepared.path_items is not None:  # each row gathers the states on its path
    return merge_along_paths(private, prepared.path_items, outs, lses, out_dtype=q.dtype)
  # No paths in the layout: the groups' states scattered into their rows, then merged with
  # the private state (each row's own, elementwise).
  return merge_many([private, merge_into_rows(b, prepared.merge_rows, outs, lses)],
                    out_dtype=q.dtype)


def attend(q, k_cache, v_cache, prepared: XlaPrepared, *, shapes, config, kv_offset, scale,
           interpret=False) -> PartialState:
  """Attention of every row over its tree path and private KV, in the layer at `kv_offset`."""
  del config, interpret
  scale = shapes.head_dim**-0.5 if scale is None else scale
  return _attend_all(q, k_cache, v_cache, prepared, jnp.asarray(kv_offset, jnp.int32), scale=scale)
