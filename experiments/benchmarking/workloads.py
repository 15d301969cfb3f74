"""Shared-prefix attention workloads: shapes, named grids, and their inputs.

A `Shape` is one decode step of B sequences sharing a P-token prefix, each with
an S-token private suffix whose last T tokens are the queries (T = 1 when
decoding one token). `make_problem` lays it out the hydrajax way: one flat KV
buffer, the prefix stored once, one private page per row.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarking.roofline import Cost, per_sequence_cost, shared_prefix_cost
from hydrajax.builders import PromptNode, plan_tree
from hydrajax.layout import SharingPlan, TreeLayout
from hydrajax.partial_state import PartialState
from hydrajax.reference import naive_attention

K1 = 1024


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark point.

  Attributes:
    batch: B rows (sequences).
    prefix: P shared tokens (0: nothing shared).
    suffix: S private tokens per row, the T query tokens included (>= T).
    num_q_heads: N.
    num_kv_heads: K.
    head_dim: H.
    query_len: T.
    dtype: KV and query dtype name.
    label: which grid/sweep the point belongs to.
  """

  batch: int
  prefix: int
  suffix: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int = 128
  query_len: int = 1
  dtype: str = 'bfloat16'
  label: str = ''

  def __post_init__(self):
    shared_prefix_cost(**self._cost_args())  # validates

  def _cost_args(self):
    return dict(
        batch=self.batch, prefix=self.prefix, suffix=self.suffix,
        num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, query_len=self.query_len,
        dtype_bytes=jnp.dtype(self.dtype).itemsize,
    )

  @property
  def heads(self) -> str:
    return f'{self.num_q_heads}/{self.num_kv_heads}'

  @property
  def name(self) -> str:
    return f'B={self.batch} P={_tokens(self.prefix)} S={self.suffix} heads={self.heads}'

  def shared_cost(self) -> Cost:
    return shared_prefix_cost(**self._cost_args())

  def per_sequence_cost(self) -> Cost:
    return per_sequence_cost(**self._cost_args())

  def per_sequence_kv_bytes(self) -> int:
    """Bytes of K and V when every row holds its own copy of the prefix."""
    itemsize = jnp.dtype(self.dtype).itemsize
    return 2 * self.batch * (self.prefix + self.suffix) * self.num_kv_heads * self.head_dim * itemsize

  def fields(self) -> dict:
    return dict(dataclasses.asdict(self), heads=self.heads, name=self.name)


def _tokens(n: int) -> str:
  return f'{n // K1}K' if n and n % K1 == 0 else str(n)


_HEADS = ((8, 1), (32, 8), (32, 32))


def hydragen_grid() -> list[Shape]:
  """Hydragen figure 5 (bf16, head dim 128), for each of 8/1, 32/8, 32/32 heads.

  Batch sweep at P=32K, S=1; prefix sweep 1K..32K at B=256, S=1; suffix sweep
  1..512 at B=256, P=32K.
  """
  shapes = []
  for n, k in _HEADS:
    for b in (1, 4, 16, 64, 256, 1024):
      shapes.append(Shape(b, 32 * K1, 1, n, k, label='hydragen batch'))
    for p in (1, 2, 4, 8, 16):  # 32K is in the batch sweep
      shapes.append(Shape(256, p * K1, 1, n, k, label='hydragen prefix'))
    for s in (32, 64, 128, 256, 512):  # 1 is in the batch sweep
      shapes.append(Shape(256, 32 * K1, s, n, k, label='hydragen suffix'))
  return shapes


def chunkattention_grid() -> list[Shape]:
  """ChunkAttention table 3: batch 32, 32/32 heads, prompts of 1K-4K tokens, 0-100% shared.

  The shared part is the prefix; the rest of the prompt plus the query token is
  each row's private suffix.
  """
  shapes = []
  for prompt in (1 * K1, 2 * K1, 4 * K1):
    for percent in (0, 50, 75, 100):
      shared = prompt * percent // 100
      shapes.append(Shape(32, shared, prompt - shared + 1, 32, 32, label=f'chunkattention {percent}%'))
  return shapes


def targets_grid() -> list[Shape]:
  """The target shapes of the kernels issue (and ChunkAttention's extremes)."""
  return [
      Shape(32, 2 * K1, 1, 32, 8, label='target <= 30us'),
      Shape(256, 16 * K1, 1, 32, 8, label='target <= 1.5x floor, >= 20x copies'),
      Shape(1024, 16 * K1, 1, 32, 8, label='target <= 1.3x floor'),
      Shape(1024, 32 * K1, 1, 8, 1, label='target <= 1.5x floor'),
      Shape(256, 16 * K1, 128, 32, 8, label='target <= 2x floor'),
      Shape(32, 4 * K1, 1, 32, 32, label='chunkattention 100%: >= 5x paged'),
      Shape(32, 0, 4 * K1 + 1, 32, 32, label='chunkattention 0%: <= 1.05x decode'),
  ]


def smoke_grid() -> list[Shape]:
  """Tiny shapes for a CPU end-to-end run (f32 so that tolerances are tight)."""
  return [
      Shape(4, 64, 1, 4, 2, head_dim=16, dtype='float32', label='smoke batch'),
      Shape(8, 64, 1, 4, 2, head_dim=16, dtype='float32', label='smoke batch'),
      Shape(8, 32, 1, 4, 2, head_dim=16, dtype='float32', label='smoke prefix'),
      Shape(8, 64, 5, 4, 4, head_dim=16, dtype='float32', label='smoke suffix'),
  ]


GRIDS = {
    'hydragen': hydragen_grid,
    'chunkattention': chunkattention_grid,
    'targets': targets_grid,
    'smoke': smoke_grid,
}


def grid(names: Sequence[str]) -> list[Shape]:
  """The union of named grids, in order, without duplicates."""
  shapes, seen = [], set()
  for name in names:
    if name not in GRIDS:
      raise ValueError(f'unknown grid {name!r}; expected one of {sorted(GRIDS)}')
    for s in GRIDS[name]():
      key = dataclasses.replace(s, label='')
      if key not in seen:
        seen.add(key)
        shapes.append(s)
  return shapes


@dataclasses.dataclass(frozen=True)
class Problem:
  """Inputs of one shape in hydrajax's layout.

  Attributes:
    shape: the point.
    plan: host sharing plan (one shared segment, then one private page per row of
      `suffix` rounded up to PAGE_ALIGN tokens, `suffix` of them valid).
    layout: its device form.
    q: [B, T, N, H] queries.
    k_cache, v_cache: [L, K, H] flat KV buffers (prefix once, then each row's page).
  """

  shape: Shape
  plan: SharingPlan
  layout: TreeLayout
  q: jax.Array
  k_cache: jax.Array
  v_cache: jax.Array

  def prefix_kv(self) -> tuple[jax.Array, jax.Array]:
    """The shared prefix's K and V, [P, K, H] each (it is stored first)."""
    p = self.shape.prefix
    return self.k_cache[:p], self.v_cache[:p]

  def suffix_kv(self) -> tuple[jax.Array, jax.Array]:
    """Each row's private K and V, [B, S, K, H] each."""
    b, s = self.shape.batch, self.shape.suffix
    start = self.plan.private_pages[0][0] * self.plan.page_size
    page = self.plan.page_size
    k = self.k_cache[start : start + b * page].reshape(b, page, *self.k_cache.shape[1:])
    v = self.v_cache[start : start + b * page].reshape(b, page, *self.v_cache.shape[1:])
    return k[:, :s], v[:, :s]

  def row_indices(
      self, rows: Sequence[int] | None = None, pad_to: int = 1
  ) -> tuple[np.ndarray, np.ndarray]:
    """Token indices of each row's own KV ([R, P + S] padded up to a multiple of pad_to with
    token 0) and the valid lengths [R]."""
    if pad_to < 1:
      raise ValueError(f'pad_to must be >= 1, got {pad_to}')
    length = self.shape.prefix + self.shape.suffix
    width = -(-length // pad_to) * pad_to
    prefix = np.arange(self.shape.prefix)
    start = self.plan.private_pages[0][0] * self.plan.page_size
    rows = range(self.shape.batch) if rows is None else rows
    idx = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
      idx[i, :length] = np.concatenate(
          [prefix, start + r * self.plan.page_size + np.arange(self.shape.suffix)]
      )
    return idx, np.full((len(idx),), length, np.int32)

  def per_sequence_kv(
      self, rows: Sequence[int] | None = None, pad_to: int = 1
  ) -> tuple[jax.Array, jax.Array]:
    """Per-row copies of the whole context, [R, P + S (padded), K, H] each.

    This is what a KV cache without sharing holds; padding tokens (a copy of
    token 0) follow the valid ones and must be masked by the caller.
    """
    idx, _ = self.row_indices(rows, pad_to)
    idx = jnp.asarray(idx)
    return self.k_cache[idx], self.v_cache[idx]

  def oracle(self, rows: Sequence[int]) -> PartialState:
    """Naive attention (f32) of the given rows over their own KV copies."""
    k, v = self.per_sequence_kv(rows)
    lengths = jnp.full((len(rows),), k.shape[1], jnp.int32)
    return naive_attention(self.q[np.asarray(rows)], k, v, lengths)


# Private pages are rounded up to this many tokens, as a paged KV cache reserves
# them (kernels tile pages by 8 or 16 tokens); only `suffix` tokens are valid.
PAGE_ALIGN = 16


def make_problem(shape: Shape, seed: int = 0) -> Problem:
  """Random inputs (normal, not zeros) for one shape."""
  plan = plan_tree(
      PromptNode(shape.prefix, num_samples=shape.batch, label='prefix'),
      private_capacity=-(-shape.suffix // PAGE_ALIGN) * PAGE_ALIGN,
      private_lengths=shape.suffix,
  )
  dtype = jnp.dtype(shape.dtype)
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (shape.batch, shape.query_len, shape.num_q_heads, shape.head_dim), dtype)
  kv_shape = (plan.kv_tokens, shape.num_kv_heads, shape.head_dim)
  k_cache = jax.random.normal(kk, kv_shape, dtype)
  v_cache = jax.random.normal(kv, kv_shape, dtype)
  return Problem(shape, plan, plan.to_device(), q, k_cache, v_cache)


def check_rows(batch: int, count: int) -> list[int]:
  """Up to `count` rows spread over the batch (first and last included)."""
  if batch <= count:
    return list(range(batch))
  return sorted({int(round(i * (batch - 1) / (count - 1))) for i in range(count)})
