"""Tests of the Pallas Mosaic GPU tree-attention kernels.

`TestMosaicGpuKernels` runs every case compiled on a Hopper GPU (skipped
elsewhere); `TestMosaicGpuKernelsInterpret` runs the same cases on CPU in
Mosaic GPU interpret mode with small shapes (what CI runs). Both compare with
`tree_attention_xla` and with the naive oracle, and each kernel with its jnp
`*_reference` (same arguments). Interpret mode cannot feed
wgmma from registers, so there the kernels stage P through shared memory;
everything else (TMA, barriers, warp specialisation, masking, merges) is the
code that runs on the GPU.
"""

import dataclasses
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax
from hydrajax import devices
from hydrajax.attention import dispatch
from hydrajax import PromptNode
from pallas_kernels.knobs import config_from_knobs
from pallas_kernels.mosaic_gpu import schedule
from pallas_kernels.mosaic_gpu import tree_attention as mosaic
from pallas_kernels.mosaic_gpu.paged_decode import paged_attention, paged_attention_reference
from pallas_kernels.mosaic_gpu.paged_decode import unfold_states as paged_unfold_states
from pallas_kernels.mosaic_gpu.private_attention import (
    private_attention, private_attention_reference,
)
from pallas_kernels.mosaic_gpu.private_problem import lane_table
from pallas_kernels.mosaic_gpu.private_problem import unfold_states as private_unfold_states
from pallas_kernels.mosaic_gpu.segment_attention import (
    OVERLAP_MIN_BLOCKS, SegmentKernelConfig, as_folded, overlaps, pack_segments,
    segment_attention, segment_attention_reference,
)
from tests.conftest import fresh_rng

ON_HOPPER = mosaic._hopper_reason() is None
TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3}  # out, absolute and relative
LSE_TOLERANCE = 5e-3


def _tree(name: str, capacity: int, lengths):
  """Sharing plans; `capacity` (the private page) is a multiple of 8 as the kernels need."""
  trees = {
      # batch 1: one shared segment (not a multiple of 8 tokens long) and a private suffix
      'batch1': PromptNode(37, num_samples=1),
      # two levels; one child segment is empty; kv starts that are not 8-aligned
      'two_level': PromptNode(
          37, children=(PromptNode(100, num_samples=3), PromptNode(0, num_samples=2))
      ),
      # three levels, variable fan-out, lengths past one kv block
      'deep': PromptNode(21, children=(
          PromptNode(70, children=(PromptNode(9, num_samples=2), PromptNode(150, num_samples=1))),
          PromptNode(5, num_samples=2),
      )),
      # a forest: two independent sharing groups
      'forest': (PromptNode(40, num_samples=2), PromptNode(75, num_samples=3)),
      # many rows under segments of uneven widths (frames of several rows cross segments)
      'wide': PromptNode(19, children=(
          PromptNode(33, num_samples=3), PromptNode(8, children=(
              PromptNode(12, num_samples=5), PromptNode(0, num_samples=1),
          )), PromptNode(64, num_samples=7),
      )),
      # nothing shared: private attention only
      'private_only': PromptNode(0, num_samples=3),
  }
  root = trees[name]
  rows = sum(_leaves(r) for r in (root if isinstance(root, tuple) else (root,)))
  lengths = [lengths[i % len(lengths)] for i in range(rows)]
  return hydrajax.plan_tree(root, private_capacity=capacity, private_lengths=lengths)


def _leaves(node: PromptNode) -> int:
  return sum(_leaves(c) for c in node.children) if node.children else node.num_samples


def _inputs(plan, *, t, n, k, h, dtype, seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (plan.num_rows, t, n, h), jnp.float32).astype(dtype)
  kc = jax.random.normal(keys[1], (plan.kv_tokens, k, h), jnp.float32).astype(dtype)
  vc = jax.random.normal(keys[2], (plan.kv_tokens, k, h), jnp.float32).astype(dtype)
  return q, kc, vc


def _assert_states_close(got, want, dtype):
  tol = TOLERANCE[dtype]
  got_lse, want_lse = np.asarray(got.lse), np.asarray(want.lse)
  np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=LSE_TOLERANCE, rtol=0)
  np.testing.assert_allclose(
      np.asarray(got.out, np.float32), np.asarray(want.out, np.float32), atol=tol, rtol=tol
  )
  assert not np.isnan(np.asarray(got.out, np.float32)).any()


CASES = [  # (tree, query tokens T, query heads N, kv heads K, private lengths)
    ('batch1', 1, 4, 1, (3,)),  # MQA
    ('two_level', 1, 4, 2, (5, 16, 3, 9, 1)),  # GQA
    ('two_level', 3, 2, 2, (5, 16, 3, 9, 7)),  # MHA, T > 1 (causal in the private region)
    ('deep', 1, 4, 2, (0, 12, 16, 1, 8)),  # an empty private region
    ('deep', 4, 4, 1, (4, 16, 9, 13, 5)),  # MQA, T > 1
    ('forest', 1, 8, 2, (2, 11, 16)),
    ('private_only', 2, 4, 2, (2, 16, 7)),
    ('two_level', 1, 4, 4, (6, 1, 13, 2, 8)),  # MHA, T = 1: out in [B, T, N, H], lse folded
    ('forest', 2, 8, 2, (3, 14, 9)),  # T*G = 8: out and lse written in [B, T, N] order
]


PACKED_CASES = [
    ('wide', 1, 4, 2, (1, 3, 9, 0, 2, 16, 5)),  # 4 rows per frame; segment boundaries inside frames
    ('wide', 2, 6, 2, (2, 40, 7)),  # T*G = 6 padded to 8
    ('two_level', 40, 4, 2, (41, 50, 72)),  # T*G = 80 -> 128: two frames per row, causal
]


LONG_LENGTHS = (64, 65, 127, 128, 129, 200)  # whole 64-token steps of one row, and past them

LONG_CASES = [  # (page size, query tokens T, query heads N, kv heads K, num_sms, private lengths)
    # rows of 64..200 tokens after a 3-token row: their fast steps start mid-page and cross
    # into the next page, which follows (contiguous, one copy) or not (8 copies)
    (64, 1, 8, 2, None, (3, *LONG_LENGTHS)),  # GQA 4:1, 2 rows per frame
    (128, 1, 8, 1, 1, (1, 129, 64, 200, 3, 65, 128, 127)),  # MQA, one frame of 8 rows
    (16, 2, 8, 2, 1, (200, 5, *LONG_LENGTHS)),  # pages below a step: fast steps over 4-5 pages
    (64, 2, 8, 1, None, (*LONG_LENGTHS, 9)),  # MQA, T = 2: one row per frame
    (128, 2, 8, 2, None, (129, 2, 200, 64, 127)),
    (16, 1, 8, 1, None, (65, 128, 2, 200)),
]


def _long_rows_plan(page: int, lengths, *, prefix: int = 19):
  """One shared prefix of `prefix` tokens, then each row's private tokens over pages of `page`
  tokens: the pages of even rows follow one another, those of odd rows run backwards (a step
  that crosses a page boundary is one copy only in even rows)."""
  base = hydrajax.plan_tree(PromptNode(prefix, num_samples=len(lengths)), private_capacity=page)
  first = -(-base.shared_tokens() // page)
  pages, next_page = [], first
  for b, n in enumerate(lengths):
    count = max(1, -(-n // page))
    row = list(range(next_page, next_page + count))
    pages.append(tuple(row if b % 2 == 0 else row[::-1]))
    next_page += count
  return hydrajax.SharingPlan(
      len(lengths), base.segments, page, tuple(pages), tuple(lengths), next_page * page
  )


def _long_case_id(case):
  page, t, n, k, sms, _ = case
  return f'page={page}_T={t}_heads={n}/{k}_sms={sms}'


def _flat_buffer(plan, kc, vc, *, layers: int, layer: int, dirty: bool):
  """The layer's caches at `layer` of a flat [layers * L', K, H] buffer (L' = L rounded up to
  a page), and its offset. `dirty`: every slot no row attends (the other layers, padding,
  unwritten private slots, gaps) holds NaN, inf or -inf; else zeros."""
  stride = schedule.round_up(plan.kv_tokens, plan.page_size)
  offset = layer * stride
  attended = np.zeros(plan.kv_tokens, bool)
  indices, lengths = plan.row_token_indices()
  for row, n in enumerate(lengths):
    attended[indices[row, :n]] = True
  tokens = np.nonzero(attended)[0]
  flat = []
  for cache in (kc, vc):
    if dirty:
      junk = np.array([np.nan, np.inf, -np.inf], np.float32)[np.arange(layers * stride) % 3]
      base = np.broadcast_to(junk[:, None, None], (layers * stride,) + cache.shape[1:])
    else:
      base = np.zeros((layers * stride,) + cache.shape[1:], np.float32)
    buf = jnp.asarray(base, cache.dtype).at[offset + tokens].set(cache[tokens])
    flat.append(buf)
  return (*flat, offset)


def _case_id(case):
  tree, t, n, k, _ = case
  return f'{tree}_T={t}_heads={n}/{k}'


class TestMosaicGpuKernels:
  """Compiled on a Hopper GPU."""

  interpret = False
  head_dim = 128
  capacity = 72  # private tokens per row: two 64-token blocks, the second partial

  @pytest.fixture(autouse=True)
  def _need_hopper(self):
    if not self.interpret and not ON_HOPPER:
      pytest.skip(f'compiled Mosaic GPU kernels need a Hopper GPU: {mosaic._hopper_reason()}')

  def _run(self, q, kc, vc, layout, **kw):
    return mosaic.tree_attention(q, kc, vc, layout, interpret=self.interpret, block_kv=64, **kw)

  def _attend(self, q, kc, vc, layout, *, kv_offset, num_sms=None, **knobs):
    shapes = mosaic.KernelShapes.of(q, kc)
    config = mosaic.MosaicGpuConfig(block_kv=64, num_sms=num_sms, **knobs)
    prepared = mosaic.prepare(layout, shapes, config, interpret=self.interpret)
    return mosaic.attend(
        q, kc, vc, prepared, shapes=shapes, config=config, kv_offset=kv_offset,
        interpret=self.interpret,
    )

  @pytest.mark.parametrize('tree', ['deep', 'private_only'])
  def test_layer_offset_and_garbage_elsewhere(self, tree):
    """prepare once, attend at a layer's offset in a flat 3-layer buffer: the same result as
    the layer alone, also when every slot no row attends holds NaN, inf or -inf (partial
    blocks and chunks, unwritten private slots, the other layers)."""
    t = 2
    lengths = [min(x + t - 1, self.capacity) for x in (4, 16, 9, 70, 5)]
    plan = _tree(tree, self.capacity, lengths)
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=4, k=2, h=self.head_dim, dtype=jnp.bfloat16, seed=21)
    want = self._run(q, kc, vc, layout)
    _assert_states_close(want, hydrajax.tree_attention_xla(q, kc, vc, layout), jnp.bfloat16)
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=3, layer=1, dirty=True)
    got = self._attend(q, fk, fv, layout, kv_offset=jnp.int32(offset))  # traced offset
    np.testing.assert_array_equal(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32))
    np.testing.assert_array_equal(np.asarray(got.lse), np.asarray(want.lse))

  def test_step_plan_is_the_per_call_table(self):
    """`for_step` builds the lane table once for a step's layers: attend over the step plan is
    bitwise attend building the table itself, and builds none; `with_private_lengths` drops
    the table, so new lengths never meet an old table."""
    rng = fresh_rng()
    plan = _tree('deep', self.capacity, rng.integers(0, self.capacity + 1, 7).tolist())
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=1, n=4, k=2, h=self.head_dim, dtype=jnp.bfloat16,
                        seed=int(rng.integers(2**31)))
    shapes, config = mosaic.KernelShapes.of(q, kc), mosaic.MosaicGpuConfig(block_kv=64)
    prepared = mosaic.prepare(layout, shapes, config, interpret=self.interpret)
    attend = lambda p: mosaic.attend(q, kc, vc, p, shapes=shapes, config=config,
                                     interpret=self.interpret)
    step = mosaic.for_step(prepared)
    assert prepared.lanes is None and step.lanes is not None
    assert mosaic.for_step(step) is step
    cumsums = lambda p: str(jax.make_jaxpr(attend)(p)).count('cumsum')
    assert cumsums(prepared) > 0 and cumsums(step) == 0  # the table, only where not prepared
    for got, want in zip(attend(step), attend(prepared)):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    other = rng.integers(0, self.capacity + 1, plan.num_rows).tolist()
    swapped = mosaic.with_private_lengths(step, jnp.asarray(other, jnp.int32))
    assert swapped.lanes is None
    fresh = _tree('deep', self.capacity, other)
    assert fresh.private_pages == plan.private_pages
    want = attend(mosaic.prepare(fresh.to_device(), shapes, config, interpret=self.interpret))
    for got, want_ in zip(attend(mosaic.for_step(swapped)), want):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want_, np.float32))
    _assert_states_close(want, hydrajax.tree_attention_xla(q, kc, vc, fresh.to_device()),
                         jnp.bfloat16)

  @pytest.mark.parametrize('case', CASES, ids=_case_id)
  def test_matches_xla_and_oracle(self, case):
    tree, t, n, k, lengths = case
    lengths = [min(x + t - 1, self.capacity) for x in lengths]  # private_lengths >= T
    plan = _tree(tree, self.capacity, lengths)
    layout = plan.to_device()
    seed = CASES.index(case)
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16, seed=seed)
    got = self._run(q, kc, vc, layout)
    assert got.out.shape == q.shape and got.out.dtype == q.dtype and got.lse.shape == q.shape[:3]
    _assert_states_close(got, hydrajax.tree_attention_xla(q, kc, vc, layout), jnp.bfloat16)
    _assert_states_close(got, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)

  def test_float16_with_scale(self):
    plan = _tree('two_level', self.capacity, (4, 9))
    q, kc, vc = _inputs(plan, t=1, n=4, k=2, h=self.head_dim, dtype=jnp.float16, seed=11)
    got = self._run(q, kc, vc, plan.to_device(), scale=0.05)
    want = hydrajax.naive_tree_attention(q, kc, vc, plan, scale=0.05)
    _assert_states_close(got, want, jnp.float16)

  @pytest.mark.parametrize('case', LONG_CASES, ids=_long_case_id)
  def test_long_rows(self, case):
    """Private rows of 64..200 tokens (the private kernel's one-row fast steps, the steps
    around them that mix rows or end a row) at a layer offset in a buffer whose every
    unattended slot is NaN/inf: bitwise equal to the clean buffer, close to XLA and the oracle."""
    page, t, n, k, sms, lengths = case
    plan = _long_rows_plan(page, lengths)
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16,
                        seed=60 + LONG_CASES.index(case))
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=False)
    got = self._attend(q, fk, fv, layout, kv_offset=jnp.int32(offset), num_sms=sms)
    _assert_states_close(got, hydrajax.tree_attention_xla(q, kc, vc, layout), jnp.bfloat16)
    _assert_states_close(got, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=True)
    dirty = self._attend(q, fk, fv, layout, kv_offset=jnp.int32(offset), num_sms=sms)
    as_f32 = lambda x: np.asarray(x, np.float32)
    np.testing.assert_array_equal(as_f32(dirty.out), as_f32(got.out))
    np.testing.assert_array_equal(np.asarray(dirty.lse), np.asarray(got.lse))

  @pytest.mark.parametrize('knobs', [dict(private_slots=4), dict(private_lane_table=False)],
                           ids=['slots=4', 'lane_walk'])
  @pytest.mark.parametrize('page', [16, 64])
  def test_private_knobs_change_nothing(self, knobs, page):
    """The private kernel's knobs change only how K/V and page ids reach shared memory: its
    states are bitwise the default's, with NaN/inf in every unattended slot. Decode-like rows
    of 1-17 tokens (two chunks of one page; odd rows' pages run backwards, so a row
    past a page has chunks that do not follow) and a long row (64-token pages: its one-row
    steps read two page ids), in one frame (3 steps, fewer than 4 slots)."""
    plan = _long_rows_plan(page, (9, 9, 16, 3, 17, 9, 70, 1))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=1, n=8, k=2, h=self.head_dim, dtype=jnp.bfloat16, seed=90)
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=True)
    attend = functools.partial(self._attend, q, fk, fv, layout, kv_offset=jnp.int32(offset),
                               num_sms=1)
    want, got = attend(), attend(**knobs)
    _assert_states_close(want, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32))
    np.testing.assert_array_equal(np.asarray(got.lse), np.asarray(want.lse))

  @pytest.mark.parametrize('t, n, k', [(1, 8, 8), (1, 32, 8), (1, 64, 8), (2, 16, 8),
                                       (2, 32, 8), (1, 24, 8), (1, 16, 16), (1, 16, 4),
                                       (2, 16, 4), (1, 12, 4), (1, 16, 2), (3, 8, 2)],
                           ids=['MHA', 'G=4', 'G=8', 'G=2_T=2', 'G=4_T=2', 'G=3_padded',
                                'two_head_blocks', 'K=4_G=4', 'K=4_G=4_T=2', 'K=4_G=3_padded',
                                'K=2_G=8', 'K=2_G=4_T=3'])
  def test_token_lanes(self, t, n, k):
    """Token lanes (`private_token_lanes`: a lane is 8/h tokens of h = min(K, 8) kv heads, a
    program h kv heads' rows of 64/h folded rows) over 16 rows of 0-70 private tokens, new
    lengths each run,
    under segments of uneven widths (frames cross them), at a layer offset in a buffer whose
    every unattended slot is NaN/inf: bitwise the clean buffer's states, close to the oracle
    and to chunk lanes (their blocks differ, so their sums round differently)."""
    rng = fresh_rng()
    lengths = rng.integers(t, self.capacity + 1, 16)
    lengths[rng.integers(16)] = t  # one row of T tokens, and at T = 1 one empty row
    if t == 1:
      lengths[rng.integers(16)] = 0
    plan = _tree('wide', self.capacity, lengths.tolist())
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16,
                        seed=int(rng.integers(1 << 30)))
    shapes = mosaic.KernelShapes.of(q, kc)
    config = mosaic.MosaicGpuConfig(block_kv=64, private_token_lanes=True)
    problem = mosaic.prepare(layout, shapes, config, interpret=self.interpret).problem
    assert problem.lane_heads == min(k, 8)
    got = {}
    for dirty in (False, True):
      fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=dirty)
      got[dirty] = self._attend(q, fk, fv, layout, kv_offset=jnp.int32(offset),
                                private_token_lanes=True)
    np.testing.assert_array_equal(np.asarray(got[True].out, np.float32),
                                  np.asarray(got[False].out, np.float32))
    np.testing.assert_array_equal(np.asarray(got[True].lse), np.asarray(got[False].lse))
    _assert_states_close(got[True], hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    _assert_states_close(got[True], self._run(q, kc, vc, layout), jnp.bfloat16)

  def test_unguarded_private_steps_on_a_finite_cache(self):
    """`private_zero_unseen=False` leaves stale V rows of partial chunks in place: on a cache
    whose unattended slots are finite (zeros) the states are bitwise the guarded kernel's."""
    plan = _long_rows_plan(16, (9, 9, 16, 3, 17, 9, 70, 1))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=1, n=8, k=2, h=self.head_dim, dtype=jnp.bfloat16, seed=91)
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=False)
    attend = functools.partial(self._attend, q, fk, fv, layout, kv_offset=jnp.int32(offset),
                               num_sms=1)
    want, got = attend(), attend(private_zero_unseen=False)
    _assert_states_close(want, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32))
    np.testing.assert_array_equal(np.asarray(got.lse), np.asarray(want.lse))

  @pytest.mark.parametrize('knobs', [dict(shared_overlap=True)], ids=['overlap'])
  @pytest.mark.parametrize('block_kv', [64, 128])
  def test_shared_schedules_change_nothing(self, knobs, block_kv):
    """The shared kernel's overlapped schedule (PV under the next block's softmax, one-sided
    turns) reorders when products are issued, not the arithmetic, with NaN/inf in every
    unattended slot, over segments of 0-150 tokens from unaligned starts (masked first and
    last blocks, one-block and empty segments). Not bitwise: the compiler may contract l's
    multiply-add into an fma in one schedule and not the other (H200: lse 1 ulp apart)."""
    if self.interpret:
      pytest.skip('interpret mode runs the single-warpgroup shared kernel, which has one '
                  'schedule; the compiled class runs this test')
    plan = _tree('deep', self.capacity, (4, 16, 9, 70, 5))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=2, n=8, k=2, h=self.head_dim, dtype=jnp.bfloat16,
                        seed=int(fresh_rng().integers(1 << 30)))
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=True)
    shapes = mosaic.KernelShapes.of(q, fk)

    def attend(**kw):
      config = mosaic.MosaicGpuConfig(block_kv=block_kv, **kw)
      prepared = mosaic.prepare(layout, shapes, config)
      return mosaic.attend(q, fk, fv, prepared, shapes=shapes, config=config,
                           kv_offset=jnp.int32(offset))

    want, got = attend(shared_overlap=False), attend(**knobs)
    _assert_states_close(want, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    got_lse, want_lse = np.asarray(got.lse), np.asarray(want.lse)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[seen], want_lse[seen], rtol=1e-6, atol=0)
    got_out, want_out = np.asarray(got.out, np.float32), np.asarray(want.out, np.float32)
    assert np.isfinite(got_out).all()
    np.testing.assert_allclose(got_out, want_out, rtol=2**-7, atol=1e-6)  # one bf16 ulp

  @pytest.mark.parametrize('n, k', [(3, 3)], ids=['G=1'])
  @pytest.mark.parametrize('t', [1, 2])
  def test_q_read_by_row_is_the_fold(self, t, n, k):
    """The kernels read q's [B*T, K, H] view (G = 1) in place (`q_by_row`); the states are
    bitwise those of the folded copy, with NaN/inf in every unattended slot, over 16 rows under segments of uneven widths
    (one 64-row tile: its rows past the batch read zeros)."""
    lengths = [min(x + t - 1, self.capacity) for x in (4, 16, 9, 70, 5, 1, 33, 8) * 2]
    plan = _tree('wide', self.capacity, lengths)
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16,
                        seed=int(fresh_rng().integers(1 << 30)))
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=True)
    attend = functools.partial(self._attend, q, fk, fv, layout, kv_offset=jnp.int32(offset),
                               num_sms=1)
    config = mosaic.MosaicGpuConfig(block_kv=64, num_sms=1)
    prepared = mosaic.prepare(layout, mosaic.KernelShapes.of(q, fk), config,
                              interpret=self.interpret)
    assert prepared.problem.q_by_row  # the in-place read is what this compares
    by_row, fold = attend(), attend(q_by_row=False)
    _assert_states_close(by_row, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(by_row.out, np.float32),
                                  np.asarray(fold.out, np.float32))
    np.testing.assert_array_equal(np.asarray(by_row.lse), np.asarray(fold.lse))

  @pytest.mark.parametrize('case', PACKED_CASES, ids=_case_id)
  def test_packed_frames(self, case):
    """One program per 64 folded rows (num_sms=1): several rows per frame, runs of rows under
    different segments inside one frame, and (T*G > 64) one row over several frames."""
    tree, t, n, k, lengths = case
    lengths = [min(x + t - 1, self.capacity) for x in lengths]
    plan = _tree(tree, self.capacity, lengths)
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16, seed=40 + t)
    got = self._run(q, kc, vc, layout, num_sms=1)
    _assert_states_close(got, hydrajax.naive_tree_attention(q, kc, vc, plan), jnp.bfloat16)
    walked = self._run(q, kc, vc, layout, num_sms=1, private_lane_table=False)  # plans walked
    np.testing.assert_array_equal(np.asarray(walked.out, np.float32), np.asarray(got.out, np.float32))
    np.testing.assert_array_equal(np.asarray(walked.lse), np.asarray(got.lse))

  def test_all_empty_is_zero_and_neg_inf(self):
    """No shared segments and no private tokens: every state is (0, -inf), no NaN."""
    plan = _tree('private_only', self.capacity, (0,))
    q, kc, vc = _inputs(plan, t=1, n=2, k=1, h=self.head_dim, dtype=jnp.bfloat16, seed=12)
    got = self._run(q, kc, vc, plan.to_device())
    np.testing.assert_array_equal(np.asarray(got.out, np.float32), 0.0)
    assert np.isneginf(np.asarray(got.lse)).all()

  def test_many_splits_merge_like_one(self):
    """Splitting every segment's kv into many parts (as for small batches) changes nothing."""
    plan = _tree('deep', self.capacity, (5, 3))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=1, n=4, k=2, h=self.head_dim, dtype=jnp.bfloat16, seed=13)
    many = self._run(q, kc, vc, layout, num_sms=10_000, max_splits=4)
    one = self._run(q, kc, vc, layout, num_sms=1)
    _assert_states_close(many, one, jnp.bfloat16)
    _assert_states_close(many, hydrajax.tree_attention_xla(q, kc, vc, layout), jnp.bfloat16)

  def test_segment_kernel_partials(self):
    """The shared kernel alone, item by item, against its jnp reference."""
    plan = _tree('two_level', self.capacity, (1,))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=1, n=4, k=2, h=self.head_dim, dtype=jnp.bfloat16, seed=14)
    tg = 2
    qf = mosaic._fold_queries(q, 2, tg, schedule.round_up(plan.num_rows * tg + schedule.TILE_M, 8))
    sched = schedule.shared_schedule(
        layout, rows_per_query=tg, num_kv_heads=2, block_kv=64, num_sms=8, max_splits=2
    )
    scale = self.head_dim**-0.5
    config = mosaic.SegmentKernelConfig(block_kv=64)
    segments = pack_segments(layout.groups)
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=True)
    args = (qf, fk, fv, segments, sched)
    kw = dict(scale=scale, config=config, kv_offset=offset, interpret=self.interpret)
    out, lse = segment_attention(*args, **kw)
    want_out, want_lse = segment_attention_reference(*args, **kw)
    for group, gs in zip(layout.groups, sched.groups):
      for j in range(gs.num_segments):
        first = int(group.row_begin[j]) * tg
        for split in range(gs.num_splits):
          item = gs.item_offset + (j * gs.num_splits + split) * gs.row_tiles
          base = schedule.PARTIAL_PAD + item * schedule.TILE_M
          rows = base + first % 8 + np.arange(int(group.row_count[j]) * tg)
          _assert_states_close(
              hydrajax.PartialState(out[:, rows], lse[:, rows]),
              hydrajax.PartialState(want_out[:, rows], want_lse[:, rows]),
              jnp.bfloat16,
          )


  @pytest.mark.parametrize('tree,n', [('wide', 4), ('deep', 8)])
  def test_private_kernel_matches_reference(self, tree, n):
    """The private+merge kernel alone against its jnp reference, on the shared kernel's
    partial states: several rows per frame, segment boundaries inside frames, an offset; the
    output in [B, T, N, H] order with a last frame past the batch (lse too for G = 4)."""
    t, k = 1, 2
    plan = _tree(tree, self.capacity, (1, 3, 9, 0, 2, 16, 5))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16, seed=15)
    shapes = mosaic.KernelShapes.of(q, kc)
    prepared = mosaic.prepare(layout, shapes, mosaic.MosaicGpuConfig(block_kv=64, num_sms=1))
    problem = prepared.problem
    assert problem.rows_per_frame > 1
    tgp = problem.rows_per_query
    rows = schedule.round_up(problem.num_frames * problem.frame_rows + schedule.TILE_M, 8)
    qf = mosaic._fold_queries(q, k, tgp, rows)
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=False)
    scale = self.head_dim**-0.5
    partial = segment_attention(
        qf, fk, fv, prepared.segments, prepared.schedule, scale=scale,
        config=mosaic.SegmentKernelConfig(block_kv=64), kv_offset=offset, interpret=self.interpret,
    )
    args = (qf, fk, fv, layout.private_pages, layout.private_lengths, layout.row_segments,
            prepared.segments, prepared.schedule, *partial, problem)
    kw = dict(scale=scale, kv_offset=offset, interpret=self.interpret)
    assert problem.direct_out and problem.direct_lse == (n // k == 4)
    assert (plan.num_rows * tgp) % problem.frame_rows  # the last frame runs past the batch
    lanes = lane_table(layout.private_lengths, prepared.private_pages, problem)
    got = private_attention(*args[:3], prepared.private_pages, *args[4:], lanes=lanes, **kw)
    want = private_attention_reference(*args, lanes=lanes, **kw)
    assert [x.shape for x in got] == [x.shape for x in want]
    _assert_states_close(
        hydrajax.PartialState(*private_unfold_states(*got, problem, n)),
        hydrajax.PartialState(*private_unfold_states(*want, problem, n)), jnp.bfloat16,
    )

  def test_paged_kernel_matches_reference(self):
    """The paged-decode kernel alone against its jnp reference (T = 3, causal), at an offset."""
    t, n, k = 3, 4, 2
    plan = _tree('private_only', self.capacity, (3, 72, 40))
    layout = plan.to_device()
    q, kc, vc = _inputs(plan, t=t, n=n, k=k, h=self.head_dim, dtype=jnp.bfloat16, seed=16)
    prepared = mosaic.prepare(layout, mosaic.KernelShapes.of(q, kc))
    problem = prepared.problem
    tg = problem.rows_per_query
    qf = mosaic._fold_queries(q, k, tg, schedule.round_up(plan.num_rows * tg + schedule.TILE_M, 8))
    fk, fv, offset = _flat_buffer(plan, kc, vc, layers=2, layer=1, dirty=False)
    args = (qf, fk, fv, layout.private_pages, layout.private_lengths, problem)
    kw = dict(scale=0.1, kv_offset=offset, interpret=self.interpret)
    assert problem.direct
    got = paged_attention(*args, **kw)
    want = paged_attention_reference(*args, **kw)
    assert [x.shape for x in got] == [x.shape for x in want]
    _assert_states_close(
        hydrajax.PartialState(*paged_unfold_states(*got, problem, n)),
        hydrajax.PartialState(*paged_unfold_states(*want, problem, n)), jnp.bfloat16,
    )


class TestMosaicGpuKernelsInterpret(TestMosaicGpuKernels):
  """The same cases in Mosaic GPU interpret mode on CPU, with small shapes; of the many-case
  tests, the `representative_cases` (conftest): each kv-head fold, T > 1, padded rows, each
  knob."""

  interpret = True
  head_dim = 64
  representative_cases = {
      'test_matches_xla_and_oracle': ('batch1_T=1_heads=4/1', 'two_level_T=3_heads=2/2'),
      'test_long_rows': ('page=16_T=2_heads=8/2_sms=1',),
      'test_private_knobs_change_nothing': ('64-slots=4',),
      'test_token_lanes': (),
      'test_q_read_by_row_is_the_fold': (),
      'test_packed_frames': ('wide_T=1_heads=4/2',),
      'test_step_plan_is_the_per_call_table': (),
      'test_many_splits_merge_like_one': (),
      'test_layer_offset_and_garbage_elsewhere': ('deep',),
  }


class TestSupportAndSchedule:
  """What AUTO needs to fall back, and the static work decomposition (no kernels run)."""

  representative_cases = {
      'test_lane_table_is_the_kernels_chunk_walk': ('99-1-4-16-1', '37-2-4-8-8', '40-3-2-8-2'),
      'test_one_lane_table_serves_every_layer': (),
  }

  @pytest.mark.parametrize('t', [1, 3])
  def test_by_row_view_folds_like_the_fold(self, t):
    """`as_folded` of q's by-row view ([B*T, K, H], read in place at G = 1; what the references
    take for `q_by_row`) is the fold the kernels otherwise read."""
    b, kh, h = 5, 2, 8
    q = jax.random.normal(jax.random.key(t), (b, t, kh, h), jnp.float32)
    want = mosaic._fold_queries(q, kh, t, b * t)
    np.testing.assert_array_equal(np.asarray(as_folded(q.reshape(b * t, kh, h), True)),
                                  np.asarray(want))

  def _args(self, dtype=jnp.bfloat16, h=128, capacity=16):
    plan = _tree('two_level', capacity, (3,))
    q, kc, vc = _inputs(plan, t=1, n=4, k=2, h=h, dtype=dtype, seed=0)
    return q, kc, vc, plan.to_device()

  def _reason(self, q, kc, vc, layout):
    return mosaic.unsupported_reason(mosaic.KernelShapes.of(q, kc), layout, interpret=True)

  def test_unsupported_reasons(self):
    q, kc, vc, layout = self._args()
    assert self._reason(q, kc, vc, layout) is None
    no_paths = dataclasses.replace(layout, row_segments=None)
    assert 'row_segments' in self._reason(q, kc, vc, no_paths)
    assert 'float32' in self._reason(*self._args(dtype=jnp.float32))
    assert 'head dim 96' in self._reason(*self._args(h=96))
    assert 'page size 20' in self._reason(*self._args(capacity=20))
    assert 'L=204' in self._reason(*self._args(capacity=12))
    assert 'share one dtype' in self._reason(q, kc.astype(jnp.float16), vc, layout)

  def test_auto_runs_mixed_dtypes_on_xla(self, monkeypatch):
    # On a Hopper GPU (as it were) AUTO must not pick the kernels for q and caches of two
    # dtypes, which `attend` would then refuse: XLA takes them.
    monkeypatch.setattr(dispatch, '_warned', set())
    monkeypatch.setattr(dispatch, 'default_kernel', lambda: hydrajax.AttentionImpl.MOSAIC_GPU)
    monkeypatch.setattr(devices, 'hopper_reason', lambda: None)
    q, kc, vc, layout = self._args()
    kc, vc = kc.astype(jnp.float32), vc.astype(jnp.float32)
    with pytest.warns(hydrajax.AttentionFallbackWarning, match='must share one dtype'):
      plan = hydrajax.prepare_attention(layout, hydrajax.AttentionShapes.of(q, kc))
    assert plan.impl is hydrajax.AttentionImpl.XLA
    out = hydrajax.attend(q, kc, vc, plan)
    _assert_states_close(out, hydrajax.tree_attention_xla(q, kc, vc, layout), jnp.bfloat16)

  def test_prepare_packs_on_the_host_once(self):
    """The segment table is one concrete array and the schedule static: nothing of the
    layout is left to compute per layer."""
    q, kc, vc, layout = self._args()
    prepared = mosaic.prepare(layout, mosaic.KernelShapes.of(q, kc))
    np.testing.assert_array_equal(
        np.asarray(prepared.segments),
        np.stack([np.concatenate([np.asarray(getattr(g, f)) for g in layout.groups])
                  for f in ('kv_start', 'kv_length', 'row_begin', 'row_count')]),
    )
    leaves = jax.tree_util.tree_leaves(prepared)
    assert all(isinstance(x, jax.Array) for x in leaves) and len(leaves) == 4
    assert prepared.schedule.num_splits >= 1 and prepared.problem.frame_rows % 8 == 0

  def test_attend_errors_name_the_argument(self):
    q, kc, vc, layout = self._args()
    shapes = mosaic.KernelShapes.of(q, kc)
    prepared = mosaic.prepare(layout, shapes)
    attend = lambda q, k, v, **kw: mosaic.attend(
        q, k, v, prepared, shapes=shapes, interpret=True, **kw
    )
    with pytest.raises(ValueError, match='kv_offset'):
      attend(q, kc, vc, kv_offset=8)  # past the buffer's end
    with pytest.raises(ValueError, match='fewer than'):
      attend(q, kc[:8], vc[:8])
    with pytest.raises(ValueError, match='scale'):
      attend(q, kc, vc, scale=float('nan'))
    with pytest.raises(ValueError, match='q must be'):
      attend(q[:, :, :2], kc, vc)

  def test_config_checks(self):
    assert mosaic.DEFAULT_CONFIG == mosaic.MosaicGpuConfig(128, 2, 8, None)
    for bad in (dict(block_kv=96), dict(max_concurrent_steps=1), dict(max_splits=0),
                dict(num_sms=0), dict(private_slots=1), dict(private_slots=6)):
      with pytest.raises(ValueError, match=next(iter(bad))):
        mosaic.MosaicGpuConfig(**bad)
    with pytest.raises(ValueError, match='shared_overlap must be None, True or False'):
      mosaic.MosaicGpuConfig(shared_overlap='yes')
    for name in ('private_zero_unseen', 'q_by_row', 'private_lane_table'):
      with pytest.raises(ValueError, match=f'{name} must be True or False'):
        mosaic.MosaicGpuConfig(**{name: 1})
    with pytest.raises(ValueError, match='private_token_lanes must be None, True or False'):
      mosaic.MosaicGpuConfig(private_token_lanes='auto')
    with pytest.raises(ValueError, match='private_token_lanes=True needs private_lane_table'):
      mosaic.MosaicGpuConfig(private_token_lanes=True, private_lane_table=False)
    mosaic.MosaicGpuConfig(private_token_lanes=None, shared_overlap=None)  # resolved per call
    with pytest.raises(ValueError, match='overlap must be None, True or False'):
      mosaic.SegmentKernelConfig(overlap=1.5)

  def test_float32_raises_value_error(self):
    with pytest.raises(ValueError, match='float32'):
      mosaic.tree_attention(*self._args(dtype=jnp.float32), interpret=True)

  def test_auto_falls_back_to_xla_off_hopper(self):
    args = self._args()
    impl, _ = hydrajax.resolve(hydrajax.AttentionImpl.AUTO, *args)
    assert impl is (hydrajax.AttentionImpl.MOSAIC_GPU if ON_HOPPER else hydrajax.AttentionImpl.XLA)

  @pytest.mark.parametrize(
      'batch,group,kv_heads,splits',
      [(256, 4, 8, 2), (1024, 4, 8, 1), (1024, 8, 1, 2), (32, 4, 8, 15), (1024, 1, 40, 2),
       (1024, 1, 20, 4)],
      ids=lambda v: str(v),
  )
  def test_splits_fill_the_chip(self, batch, group, kv_heads, splits):
    """The benchmark shapes: one 16K prefix, 132 SMs; 32/8 heads (G=4), 32/4 (G=8, one kv head
    here), and 13B's 40 MHA heads whole (TP=1) and halved (TP=2: 160 programs, 2 waves with
    a part-empty second, are cut into 640, 5 nearly full). At B=32 16 splits are no shorter
    than 15."""
    plan = hydrajax.plan_tree(PromptNode(16384, num_samples=batch), private_capacity=64)
    sched = schedule.shared_schedule(
        plan.to_device(), rows_per_query=group, num_kv_heads=kv_heads, block_kv=128,
        num_sms=132, max_splits=16,
    )
    assert sched.num_splits == splits
    gs = sched.groups[0]
    assert gs.split_tokens * splits >= 16384 and gs.split_tokens % 128 == 0

  @pytest.mark.parametrize('batch,prefix,group,kv_heads,overlap', [
      (1024, 16384, 4, 8, True), (256, 16384, 4, 8, True), (32, 2048, 4, 8, False),
      (1024, 1024, 1, 32, False)])
  def test_overlap_resolves_by_program_length(self, batch, prefix, group, kv_heads, overlap):
    """shared_overlap=None turns the overlapped schedule on for programs of at least
    OVERLAP_MIN_BLOCKS kv blocks (the P=16K decode steps: 65-129 blocks), off for short ones
    (B=32, P=2K: 8 splits of 3 blocks; P=1K: 9); an explicit value wins."""
    plan = hydrajax.plan_tree(PromptNode(prefix, num_samples=batch), private_capacity=64)
    sched = schedule.shared_schedule(
        plan.to_device(), rows_per_query=group, num_kv_heads=kv_heads, block_kv=128,
        num_sms=132, max_splits=8)
    blocks = max(g.split_tokens for g in sched.groups) // 128
    assert (blocks >= OVERLAP_MIN_BLOCKS) == overlap
    assert overlaps(SegmentKernelConfig(), sched) == overlap
    for explicit in (True, False):
      assert overlaps(SegmentKernelConfig(overlap=explicit), sched) == explicit
    # 192-token steps: off unless asked for (the overlap spills registers there).
    assert not overlaps(SegmentKernelConfig(block_kv=192), sched)
    assert overlaps(SegmentKernelConfig(block_kv=192, overlap=True), sched)

  def test_one_lane_table_serves_every_layer(self):
    """The lane table depends on the step's lengths only: in a step that attends two layers,
    XLA builds it once (as many cumsums in the compiled program as for one layer), also when each
    layer's attention is its own shard_map."""
    import re
    plan = hydrajax.plan_tree(PromptNode(64, num_samples=8), private_capacity=64,
                              private_lengths=[3] * 8)
    layout, length = plan.to_device(), plan.kv_tokens
    q = jnp.ones((8, 1, 4, 64), jnp.bfloat16)
    kc = jnp.ones((2 * length, 2, 64), jnp.bfloat16)
    shapes = mosaic.KernelShapes.of(q, kc[:length])
    config = mosaic.MosaicGpuConfig(block_kv=64)
    prepared = mosaic.prepare(layout, shapes, config, interpret=True)

    def attend(q, kc, prepared, layer):
      return mosaic.attend(q, kc, kc, prepared, shapes=shapes, config=config,
                           kv_offset=layer * length, interpret=True).out

    devices = jax.devices()[:2]  # two of CPU's eight fake devices; the one GPU of a GPU host
    mesh = jax.make_mesh((len(devices),), ('tp',), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    heads = jax.sharding.PartitionSpec(None, None, 'tp', None)
    kv_heads = jax.sharding.PartitionSpec(None, 'tp', None)

    def sharded(q, kc, prepared, layer):  # each layer's attention its own shard_map, as in Llama
      plan_spec = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), prepared)
      return jax.shard_map(functools.partial(attend, layer=layer), mesh=mesh,
                           in_specs=(heads, kv_heads, plan_spec), out_specs=heads)(q, kc, prepared)

    def step(q, kc, prepared, lengths, layers, one_layer):
      prepared = mosaic.with_private_lengths(prepared, lengths)
      return [one_layer(q, kc, prepared, layer) for layer in range(layers)]

    def cumsums(layers, one_layer, q, kc):  # the table's (`lane_table`), in the compiled step
      lowered = jax.jit(step, static_argnums=(4, 5)).lower(
          q, kc, prepared, jnp.full((8,), 3, jnp.int32), layers, one_layer)
      return len(re.findall(r' reduce-window\(', lowered.compile().as_text()))

    assert cumsums(2, attend, q, kc) == cumsums(1, attend, q, kc) > 0
    q2 = jnp.concatenate([q] * len(devices), axis=2)  # each device's heads
    kc2 = jnp.concatenate([kc] * len(devices), axis=1)
    assert cumsums(2, sharded, q2, kc2) == cumsums(1, sharded, q2, kc2) > 0

  def test_stacked_shard_plans_build_each_shards_table(self):
    """`ShardedLayout.for_step` (dp shards' plans stacked): each shard's lane table, from its
    own rows' lengths, as `for_step` of that shard's plan alone."""
    from hydrajax.attention import parallel
    rng = fresh_rng()
    plans = [hydrajax.plan_tree(PromptNode(40, num_samples=8), private_capacity=64,
                                private_lengths=rng.integers(0, 65, 8).tolist()) for _ in '01']
    q = jax.ShapeDtypeStruct((8, 1, 8, 64), jnp.bfloat16)
    shapes = hydrajax.AttentionShapes.of(q, jax.ShapeDtypeStruct((plans[0].kv_tokens, 2, 64),
                                                                 jnp.bfloat16))
    shards = [hydrajax.prepare_attention(p.to_device(), shapes, impl='mosaic_gpu', interpret=True)
              for p in plans]
    lengths = rng.integers(0, 65, 16).astype(np.int32)  # both shards' rows, in global order
    step = parallel.stack_shards(shards).with_private_lengths(lengths).for_step()
    for d, shard in enumerate(shards):
      want = shard.with_private_lengths(jnp.asarray(lengths[8 * d:8 * d + 8])).for_step()
      np.testing.assert_array_equal(np.asarray(step.layouts.prepared.lanes[d]),
                                    np.asarray(want.prepared.lanes))

  @pytest.mark.parametrize('b, n, k, t, heads', [
      (16, 8, 8, 1, 8), (16, 32, 8, 2, 8), (2, 64, 16, 1, 8),
      (16, 16, 4, 1, 4),  # two tokens of 4 kv heads a lane, frames of 16 rows
      (16, 16, 2, 1, 2),  # four tokens of 2 kv heads, frames of 32 rows
      (16, 64, 4, 1, 4),  # T*G = 16: one query row a frame
      (6, 16, 4, 1, 1),  # B*TGp = 24: a frame of 16 rows would end past the batch
      (16, 48, 12, 1, 1),  # 12 kv heads: neither whole tiles of 8 nor one tile
      (16, 8, 1, 1, 1),  # MQA: a lane of one kv head is a chunk lane
      (5, 8, 8, 1, 1),  # B*TGp = 5: a frame would end past the batch
      (16, 64, 8, 2, 1),  # T*G = 16 folded rows a query row, more than a frame's 8
  ])
  def test_token_lanes_where_they_fit(self, b, n, k, t, heads):
    """`private_token_lanes` takes shapes that `lane_heads_for` fits; others keep chunk lanes
    (and their frame sizes), so the knob never makes a shape unsupported."""
    plan = hydrajax.plan_tree(PromptNode(40, num_samples=b), private_capacity=64,
                              private_lengths=[3] * b)
    shapes = mosaic.KernelShapes(b, t, n, k, 64, plan.kv_tokens, jnp.bfloat16)
    token = mosaic.prepare(plan.to_device(), shapes,
                           mosaic.MosaicGpuConfig(private_token_lanes=True)).problem
    chunk = mosaic.prepare(plan.to_device(), shapes,
                           mosaic.MosaicGpuConfig(private_token_lanes=False)).problem
    assert token.lane_heads == heads and chunk.lane_heads == 1 and not chunk.token_lanes
    if heads > 1:
      assert token.token_lanes and token.heads_per_program == heads
      assert token.frame_rows == 64 // heads and token.lane_tokens == 8 // heads
      # lse straight into [B*T, K, G] is a strided TMA store per kv head, from float F*k of the
      # lse buffer: only where that is 128-byte aligned (h = 2).
      assert token.direct_lse == (heads == 2 and chunk.direct_lse)
    else:
      assert token == chunk

  @pytest.mark.parametrize('b, n, k, capacity, lane_table, heads', [
      (1024, 32, 8, 64, True, 8),  # 512 programs, rows of at most 64 tokens
      (256, 16, 4, 64, True, 4),  # 64 programs (a tensor-parallel shard)
      (1024, 32, 8, 128, True, 8),  # rows up to 128 tokens: 512 programs
      (1024, 32, 32, 128, True, 8),  # the CodeLlama-7B decode step
      (256, 32, 8, 128, True, 1),  # 128 programs: chunk lanes copy 64 tokens at once
      (32, 32, 8, 64, True, 1),  # 16 programs: too few
      (1024, 32, 8, 64, False, 1),  # no lane table: token lanes need it
  ])
  def test_token_lanes_by_default(self, b, n, k, capacity, lane_table, heads):
    """`private_token_lanes=None` (the default) takes token lanes where they fit and there are
    `TOKEN_LANES_MIN_PROGRAMS` programs, or `TOKEN_LANES_LONG_ROW_MIN_PROGRAMS` where rows may
    hold more than `TOKEN_LANES_MAX_CAPACITY` private tokens: where they measured no slower
    (the config's docstring)."""
    plan = hydrajax.plan_tree(PromptNode(40, num_samples=b), private_capacity=capacity,
                              private_lengths=[3] * b)
    shapes = mosaic.KernelShapes(b, 1, n, k, 64, plan.kv_tokens, jnp.bfloat16)
    config = mosaic.MosaicGpuConfig(private_lane_table=lane_table)
    assert mosaic.prepare(plan.to_device(), shapes, config).problem.lane_heads == heads

  def test_hand_built_token_lane_problems_are_refused(self):
    """A `PrivateProblem` whose lane heads or frames no kernel has is refused when built, and
    one whose lane heads do not fit K when the kernel is called, each naming what it got."""
    from pallas_kernels.mosaic_gpu import private_problem as pp
    from pallas_kernels.mosaic_gpu.private_attention import private_attention
    with pytest.raises(ValueError, match='lane_heads must be 1, 2, 4 or 8, got 3'):
      pp.PrivateProblem(8, 1, 1, 1, 8, 16, lane_heads=3)
    with pytest.raises(ValueError, match='need frame_rows = 16 .token_frame_rows., got 8'):
      pp.PrivateProblem(8, 1, 4, 4, 8, 16, lane_heads=4)
    problem = pp.PrivateProblem(16, 1, 4, 4, 16, 16, lane_heads=4)  # fits K = 4, not K = 8
    kv = jnp.zeros((64, 8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match='token lanes of 4 kv heads .* got B=16, TGp=4, K=8'):
      private_attention(jnp.zeros((8, 128, 64), jnp.bfloat16), kv, kv,
                        jnp.zeros((16, 4), jnp.int32), jnp.zeros((16,), jnp.int32), None, None,
                        None, None, None, problem, scale=0.125, interpret=True)

  def test_config_from_knobs(self):
    """`MosaicGpuConfig.from_knobs` (experiments' --mosaic_gpu_knobs): names and values checked."""
    got = mosaic.MosaicGpuConfig.from_knobs(
        ['private_lane_table=false', 'max_splits=4', 'private_slots=none'])
    assert got == mosaic.MosaicGpuConfig(private_lane_table=False, max_splits=4, private_slots=None)
    with pytest.raises(ValueError, match='name=value with a name in'):
      mosaic.MosaicGpuConfig.from_knobs(['lane_table=true'])
    with pytest.raises(ValueError, match='max_splits=.x.: true, false, none or an integer'):
      mosaic.MosaicGpuConfig.from_knobs(['max_splits=x'])
    with pytest.raises(ValueError, match='max_splits must be >= 1'):
      mosaic.MosaicGpuConfig.from_knobs(['max_splits=0'])
    # One parser for every kernel config (`pallas_kernels.knobs`): the training kernels' too.
    from pallas_kernels.mosaic_gpu.training_attention import TrainingKernelConfig
    assert config_from_knobs(TrainingKernelConfig, ['block_kv_dq=128', ' ']) == (
        TrainingKernelConfig(block_kv_dq=128))

  def test_launch_time_is_list_scheduling(self):
    """`launch_time`'s bisection against program-by-program list scheduling (each program on
    the first multiprocessor to free up), on random runs; adjacent runs of one length merged
    (the second random run may repeat the first's)."""
    rng = fresh_rng()
    for _ in range(200):
      num_sms = int(rng.integers(1, 20))
      runs = [(int(rng.integers(0, 80)), int(rng.integers(0, 30)))
              for _ in range(int(rng.integers(1, 6)))]
      free = [0] * num_sms
      for count, blocks in runs:
        for _ in range(count):
          heapq.heapreplace(free, free[0] + blocks + schedule.PROGRAM_COST_BLOCKS)
      assert schedule.launch_time(runs, num_sms=num_sms) == max(free), (runs, num_sms)
    # Past EXACT_RUNS runs: the closed form, within one program of list scheduling (Graham).
    runs = [(int(rng.integers(1, 9)), int(rng.integers(0, 30)))
            for _ in range(schedule.EXACT_RUNS + 1)]
    free = [0] * 16
    for count, blocks in runs:
      for _ in range(count):
        heapq.heapreplace(free, free[0] + blocks + schedule.PROGRAM_COST_BLOCKS)
    estimate = schedule.launch_time(runs, num_sms=16)
    assert estimate <= max(free) <= estimate + 30 + schedule.PROGRAM_COST_BLOCKS

  @pytest.mark.parametrize('questions,splits', [(4, 8), (16, 8), (64, 4), (256, 2)])
  def test_a_long_segment_among_short_ones_is_still_split(self, questions, splits):
    """A 20K-token document above one-row question segments (needle_qa, G = 8, 4 kv heads): the
    questions' many one-block programs do not leave the document to a few unsplit programs,
    and the document's programs start first."""
    doc = hydrajax.PromptNode(20000, children=tuple(
        PromptNode(12, num_samples=1) for _ in range(questions)))
    plan = hydrajax.plan_tree(doc, private_capacity=64)
    sched = schedule.shared_schedule(plan.to_device(), rows_per_query=8, num_kv_heads=4,
                                     block_kv=128, num_sms=132, max_splits=8)
    assert sched.num_splits == splits
    longest = max(sched.groups, key=lambda gs: gs.split_tokens)
    assert longest.split_tokens * splits >= 20000
    assert longest.item_offset == 0
    spans = sorted((gs.item_offset, gs.item_offset + gs.num_items) for gs in sched.groups)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # items tile [0, num_items)
    assert spans[-1][1] == sched.num_items

  @pytest.mark.parametrize('b,t,g,page,heads', [
      (1024, 1, 1, 64, 1), (99, 1, 4, 16, 1), (37, 2, 4, 8, 1),
      (5, 3, 32, 64, 1), (3, 2, 64, 128, 1),
      (1024, 1, 1, 64, 8), (37, 2, 4, 8, 8), (6, 1, 4, 16, 8),
      (36, 2, 2, 8, 4), (12, 1, 4, 16, 4), (40, 3, 2, 8, 2)], ids=str)
  def test_lane_table_is_the_kernels_chunk_walk(self, b, t, g, page, heads):
    """`lane_table` against the kernel's walk replayed lane by lane (cursor over rows, max(chunks,
    1) lanes a row, a lane's first token from its page), on random lengths (zeros included),
    pages and frames past the batch; rows spanning several 64-row tiles when T*G > 64. Token
    lanes of h kv heads: a lane is 8/h tokens, its valid rows h per valid token, and a step
    never one copy."""
    from pallas_kernels.mosaic_gpu import private_problem as pa
    rng = fresh_rng()
    tgp = schedule.padded_rows_per_query(t * g)
    token = heads > 1
    frame = pa.token_frame_rows(heads) if token else schedule.private_frame_rows(b, tgp, 8, 132)
    unit = 8 // heads  # tokens a lane
    max_pages = int(rng.integers(1, 5))
    problem = pa.PrivateProblem(b, t, g, tgp, frame, page, lane_heads=heads)
    problem = dataclasses.replace(problem, lane_steps=pa.lane_steps(problem, max_pages))
    lengths = rng.integers(0, max_pages * page + 1, b)
    lengths[rng.random(b) < 0.2] = 0
    pages = rng.permutation(4 * b * max_pages)[: b * max_pages].reshape(b, max_pages)
    table = np.asarray(pa.lane_table(lengths, pages, problem))
    assert table.shape == (problem.num_frames, problem.lane_steps, pa.LANE_FIELDS)
    r_rows, tiles = problem.rows_per_frame, max(1, tgp // schedule.WG_M)
    for f in range(problem.num_frames):
      row0, q0 = (f * r_rows, 0) if r_rows > 1 or tgp <= 64 else (f // tiles, f % tiles * 64)
      t_last = t - 1 if r_rows > 1 or tgp <= 64 else min((q0 + 63) // g, t - 1)
      length = [int(lengths[row0 + r]) if row0 + r < b else 0 for r in range(r_rows)]
      seen = [min(max(n - t + 1 + t_last, 0), n) for n in length]
      chunks = [-(-n // unit) for n in seen]
      total = sum(max(n, 1) for r, n in enumerate(chunks) if row0 + r < b)
      cursor = (0, 0)
      for step in range(-(-total // 8)):
        toks, reals, rows, valids = [], [], [], []
        for _ in range(8):  # `lane_at`: rows past the frame have no chunk and one lane
          r, i = cursor
          n_chunks = chunks[r] if r < r_rows else 0
          real = i < n_chunks
          valid = min(max(length[r] - unit * i, 0), unit) * (8 // unit) if real else 0
          pos = unit * i
          tok = int(pages[row0 + r, pos // page]) * page + pos % page if real else 0
          toks.append(tok), reals.append(real), rows.append(r), valids.append(valid)
          cursor = (r, i + 1) if i + 1 < max(n_chunks, 1) else (r + 1, 0)
        contiguous = not token and reals[0] and all(
            reals[j] and rows[j] == rows[0] and toks[j] == toks[0] + 8 * j for j in range(8))
        packed = sum(v << (4 * j) for j, v in enumerate(valids))
        packed = packed - (1 << 32) if packed >= 1 << 31 else packed
        want = toks + [int(contiguous), packed]
        np.testing.assert_array_equal(table[f, step], want, err_msg=f'frame {f} step {step}')

  @pytest.mark.parametrize('tg,want', [(1, 1), (3, 4), (4, 4), (6, 8), (8, 8), (33, 64), (64, 64),
                                       (65, 128), (80, 128), (128, 128)])
  def test_padded_rows_per_query(self, tg, want):
    assert schedule.padded_rows_per_query(tg) == want

  @pytest.mark.parametrize(
      'batch,tgp,kv_heads,want',
      [(1024, 4, 8, 64), (256, 4, 8, 32), (32, 4, 8, 8), (32, 1, 32, 8), (2, 16, 1, 16),
       (4, 128, 8, 64)],
      ids=str,
  )
  def test_private_frames_cover_the_chip(self, batch, tgp, kv_heads, want):
    """The largest frame whose programs still cover 132 SMs, never below one row or 8 rows."""
    frame = schedule.private_frame_rows(batch, tgp, kv_heads, 132)
    assert frame == want
    assert frame % 8 == 0 and (frame % tgp == 0 or tgp % frame == 0)

  def test_row_segments_follow_paths(self):
    plan = _tree('deep', 16, (1,))
    layout = plan.to_device()
    ids = np.concatenate([np.asarray(g.kv_start) for g in layout.groups])  # segment id -> kv_start
    table = np.asarray(layout.row_segments)
    for row in range(plan.num_rows):
      want = [plan.segments[j].kv_start for j in plan.path(row) if plan.segments[j].kv_length]
      got = [int(ids[i]) for i in table[row] if i >= 0]
      assert got == want

