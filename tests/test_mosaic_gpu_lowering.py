"""Every Mosaic GPU kernel configuration lowers for CUDA, on a CPU-only machine.

Interpret mode (the conformance tests) runs the kernels' semantics but not Mosaic GPU's
layout inference, so a register layout the lowering cannot handle only shows up on a GPU:
a kernel for Llama-2-70B's 8:1 heads failed there at small batches (a frame of one row:
its per-row bounds were a splat constant, which has no broadcast to the score tile).
Here each configuration is traced and lowered to Mosaic GPU MLIR (TMA, wgmma and layout
checks; not ptxas) at small shapes: the head ratios G = 1, 4, 8, 32, one and several rows a
frame, T = 1 and 2, no shared prefix (the paged kernel), and the training kernels.
"""

import json
import re

import jax
import jax.numpy as jnp
import pytest

import hydrajax
from pallas_kernels.mosaic_gpu import profiling
from pallas_kernels.mosaic_gpu import training_attention as ta
from pallas_kernels.mosaic_gpu import tree_attention as mosaic

HEAD_DIM = 128
CUDA = ('cuda',)


def _kernels(lowered) -> set[str]:
  """Names of the Mosaic GPU kernels a lowered program calls (their custom calls' names)."""
  return set(re.findall(r'([a-z][a-z0-9_]*_kernel)_mosaic_gpu', lowered.as_text()))


def _lower_tree(b, p, s, n, k, t, text=False, **knobs):
  plan = hydrajax.plan_tree(hydrajax.PromptNode(p, num_samples=b),
                            private_capacity=max(64, -(-s // 64) * 64),
                            private_lengths=s)
  layout = plan.to_device()
  sd = jax.ShapeDtypeStruct
  q = sd((b, t, n, HEAD_DIM), jnp.bfloat16)
  kv = sd((plan.kv_tokens, k, HEAD_DIM), jnp.bfloat16)
  lowered = jax.jit(lambda *args: mosaic.tree_attention(*args, **knobs)).trace(
      q, kv, kv, layout).lower(lowering_platforms=CUDA)
  return lowered.as_text() if text else _kernels(lowered)


@pytest.mark.parametrize('b, p, s, n, k, t', [
    (1024, 1024, 9, 32, 32, 1),  # MHA (G = 1), 64 rows a frame
    (16, 2048, 3, 32, 8, 1),  # G = 4
    (16, 2048, 3, 64, 8, 1),  # G = 8 at a small batch: one row a frame
    (256, 2048, 3, 64, 8, 1),  # G = 8, several rows a frame
    (8, 2048, 9, 32, 4, 2),  # G = 8, T = 2: 16 query rows a row
    (8, 2048, 3, 32, 1, 1),  # MQA: G = 32
    (99, 2048, 3, 32, 8, 2),  # a last frame past the batch
    (99, 2048, 3, 32, 32, 1),  # MHA, 99 rows: q folded (a by-row read needs whole 8-row tiles)
    (96, 2048, 3, 32, 32, 2),  # MHA, T = 2: q read by row, a last frame past the batch
    (2, 2048, 200, 32, 32, 128),  # prefill (T = 128 at G = 1): two 64-row frames a row
    (3, 2048, 64, 32, 8, 64),  # prefill at G = 4: T*G = 256
    (32, 0, 300, 32, 8, 1),  # no shared prefix: the paged kernel
    (4, 0, 300, 64, 8, 1),  # the paged kernel at G = 8
])
def test_tree_attention_lowers_for_cuda(b, p, s, n, k, t):
  kernels = _lower_tree(b, p, s, n, k, t)
  if p:  # a shared prefix: its kernel, then the rows' private part merged with it
    assert {'shared_segment_kernel', 'private_merge_kernel'} <= kernels, kernels
  else:  # no shared segment: one paged kernel, nothing to merge
    assert kernels and not kernels & {'shared_segment_kernel', 'private_merge_kernel'}, kernels


@pytest.mark.parametrize('knobs', [dict(private_slots=3), dict(private_slots=5),
                                   dict(private_lane_table=False),
                                   dict(private_zero_unseen=False)],
                         ids=['slots=3', 'slots=5', 'lane_walk', 'unguarded'])
def test_private_knobs_lower_for_cuda(knobs):
  """The private kernel's pipeline knobs at the decode step's MHA shape (3-5 slots, the
  walked plans, no zeroing of unseen rows)."""
  kernels = _lower_tree(1024, 1024, 9, 32, 32, 1, **knobs)
  assert {'shared_segment_kernel', 'private_merge_kernel'} <= kernels, kernels


@pytest.mark.parametrize('b, p, s, n, k, t', [
    (1024, 1024, 9, 32, 32, 1),  # the 7B decode step: 4 blocks of 8 kv heads, q read by row
    (1024, 16384, 1, 32, 8, 1),  # G = 4: the GQA decode step
    (16, 2048, 3, 64, 8, 1),  # G = 8: one query row a frame
    (8, 2048, 9, 32, 8, 2),  # G = 4, T = 2: causal
    (8, 2048, 9, 48, 16, 1),  # G = 3: padded rows, out and lse folded
    (1024, 16384, 1, 16, 4, 1),  # h = 4: a tensor-parallel shard of 32/8 heads over two GPUs
    (256, 2048, 9, 12, 2, 1),  # h = 2: G = 6, padded rows
])
def test_token_lanes_lower_for_cuda(b, p, s, n, k, t):
  """Token lanes (`private_token_lanes`): copies of 8-row tiles of h kv heads, Q and stores per
  kv head, merge windows [h, 64/h, H] by TMA into a buffer read through a reshaped ref."""
  plan = hydrajax.plan_tree(hydrajax.PromptNode(p, num_samples=b), private_capacity=64,
                            private_lengths=s)
  shapes = mosaic.KernelShapes(b, t, n, k, HEAD_DIM, plan.kv_tokens, jnp.bfloat16)
  config = mosaic.MosaicGpuConfig(private_token_lanes=True)
  assert mosaic.prepare(plan.to_device(), shapes, config).problem.lane_heads == min(k, 8)
  kernels = _lower_tree(b, p, s, n, k, t, private_token_lanes=True)
  assert {'shared_segment_kernel', 'private_merge_kernel'} <= kernels, kernels


@pytest.mark.parametrize('knobs', [dict(shared_overlap=True),
                                   dict(shared_overlap=True, block_kv=64,
                                        max_concurrent_steps=3),
                                   dict(shared_overlap=True, block_kv=192)],
                         ids=['overlap', 'overlap_block64_steps3', 'overlap_block192'])
@pytest.mark.parametrize('shape', [(256, 16384, 1, 32, 8, 1), (8, 2048, 9, 32, 32, 2)],
                         ids=['G=4', 'MHA_T=2'])
def test_shared_knobs_lower_for_cuda(knobs, shape):
  """The shared kernel's overlapped schedule (`shared_overlap`), and 192-token steps (which
  fit in shared memory only without reduction scratch)."""
  kernels = _lower_tree(*shape, **knobs)
  assert {'shared_segment_kernel', 'private_merge_kernel'} <= kernels, kernels


@pytest.mark.parametrize('n, k', [(32, 8), (64, 8), (32, 32), (32, 1)])
@pytest.mark.parametrize('fused_dq', [True, False], ids=['fused_dq', 'dq_kernel'])
def test_training_kernels_lower_for_cuda(n, k, fused_dq):
  """A shared segment's dQ comes from the dK/dV kernel (`fused_dq`, by TMA reduce-add) or the
  dQ kernel; the causal kernels always run the dQ kernel."""
  sd = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  cfg = ta.TrainingKernelConfig(fused_dq=fused_dq)
  m, s, z, t = 256, 512, 2, 192
  for forward, backward, q, kv, stat, length, fused in (
      (ta.segment_forward, ta.segment_backward, (m, n, HEAD_DIM), (s, k, HEAD_DIM), (m, n), (),
       fused_dq),
      (ta.causal_forward, ta.causal_backward, (z, t, n, HEAD_DIM), (z, t, k, HEAD_DIM), (z, t, n),
       (z,), False),
  ):
    q, kv, stat, length = sd(q), sd(kv), sd(stat, jnp.float32), sd(length, jnp.int32)
    fwd = _kernels(jax.jit(lambda *a, f=forward: f(*a, scale=0.1, config=cfg)).trace(
        q, kv, kv, length).lower(lowering_platforms=CUDA))
    lowered = jax.jit(lambda *a, f=backward: f(*a, scale=0.1, config=cfg)).trace(
        q, kv, kv, q, stat, stat, length).lower(lowering_platforms=CUDA)
    assert fwd == {'training_fwd_kernel'}, fwd
    if fused:
      assert _kernels(lowered) == {'training_dkv_kernel'}, _kernels(lowered)
      assert 'cp.reduce.async.bulk.tensor' in lowered.as_text()  # dQ's TMA reduce-add
    else:
      assert _kernels(lowered) == {'training_dq_kernel', 'training_dkv_kernel'}



@pytest.mark.parametrize('knobs', [dict(block_kv_dq=128), dict(block_q_dq=128),
                                   dict(block_q=128)], ids=lambda kw: ','.join(kw))
def test_causal_kernels_with_large_blocks_lower_for_cuda(knobs):
  """Paired causal tiles (`pair_causal_tiles`) double a program's Q / dO buffers: configs whose
  second slot would not fit in shared memory run one tile a program instead of failing."""
  sd = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  cfg = ta.TrainingKernelConfig(**knobs)
  assert not (ta._paired_forward(cfg, 512, HEAD_DIM, jnp.bfloat16)
              and ta._paired_dq(cfg, 512, HEAD_DIM, jnp.bfloat16))
  assert ta._paired_forward(ta.TrainingKernelConfig(), 512, HEAD_DIM, jnp.bfloat16)
  assert ta._paired_dq(ta.TrainingKernelConfig(), 512, HEAD_DIM, jnp.bfloat16)
  z, t, n, k = 2, 512, 32, 8
  q, kv, stat, length = (sd((z, t, n, HEAD_DIM)), sd((z, t, k, HEAD_DIM)),
                         sd((z, t, n), jnp.float32), sd((z,), jnp.int32))
  jax.jit(lambda *a: ta.causal_forward(*a, scale=0.1, config=cfg)).trace(
      q, kv, kv, length).lower(lowering_platforms=CUDA)
  jax.jit(lambda *a: ta.causal_backward(*a, scale=0.1, config=cfg)).trace(
      q, kv, kv, q, stat, stat, length).lower(lowering_platforms=CUDA)


@pytest.mark.parametrize('paired', [True, False], ids=['paired', 'one_tile'])
def test_float32_dq_and_dq_init_lower_for_cuda(paired):
  """`prefill_dq_in_place`'s two halves: the causal dQ kernel writing float32 through its
  Q / dO buffers (a RefUnion), and the fused dK/dV kernel reduce-adding onto a given dQ."""
  sd = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  cfg = ta.TrainingKernelConfig(pair_causal_tiles=paired)
  z, t, n, k = 2, 512, 32, 8
  q, kv, stat = sd((z, t, n, HEAD_DIM)), sd((z, t, k, HEAD_DIM)), sd((z, t, n), jnp.float32)
  lowered = jax.jit(lambda *a: ta.causal_backward(*a, t, scale=0.1, config=cfg,
                                                  dq_dtype=jnp.float32)).trace(
      q, kv, kv, q, stat, stat).lower(lowering_platforms=CUDA)
  assert _kernels(lowered) == {'training_dq_kernel', 'training_dkv_kernel'}
  assert jax.eval_shape(lambda *a: ta.causal_backward(*a, t, scale=0.1, config=cfg,
                                                      dq_dtype=jnp.float32),
                        q, kv, kv, q, stat, stat)[0].dtype == jnp.float32
  rows = sd((1, z * t, n, HEAD_DIM))
  lowered = jax.jit(lambda q, kv, do, lse, delta, dq: ta.segments_backward(
      q, kv, kv, do, lse, delta, 300, scale=0.1, config=cfg, dq_init=dq)).trace(
          rows, sd((1, 384, k, HEAD_DIM)), rows, sd((1, z * t, n), jnp.float32),
          sd((1, z * t, n), jnp.float32), sd(rows.shape, jnp.float32)).lower(
              lowering_platforms=CUDA)
  assert _kernels(lowered) == {'training_dkv_kernel'}
  assert 'cp.reduce.async.bulk.tensor' in lowered.as_text()


def test_profiler_switch_and_trace_summary(monkeypatch, tmp_path):
  """The profiler is on only with its variable (its dump is a host callback, so a profiled
  kernel lowers on the GPU only); `summarize` sums each region's time per warpgroup trace."""
  monkeypatch.delenv(profiling.PROFILE_DIR, raising=False)
  assert not profiling.compiler_params().profile_space
  monkeypatch.setenv(profiling.PROFILE_DIR, str(tmp_path / 'traces'))
  params = profiling.compiler_params()
  assert params.profile_dir == str(tmp_path / 'traces') and params.profile_space == 512
  assert params.approx_math and (tmp_path / 'traces').is_dir()
  events = [('B', 'qk', 1, 0.0), ('E', 'qk', 1, 2.0), ('B', 'qk', 1, 5.0), ('E', 'qk', 1, 6.0),
            ('B', 'pv', 2, 1.0), ('B', 'qk', 2, 1.5), ('E', 'qk', 2, 4.5), ('E', 'pv', 2, 7.0)]
  trace = tmp_path / 'trace.json'
  trace.write_text(json.dumps({'traceEvents': [dict(ph=ph, name=n, tid=t, ts=ts, pid=1)
                                               for ph, n, t, ts in events]}))
  summary = profiling.summarize(str(trace))
  assert summary['qk'] == dict(count=3, total_us=6.0, mean_us=2.0, per_program_us=3.0)
  assert summary['pv'] == dict(count=1, total_us=6.0, mean_us=6.0, per_program_us=3.0)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_tree_attention_lowers_for_cuda': ('16-2048-3-64-8-1', '8-2048-3-32-1-1', '99-2048-3-32-8-2', '2-2048-200-32-32-128', '32-0-300-32-8-1'),
    'test_training_kernels_lower_for_cuda': ('fused_dq-32-8', 'dq_kernel-32-1'),
    'test_shared_knobs_lower_for_cuda': ('G=4-overlap_block64_steps3', 'MHA_T=2-overlap_block192'),
    'test_token_lanes_lower_for_cuda': ('1024-16384-1-32-8-1', '8-2048-9-48-16-1', '256-2048-9-12-2-1'),
}
