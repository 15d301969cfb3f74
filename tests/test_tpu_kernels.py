"""Mosaic TPU tree-attention kernels, run in TPU interpret mode on CPU.

Every case compares the kernels with both oracles: `tree_attention_xla` (the
jnp tree algorithm) and `naive_tree_attention` (softmax over each row's own
concatenated KV). Shapes are tiny because interpret mode is slow; block sizes
are shrunk in some cases so that row tiles, kv blocks and pages per step all
take more than one value. A lowering test compiles the same kernels to Mosaic
for TPU v5e and v5p (no TPU needed) and counts the launches. On a TPU host
the kernel cases run compiled instead of interpreted.
"""

import dataclasses
import functools
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import hydrajax as hj
from hydrajax.attention import dispatch
from hydrajax.layout import Segment, SharingPlan
from pallas_kernels.tpu import block_sizes
from pallas_kernels.tpu import tree_attention as tpu
from pallas_kernels.tpu.online_softmax import LANES
from pallas_kernels.tpu.private_attention import private_attention, private_attention_reference
from pallas_kernels.tpu.shared_attention import shared_attention, shared_attention_reference
from pallas_kernels.tpu.work_list import FIRST, LAST, build_work_list
from tests.tree_attention_conformance import Case as ConformanceCase
from tests.tree_attention_conformance import TreeAttentionConformance
from tests.tree_attention_conformance import pytest_generate_tests  # noqa: F401 (parametrizes)

ON_TPU = jax.default_backend() == 'tpu'
# The same cases run compiled on a TPU and in TPU interpret mode elsewhere.
INTERPRET = False if ON_TPU else pltpu.InterpretParams()
H = 128
TOLERANCE = {  # (out atol, lse atol)
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-3),
}
TINY_BLOCKS = tpu.BlockSizes(
    block_rows=16, block_kv=128, heads_per_block=1, private_block_kv=24, private_rows_per_block=3,
    private_heads_per_block=1,
)


def random_tree(rng, depth: int, *, max_fanout: int, max_length: int, max_samples: int):
  """A random `PromptNode` tree; segment lengths mix 0, 1 and odd sizes."""

  def node(level):
    length = int(rng.choice([0, 1, int(rng.integers(2, max_length + 1))], p=[0.15, 0.15, 0.7]))
    if level == depth:
      return hj.PromptNode(length, num_samples=int(rng.integers(1, max_samples + 1)))
    fanout = int(rng.integers(1, max_fanout + 1))
    return hj.PromptNode(length, children=tuple(node(level + 1) for _ in range(fanout)))

  return node(1)


def paged_plan(tree, rng, *, page_size: int, num_queries: int, max_private: int) -> SharingPlan:
  """Plans `tree` with private KV in scattered pages of `page_size` tokens.

  Rows get ragged private lengths in [num_queries, max_private] (including
  exactly num_queries and page-size multiples) and one spare page sometimes.
  """
  base = hj.plan_tree(tree, private_capacity=0)
  first_page = -(-base.shared_tokens() // page_size)
  lengths = rng.integers(num_queries, max_private + 1, size=base.num_rows)
  lengths[0] = num_queries
  if base.num_rows > 1:
    lengths[1] = min(max_private, 2 * page_size)
  counts = [-(-int(n) // page_size) + int(rng.integers(0, 2)) for n in lengths]
  ids = first_page + rng.permutation(sum(counts))
  pages, start = [], 0
  for c in counts:
    pages.append(tuple(int(p) for p in ids[start : start + c]))
    start += c
  return SharingPlan(
      num_rows=base.num_rows,
      segments=base.segments,
      page_size=page_size,
      private_pages=tuple(pages),
      private_lengths=tuple(int(n) for n in lengths),
      kv_tokens=(first_page + sum(counts)) * page_size,
  )


def random_inputs(plan: SharingPlan, seed: int, *, num_queries, heads, kv_heads, dtype, head_dim=H):
  """q [B, T, N, H], k, v [L, K, H], standard normal from numpy.random.default_rng(seed).

  Drawn on the host: a jax.random draw compiles once per shape, a large share of
  a small interpret-mode case.
  """
  rng = np.random.default_rng(seed)
  draw = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  kv_shape = (plan.kv_tokens, kv_heads, head_dim)
  return draw((plan.num_rows, num_queries, heads, head_dim)), draw(kv_shape), draw(kv_shape)


# The oracles, jitted so that a case pays one compile instead of one per op.
naive_tree_attention = jax.jit(hj.naive_tree_attention, static_argnames=('plan', 'scale'))


def assert_close(got: hj.PartialState, expected: hj.PartialState, dtype, name):
  out_atol, lse_atol = TOLERANCE[jnp.dtype(dtype)]
  assert got.out.dtype == expected.out.dtype and got.lse.dtype == jnp.float32
  np.testing.assert_allclose(
      np.asarray(got.out, np.float32), np.asarray(expected.out, np.float32),
      atol=out_atol, rtol=out_atol, err_msg=f'out vs {name}',
  )
  np.testing.assert_allclose(
      np.asarray(got.lse), np.asarray(expected.lse), atol=lse_atol, rtol=lse_atol,
      err_msg=f'lse vs {name}',
  )


# A 3-level tree of 14 rows whose long root and second-level segments span
# several row tiles and kv blocks of TINY_BLOCKS: items wholly inside a segment
# (the unmasked fast path) and items on its edges both occur.
WIDE_TREE = hj.PromptNode(
    300,
    children=(
        hj.PromptNode(129, num_samples=5),
        hj.PromptNode(0, num_samples=3),
        hj.PromptNode(
            7, children=(hj.PromptNode(260, num_samples=4), hj.PromptNode(1, num_samples=2))
        ),
    ),
)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  depth: int  # of a random tree; 0 means WIDE_TREE
  heads: int
  kv_heads: int
  num_queries: int
  dtype: jnp.dtype
  page_size: int
  max_length: int = 40  # longest shared segment of a random tree
  max_fanout: int = 2
  max_samples: int = 2
  block_sizes: tpu.BlockSizes | None = None
  scale: float | None = None
  head_dim: int = H


CASES = [
    Case('depth=1_mha_t=1_f32', 1, 2, 2, 1, jnp.float32, 16, max_samples=3),
    Case('depth=2_gqa_t=1_f32', 2, 4, 2, 1, jnp.float32, 8, max_fanout=3),
    Case('depth=3_mqa_t=3_f32', 3, 4, 1, 3, jnp.float32, 8),
    Case('depth=3_gqa_t=1_bf16', 3, 8, 2, 1, jnp.bfloat16, 16),
    Case('depth=2_mha_t=2_bf16_scale=0.3', 2, 2, 2, 2, jnp.bfloat16, 16, scale=0.3),
    Case(
        'depth=1_gqa_t=3_f32_two_heads_per_block', 1, 8, 4, 3, jnp.float32, 16, max_length=200,
        block_sizes=tpu.BlockSizes(
            block_rows=24, block_kv=128, heads_per_block=2, private_block_kv=32
        ),
    ),
    Case(
        'wide_mha_t=1_f32_tiny_blocks', 0, 2, 2, 1, jnp.float32, 8,
        block_sizes=dataclasses.replace(TINY_BLOCKS, block_rows=8),
    ),
    Case('wide_gqa_t=2_bf16_tiny_blocks', 0, 4, 2, 2, jnp.bfloat16, 8, block_sizes=TINY_BLOCKS),
    # Head dim 64 (Llama 3.2 1B/3B, SmolLM2): two kv heads share each 128 lanes of a block.
    Case('depth=2_gqa_t=2_bf16_h=64', 2, 4, 2, 2, jnp.bfloat16, 8, head_dim=64),
    Case('depth=1_mqa_t=1_f32_h=64', 1, 4, 1, 1, jnp.float32, 16, head_dim=64,
         block_sizes=dataclasses.replace(TINY_BLOCKS, block_rows=8)),
]


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.name)
def test_random_tree_matches_both_oracles(case: Case):
  seed = CASES.index(case)
  rng = np.random.default_rng(seed)
  tree = WIDE_TREE if case.depth == 0 else random_tree(
      rng, case.depth, max_fanout=case.max_fanout, max_length=case.max_length,
      max_samples=case.max_samples,
  )
  plan = paged_plan(
      tree, rng, page_size=case.page_size, num_queries=case.num_queries,
      max_private=3 * case.page_size + 3,
  )
  layout = plan.to_device()
  q, k, v = random_inputs(
      plan, 100 + seed, num_queries=case.num_queries, heads=case.heads,
      kv_heads=case.kv_heads, dtype=case.dtype, head_dim=case.head_dim,
  )
  got = tpu.tree_attention(
      q, k, v, layout, scale=case.scale, interpret=INTERPRET, block_sizes=case.block_sizes
  )
  assert_close(got, hj.tree_attention_xla(q, k, v, layout, scale=case.scale), case.dtype, 'xla')
  assert_close(got, naive_tree_attention(q, k, v, plan, scale=case.scale), case.dtype, 'naive')


@pytest.mark.parametrize(
    'tree,num_queries',
    [
        (hj.PromptNode(37, num_samples=1), 2),
        (hj.PromptNode(0, num_samples=3), 1),
        ((hj.PromptNode(0, num_samples=1), hj.PromptNode(5, num_samples=2)), 1),
    ],
    ids=['batch=1_one_segment_t=2', 'no_shared_tokens_t=1', 'forest_empty_root_t=1'],
)
def test_small_layouts(tree, num_queries):
  plan = hj.plan_tree(tree, private_capacity=11, private_lengths=11)
  layout = plan.to_device()
  q, k, v = random_inputs(
      plan, 7 + num_queries, num_queries=num_queries, heads=4, kv_heads=2,
      dtype=jnp.float32,
  )
  got = tpu.tree_attention(q, k, v, layout, interpret=INTERPRET)
  assert_close(got, hj.tree_attention_xla(q, k, v, layout), jnp.float32, 'xla')
  assert_close(got, naive_tree_attention(q, k, v, plan), jnp.float32, 'naive')


def test_unused_cache_tokens_may_hold_nan():
  """Tokens no row attends (page tails, spare pages, last block padding) never leak in."""
  rng = np.random.default_rng(11)
  tree = hj.PromptNode(
      150, children=(hj.PromptNode(3, num_samples=2), hj.PromptNode(140, num_samples=1))
  )
  plan = paged_plan(tree, rng, page_size=8, num_queries=2, max_private=27)
  q, k, v = random_inputs(
      plan, 12, num_queries=2, heads=4, kv_heads=2, dtype=jnp.float32
  )
  indices, lengths = plan.row_token_indices()
  used = np.zeros(plan.kv_tokens, bool)
  for row, n in zip(indices, lengths):
    used[row[:n]] = True
  assert not used.all()
  k = jnp.where(jnp.asarray(used)[:, None, None], k, jnp.nan)
  v = jnp.where(jnp.asarray(used)[:, None, None], v, jnp.nan)
  got = tpu.tree_attention(q, k, v, plan.to_device(), interpret=INTERPRET, block_sizes=TINY_BLOCKS)
  assert_close(got, naive_tree_attention(q, k, v, plan), jnp.float32, 'naive')


def test_radix_tree_from_tokens_under_jit():
  prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 7], [1, 2, 7, 8, 8], [5, 5]]
  plan = hj.plan_from_tokens(prompts, max_new_tokens=4).plan
  layout = plan.to_device()
  q, k, v = random_inputs(
      plan, 21, num_queries=1, heads=4, kv_heads=4, dtype=jnp.bfloat16
  )
  fn = jax.jit(functools.partial(tpu.tree_attention, interpret=INTERPRET))
  got = fn(q, k, v, layout)
  assert_close(got, hj.tree_attention_xla(q, k, v, layout), jnp.bfloat16, 'xla')
  assert_close(got, naive_tree_attention(q, k, v, plan), jnp.bfloat16, 'naive')


def test_private_kernel_matches_its_reference():
  rng = np.random.default_rng(31)
  bq, t, g, kv_heads, page_size, width = 5, 2, 2, 2, 8, 3
  num_pages = 20
  draw = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  q = draw((bq, t * g, kv_heads, H))
  k_pages = draw((num_pages, page_size, kv_heads, H))
  v_pages = draw((num_pages, page_size, kv_heads, H))
  pages = jnp.asarray(rng.permutation(num_pages)[: bq * width].reshape(bq, width), jnp.int32)
  lengths = jnp.asarray([2, 24, 0, 9, 17], jnp.int32)  # 0: an empty row gives (0, -inf)
  args = (q, k_pages, v_pages, lengths, pages)
  got = private_attention(
      *args, num_queries=t, scale=0.2, pages_per_block=2, rows_per_block=5, heads_per_block=2,
      interpret=INTERPRET,
  )
  reference = jax.jit(private_attention_reference, static_argnames=('num_queries', 'scale'))
  expected = reference(*args, num_queries=t, scale=0.2)
  np.testing.assert_allclose(got[0], expected[0], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got[1], expected[1], atol=2e-5, rtol=2e-5)
  assert np.all(np.asarray(got[1][2]) == -np.inf) and np.all(np.asarray(got[0][2]) == 0)


def test_shared_kernel_matches_its_reference():
  plan = hj.plan_tree(
      hj.PromptNode(
          200,
          children=(
              hj.PromptNode(131, children=(hj.PromptNode(1, num_samples=2),) * 2),
              hj.PromptNode(17, num_samples=3),
          ),
      ),
      private_capacity=1,
  )
  layout = plan.to_device()
  tg, kv_heads, block_rows, block_kv = 2, 2, 8, 128
  num_tiles = -(-plan.num_rows * tg // block_rows)
  rows = num_tiles * block_rows
  work = build_work_list(
      layout, rows_per_query=tg, block_rows=block_rows, block_kv=block_kv, num_tiles=num_tiles,
      kv_tokens=plan.kv_tokens, num_splits=2,
  )
  rng = np.random.default_rng(41)
  draw = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  q = draw((rows, kv_heads, H))
  k = draw((plan.kv_tokens, kv_heads, H))
  v = draw((plan.kv_tokens, kv_heads, H))
  init_out = draw((rows, kv_heads, H))
  init_lse = draw((rows, kv_heads))
  init_lse = init_lse.at[::3].set(-jnp.inf)  # some rows start empty
  init_out = jnp.where(jnp.isfinite(init_lse)[..., None], init_out, 0.0)
  init_lse = jnp.broadcast_to(init_lse[..., None], (rows, kv_heads, LANES))
  args = (q, k, v, init_out, init_lse, work)
  got = shared_attention(
      *args, scale=0.1, block_rows=block_rows, block_kv=block_kv, num_splits=2,
      interpret=INTERPRET,
  )
  expected = jax.jit(shared_attention_reference, static_argnames='scale')(*args, scale=0.1)
  np.testing.assert_allclose(got[0], expected[0], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got[1], expected[1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    'depth,num_splits,seed', [(0, 2, 50), (1, 1, 51), (3, 3, 56)],
    ids=['wide_tree_splits=2', 'depth=1_splits=1', 'depth=3_splits=3'],
)
def test_work_list_covers_each_segment_once(depth, num_splits, seed):
  rng = np.random.default_rng(seed)
  tree = WIDE_TREE if depth == 0 else random_tree(
      rng, depth, max_fanout=3, max_length=300, max_samples=3
  )
  plan = hj.plan_tree(tree, private_capacity=1)
  layout = plan.to_device()
  tg, block_rows, block_kv = {0: (1, 8, 128), 1: (3, 24, 128), 3: (3, 6, 128)}[depth]
  num_tiles = -(-plan.num_rows * tg // block_rows)
  assert num_tiles >= num_splits
  work = jax.tree.map(
      np.asarray,
      build_work_list(
          layout, rows_per_query=tg, block_rows=block_rows, block_kv=block_kv,
          num_tiles=num_tiles, kv_tokens=plan.kv_tokens, num_splits=num_splits,
      ),
  )
  assert (work.flags & FIRST != 0).sum() == num_tiles == (work.flags & LAST != 0).sum()
  firsts = np.flatnonzero(work.flags & FIRST)
  assert np.array_equal(np.sort(work.tile[firsts]), np.arange(num_tiles))
  assert np.all(work.kv_lo[firsts] == work.kv_hi[firsts])  # tile starters attend no keys
  used = (work.flags != 0) | (work.kv_lo < work.kv_hi)  # the unused tail has neither
  for s, part in enumerate(np.split(np.arange(work.tile.size), num_splits)):
    n = int(used[part].sum())
    assert used[part][:n].all() and not used[part][n:].any()  # used items, then the tail
    assert np.all(work.tile[part] % num_splits == s)  # tiles dealt round-robin
    assert np.all(np.diff(work.tile[part][:n]) >= 0)  # sorted by row tile
    assert work.flags[part][n - 1] & LAST  # the tail repeats a finished tile
    assert np.all(work.tile[part][n:] == work.tile[part][n - 1])
  # Every (query-matrix row, token) pair of every segment is in exactly one item.
  rows = num_tiles * block_rows
  count = np.zeros((rows, plan.kv_tokens), np.int32)
  for e in np.flatnonzero(used & (work.kv_lo < work.kv_hi)):
    r = np.arange(work.tile[e] * block_rows, (work.tile[e] + 1) * block_rows)
    c = np.arange(work.kv_block[e] * block_kv, (work.kv_block[e] + 1) * block_kv)
    c = c[c < plan.kv_tokens]
    inside = ((r >= work.row_lo[e]) & (r < work.row_hi[e]))[:, None] & (
        (c >= work.kv_lo[e]) & (c < work.kv_hi[e])
    )[None, :]
    count[np.ix_(r, c)] += inside
  expected = np.zeros_like(count)
  for seg in plan.segments:
    tokens = slice(seg.kv_start, seg.kv_start + seg.kv_length)
    expected[seg.row_begin * tg : seg.row_end * tg, tokens] += 1
  np.testing.assert_array_equal(count, expected)
  if depth == 0:  # the kernel cases on WIDE_TREE exercise both compute paths
    inside = (
        (work.tile * block_rows >= work.row_lo) & ((work.tile + 1) * block_rows <= work.row_hi)
        & (work.kv_block * block_kv >= work.kv_lo) & ((work.kv_block + 1) * block_kv <= work.kv_hi)
    )
    has_keys = work.kv_lo < work.kv_hi
    assert (inside & has_keys).any() and (~inside & has_keys).any()


@pytest.mark.parametrize('kind', ['TPU v5 lite', 'TPU v5p'])
def test_lowers_to_two_mosaic_launches_for_any_depth(kind):
  """The kernels lower to Mosaic for the target chip; a 3-level tree is 2 launches."""
  tree = random_tree(np.random.default_rng(61), 3, max_fanout=3, max_length=700, max_samples=3)
  plan = paged_plan(tree, np.random.default_rng(62), page_size=16, num_queries=2, max_private=40)
  layout = plan.to_device()
  assert len(layout.groups) >= 3
  q = jax.ShapeDtypeStruct((plan.num_rows, 2, 8, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((plan.kv_tokens, 2, H), jnp.bfloat16)
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform='tpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    assert tpu.unsupported_reason(hj.AttentionShapes.of(q, kv), layout) is None
    assert dispatch.device_reason(hj.AttentionImpl.MOSAIC_TPU) is None
    exported = jax.export.export(jax.jit(tpu.tree_attention), platforms=['tpu'])(q, kv, kv, layout)
  module = exported.mlir_module()
  assert module.count('stablehlo.custom_call @tpu_custom_call') == 2
  assert 'hydrajax_private_attention' in module and 'hydrajax_shared_attention' in module


@pytest.mark.parametrize('kind', ['TPU v5 lite', 'TPU v5p'])
def test_training_kernels_lower_to_mosaic(kind):
  """The gradient of the differentiable tree attention with impl=MOSAIC_TPU lowers to Mosaic for
  the target chip at the benchmark shapes (bf16, H = 128, GQA 4:1, 1K completions under an 8K
  prompt cut to 2 rows): every part's forward, dK/dV and dQ kernels."""
  from hydrajax.attention.training import prefill_layout as pl

  layout = pl.plan_prefill([8192], 2, 1024).to_device()
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  q_p, q_c, kv = struct(1, 8192, 32, 128), struct(2, 1024, 32, 128), struct(
      layout.kv_tokens, 8, 128)

  def loss(q_p, q_c, k, v):
    prompt, completion = pl.prefill_attention(q_p, q_c, k, v, layout, impl='mosaic_tpu')
    return jnp.sum(prompt.out.astype(jnp.float32)) + jnp.sum(completion.out.astype(jnp.float32))

  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform='tpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                                 platforms=['tpu'])(q_p, q_c, kv, kv)
  module = exported.mlir_module()
  for name in ('hydrajax_training_forward', 'hydrajax_training_dkv', 'hydrajax_training_dq'):
    assert name in module, name
  # Two parts (the prompt's own causal tokens, the completions' prompt segment and their own
  # causal tokens: three), each a forward, a dK/dV and a dQ launch.
  assert module.count('stablehlo.custom_call @tpu_custom_call') == 9


def _shapes(b=2, t=1, n=4, h=H, length=64, kv_heads=2, dtype=jnp.float32, kv_dtype=None):
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((length, kv_heads, h), kv_dtype or dtype)
  return q, kv


@pytest.mark.parametrize(
    'kwargs,interpret,block_sizes,expected',
    [
        (dict(), None, None, None if ON_TPU else 'need a TPU'),
        (dict(h=64), INTERPRET, None, None),
        (dict(h=64), INTERPRET, tpu.BlockSizes(heads_per_block=1), 'TPU lanes'),
        (dict(dtype=jnp.float16), INTERPRET, None, 'bfloat16 or float32'),
        (dict(kv_dtype=jnp.bfloat16), INTERPRET, None, 'must share a dtype'),
        (dict(length=62), INTERPRET, None, 'multiple of page_size'),
        (dict(), INTERPRET, tpu.BlockSizes(heads_per_block=3), 'must divide K'),
        (dict(), INTERPRET, tpu.BlockSizes(private_heads_per_block=4), 'must divide K'),
        (dict(t=64, n=64), INTERPRET, tpu.BlockSizes(block_rows=4096), 'VMEM'),
        (dict(length=2**22), INTERPRET, tpu.BlockSizes(block_kv=128), 'SMEM'),
        (dict(), INTERPRET, None, None),
        (dict(dtype=jnp.bfloat16), True, None, None),
    ],
    ids=[
        'no_interpret', 'head_dim=64', 'head_dim=64_one_head_a_block', 'float16', 'mixed_dtypes',
        'buffer_not_page_multiple', 'heads_per_block_not_divisor',
        'private_heads_per_block_not_divisor', 'vmem_overflow',
        'smem_overflow', 'supported_f32', 'supported_bf16',
    ],
)
def test_unsupported_reason(kwargs, interpret, block_sizes, expected):
  b = kwargs.pop('b', 2)
  q, kv = _shapes(b=b, **kwargs)
  length = kv.shape[0]
  plan = SharingPlan(
      num_rows=b,
      segments=(Segment(0, length - 16, 0, b),),
      page_size=4,
      private_pages=((length // 4 - 2,), (length // 4 - 1,)),
      private_lengths=(4, 4),
      kv_tokens=length - length % 4,
  )
  reason = dispatch.device_reason(hj.AttentionImpl.MOSAIC_TPU, interpret=bool(interpret))
  reason = reason or tpu.unsupported_reason(
      hj.AttentionShapes.of(q, kv), plan.to_device(), interpret=interpret, config=block_sizes
  )
  if expected is None:
    assert reason is None
  else:
    assert reason is not None and expected in reason


def test_dispatch_picks_the_kernel_only_on_tpu():
  plan = hj.plan_tree(hj.PromptNode(5, num_samples=2), private_capacity=3, private_lengths=3)
  layout = plan.to_device()
  q, k, v = random_inputs(
      plan, 71, num_queries=1, heads=2, kv_heads=2, dtype=jnp.float32
  )
  impl, _ = hj.resolve(hj.AttentionImpl.AUTO, q, k, v, layout)
  if ON_TPU:
    assert impl is hj.AttentionImpl.MOSAIC_TPU
    return
  assert impl is hj.AttentionImpl.XLA
  with pytest.raises(ValueError, match='need a TPU'):
    hj.tree_attention(q, k, v, layout, impl=hj.AttentionImpl.MOSAIC_TPU)
  with pytest.raises(ValueError, match='need a TPU'):
    tpu.tree_attention(q, k, v, layout)


@pytest.mark.parametrize(
    'field,value',
    [
        ('block_rows', 0), ('block_kv', 100), ('heads_per_block', 0), ('private_block_kv', 0),
        ('core_splits', 0), ('private_rows_per_block', 0), ('private_heads_per_block', 0),
        ('lanes_per_block', 64),
    ],
)
def test_block_sizes_reject_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    tpu.BlockSizes(**{field: value})


@pytest.mark.parametrize('device_kind,generation', [
    ('TPU v5 lite', 'v5e'), ('TPU v5e', 'v5e'), ('TPU v5', 'v5p'), ('TPU v5p', 'v5p'),
    ('TPU v6 lite', 'v6e'), ('TPU v6e', 'v6e'),
])
def test_block_sizes_follow_the_tpu_generation(device_kind, generation):
  """libtpu's device kinds ('TPU v5' is a v5p, 'TPU v5 lite' a v5e) pick their row of the
  table, for a device or an abstract mesh's device alike."""
  assert block_sizes.tpu_generation(device_kind) == generation
  device = types.SimpleNamespace(platform='tpu', device_kind=device_kind)
  assert block_sizes.block_sizes_for_device(device) is (
      block_sizes.BLOCK_SIZES_BY_GENERATION[generation])


@pytest.mark.parametrize('platform,device_kind', [
    ('tpu', 'TPU v4'), ('tpu', 'TPU7x'), ('tpu', 'TPU v5 lite pod'), ('cpu', 'cpu'),
    ('gpu', 'NVIDIA H100 80GB HBM3'),
], ids=['v4', 'v7x', 'unknown_v5', 'cpu', 'gpu'])
def test_block_sizes_fall_back_off_the_table(platform, device_kind):
  device = types.SimpleNamespace(platform=platform, device_kind=device_kind)
  assert block_sizes.block_sizes_for_device(device) is block_sizes.FALLBACK_BLOCK_SIZES
  assert block_sizes.block_sizes_for_device(None) is block_sizes.FALLBACK_BLOCK_SIZES


def test_interpret_mode_keeps_the_fallback_block_sizes():
  """Interpret mode runs anywhere: the table (speed on a chip) does not apply to it."""
  assert tpu.default_config(interpret=True) is block_sizes.FALLBACK_BLOCK_SIZES
  assert tpu.DEFAULT_CONFIG is block_sizes.FALLBACK_BLOCK_SIZES
  if not ON_TPU:
    assert tpu.default_config() is block_sizes.FALLBACK_BLOCK_SIZES  # the CPU is no TPU


@pytest.mark.parametrize('generation', sorted(block_sizes.BLOCK_SIZES_BY_GENERATION))
def test_table_entries_fit_the_vmem_check_in_both_dtypes(generation):
  """Each entry's blocks at full size (a batch filling row tiles, a prefix of several kv
  blocks, the decode heads of ROOFLINE.md at head dim 128 and 64) pass the kernel's own
  VMEM/SMEM check in bf16 and f32, so AUTO never falls back to XLA for the chip's defaults."""
  entry = block_sizes.BLOCK_SIZES_BY_GENERATION[generation]
  plan = hj.plan_tree(hj.PromptNode(4 * entry.block_kv, num_samples=entry.block_rows),
                      private_capacity=16)
  layout = plan.to_device()
  for dtype, head_dim in itertools.product((jnp.bfloat16, jnp.float32), (128, 64)):
    shapes = hj.AttentionShapes(plan.num_rows, 1, 32, 8, head_dim, plan.kv_tokens,
                                jnp.dtype(dtype))
    assert tpu.unsupported_reason(shapes, layout, config=entry) is None, (dtype, head_dim)


# The conformance suite every backend passes (tests/tree_attention_conformance.py), through the
# public API: hj.tree_attention(..., impl=MOSAIC_TPU, interpret=True) on a CPU.


class TestMosaicTpu(TreeAttentionConformance):
  impl = hj.AttentionImpl.MOSAIC_TPU
  interpret = not ON_TPU
  head_dim = H
  config = dataclasses.replace(TINY_BLOCKS, block_rows=8)
  cases = (
      ConformanceCase(950, 2, (4, 2), 1, dtype_index=0, max_len=140, max_rows=3),
      ConformanceCase(951, 3, (2, 1), 2, dtype_index=1, max_len=30, max_rows=3),
      ConformanceCase(952, 2, (4, 4), 2, dtype_index=0, max_rows=3, shared=False),  # no segment
  )


@pytest.mark.parametrize('kv_tokens', [256, 264], ids=['layer_on_a_block=256', 'sliced=264'])
def test_kv_offset_with_several_kv_blocks_per_layer(kv_tokens):
  """L > block_kv: a layer starting on a kv block (SMEM block offset) or not (sliced layer)."""
  plan = SharingPlan(
      num_rows=3, segments=(Segment(0, 200, 0, 3), Segment(200, 9, 1, 3, parent=0)),
      page_size=8, private_pages=((27,), (28,), (30,)), private_lengths=(3, 8, 5),
      kv_tokens=kv_tokens,
  )
  q, k, v = random_inputs(plan, 80, num_queries=1, heads=2, kv_heads=2, dtype=jnp.float32)
  nan = jnp.full(k.shape, jnp.nan, k.dtype)
  k_all, v_all = jnp.concatenate([nan, k, nan]), jnp.concatenate([nan, v, nan])
  prepared = hj.prepare_attention(
      plan.to_device(), hj.AttentionShapes.of(q, k), impl='mosaic_tpu', interpret=True,
      config=tpu.BlockSizes(block_rows=8, block_kv=128),
  )
  assert prepared.prepared.kernel_plan.block_kv == 128
  got = hj.attend(q, k_all, v_all, prepared, kv_offset=jnp.int32(kv_tokens))
  assert_close(got, naive_tree_attention(q, k, v, plan), jnp.float32, 'naive')

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_random_tree_matches_both_oracles': ('depth=3_mqa_t=3_f32', 'wide_gqa_t=2_bf16_tiny_blocks', 'depth=2_gqa_t=2_bf16_h=64'),
    'test_small_layouts': ('forest_empty_root_t=1',),
    'test_kv_offset_with_several_kv_blocks_per_layer': ('sliced=264',),
}
