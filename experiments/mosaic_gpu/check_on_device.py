"""Checks and times the Mosaic GPU tree-attention kernels on a Hopper GPU, in one process.

On the GPU machine, from the repository root:

  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m experiments.mosaic_gpu.check_on_device --out /tmp/mosaic_check

On a CPU machine, `--lower_only` cross-lowers the chosen shapes and variants
(`--check_shapes`, `--shapes`, `--variants`) for CUDA (Pallas -> Mosaic GPU
MLIR, TMA copies and their limits) without running anything: it catches
layout and tiling errors before device time is spent (not ptxas's).

What it does on the GPU:
1. measures the ceilings: bf16 matmul rate (8192^3) and copy bandwidth
   (read + write of 2 GiB), both with CUPTI device timers;
2. checks the kernels against `tree_attention_xla` on random inputs for each
   benchmark shape (relative L2 error of out, max |lse| error, -inf agreement);
3. times each kernel variant and the XLA path with CUPTI (kernel time only,
   summed over the kernels of one call), on R copies of the inputs used in
   turn so that each call starts with its KV out of L2 (R * bytes >= 256 MiB);
4. prints a table: time, floor = max(bytes / bandwidth, FLOPs / matmul rate),
   time / floor. Results also go to `--out/results.jsonl`.
5. (not with `--legacy`) the per-layer path: `prepare` once, then `attend` at
   layer 1 of a flat 2-layer buffer whose every slot that no row attends holds
   NaN, inf or -inf (`garbage` records: bitwise equality with the clean call);
   timed as `mosaic attend` (no packing per call) next to `tree_attention`, and
   as `mosaic attend ... (step plan)`, a layer of a decode step: the lane table
   built beforehand by `for_step`, once a step, and timed alone
   (`lane table (for_step)`).

`--legacy` runs only steps 1-4 through `tree_attention`, so the same command
times a tree that predates `prepare`/`attend` (the "before" of a change).
`--attend_only` skips `tree_attention` (one compile less per shape): `attend`
is checked against XLA, then the garbage check and its timing as in 5.
`--check_shapes` first checks `CHECK_SHAPES` against XLA (no timing), under each
of `--variants`: the paged-decode kernel and the private kernel's other output
paths (lse not in [B, T, N] order for G = 1, a last frame past the batch, T > 1).

The check shapes and shapes 0-4 through `attend` (about 2.5 minutes):

  PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 170 python3 -m experiments.mosaic_gpu.check_on_device \
    --out /tmp/mosaic_check --check_shapes all --attend_only --shapes 1,0,3,4

The decode step's layout against this microbenchmark's: shapes 5-10 with the model's
128-token private pages, also timed at layer 31 of a 32-layer buffer (about 2 minutes):

  PYTHONPATH=. timeout 170 python3 -m experiments.mosaic_gpu.check_on_device \
    --out /tmp/mosaic_check --attend_only --shapes 1,5,6,7,8,9,10 --capacity=128 --deep_layer=31

`--profile` also runs each shape once with Mosaic GPU's in-kernel profiler (`profiling`): a
Chrome trace per kernel launch under `--out/profile/<shape>/` and the time per named region
(the private kernel's step phases: wait_k, plan, qk_wait, softmax, pv, refill, merge...) in
results.jsonl (`kind: profile`).

`--variants all` adds the block_kv=64 variants (slower on every shape on the
H200); batches <= 64 also time smaller `max_splits`.
"""

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import hydrajax
from pallas_kernels.mosaic_gpu import profiling
from pallas_kernels.mosaic_gpu import tree_attention as mosaic

SHAPES = (  # (B, P, S, N, K): B rows share a P-token prefix, S private tokens each, T = 1
    (256, 16384, 1, 32, 8),
    (1024, 16384, 1, 32, 8),
    (1024, 32768, 1, 8, 1),
    (256, 16384, 128, 32, 8),
    (32, 2048, 1, 32, 8),
    # The decode step of experiments.throughput (CodeLlama-7B: 32/32 heads; 128-token private
    # pages: use --capacity=128 --deep_layer=31) at its four (B, P), with 8 private tokens a row
    # (one whole chunk) and 9 (two chunks): the model's attention share against these kernels
    # timed alone.
    (1024, 16384, 8, 32, 32),
    (1024, 16384, 9, 32, 32),
    (1024, 1024, 8, 32, 32),
    (1024, 1024, 9, 32, 32),
    (32, 16384, 9, 32, 32),
    (32, 1024, 9, 32, 32),
    # CodeLlama-13B's decode step on one GPU (40 MHA heads) and on each of two (TP=2: 20): the
    # shared kernel's splits against `schedule.launch_time` (the max_splits variants cap them at 1-3).
    (1024, 16384, 9, 40, 40),
    (1024, 16384, 9, 20, 20),
    # Later in a decode: 8 whole chunks and a partial one a row.
    (1024, 1024, 65, 32, 32),
    # A 32/8 model's decode step on each of two GPUs (TP=2: 16/4 heads a shard), where token
    # lanes hold two tokens of 4 kv heads (s46).
    (1024, 16384, 1, 16, 4),
    (256, 16384, 1, 16, 4),
    # Long private rows at many programs (B=1024: 512 token-lane programs): whether token lanes
    # lose there as at B=256 (s46), which keeps them off past 64 tokens of capacity.
    (1024, 16384, 128, 32, 8),
    (1024, 1024, 128, 32, 32),
)
CHECK_SHAPES = (  # (B, P, S, N, K, T), checked only
    (32, 0, 700, 32, 8, 1),  # no shared prefix: paged decode, out and lse in [B, T, N] order
    (99, 2048, 3, 32, 32, 1),  # MHA: out direct (last frame past the batch), lse folded
    (99, 2048, 8, 32, 8, 2),  # T = 2, G = 4: out and lse direct, last frame past the batch
    (16, 2048, 3, 64, 8, 1),  # G = 8 at a small batch: one row a frame (Llama-2-70B's heads)
    (8, 2048, 3, 32, 1, 1),  # MQA: G = 32, one row a frame
    (8, 0, 300, 64, 8, 1),  # no shared prefix at G = 8
    (96, 2048, 9, 32, 32, 2),  # MHA, T = 2: q read by row (`q_by_row`)
    (2, 2048, 200, 32, 32, 128),  # MHA prefill (T = 128): q read by row, two frames a row
    (64, 2048, 13, 32, 8, 2),  # T = 2, G = 4: 8 folded rows a row (token lanes fit, T*G = 8)
    (64, 2048, 13, 16, 4, 1),  # K = 4, G = 4: token lanes of two tokens of 4 kv heads
    (64, 2048, 9, 12, 2, 2),  # K = 2, G = 6, T = 2: lanes of four tokens of 2 kv heads, padded
)
VARIANTS = (  # keyword arguments of mosaic.tree_attention (the first is the default)
    dict(block_kv=128, max_concurrent_steps=2),
    dict(block_kv=64, max_concurrent_steps=2),
    dict(block_kv=64, max_concurrent_steps=4),
    # The private kernel's pipeline (the shared kernel's knobs above leave it as it is): more
    # K/V steps in flight (one program a multiprocessor).
    dict(private_slots=3),
    dict(private_slots=4),
    dict(max_splits=1),
    dict(max_splits=2),
    dict(max_splits=3),
    dict(private_lane_table=False),  # the steps' plans walked in the kernel
    dict(q_by_row=False),  # G = 1: q folded per layer
    # The shared kernel's steps: 192 kv tokens, or three 128-token slots in flight.
    dict(block_kv=192),
    dict(max_concurrent_steps=3),
    # The shared kernel's overlap (PV under the next step's softmax, FA3's intra-warpgroup
    # overlap, one-sided turns) everywhere, and nowhere; by default it is on for programs of 16
    # kv blocks or more (`segment_attention.overlaps`).
    dict(shared_overlap=True),
    dict(shared_overlap=False),
    dict(block_kv=192, shared_overlap=True),  # both at once: spills registers
    # No zeroing of V rows past a partial chunk's valid tokens: what the NaN/inf guard costs
    # (its results are only right on a cache whose unattended slots are finite).
    dict(private_zero_unseen=False),
    # A private lane is one token of 8 kv heads (one 8-row tile), not 8 tokens of one kv head
    # (at K = 4 or 2: two or four tokens of every kv head).
    dict(private_token_lanes=True),
    dict(private_token_lanes=False),  # chunk lanes everywhere
)
SMALL_BATCH_VARIANTS = (dict(max_splits=8), dict(max_splits=4))  # fewer splits: cheaper merges
SMALL_BATCH = 64
HEAD_DIM = 128
DTYPE = jnp.bfloat16


CAPACITY = 0  # private tokens reserved per row (--capacity), at least S rounded up to 64


def problem(b, p, s, n, k, t=1, seed=0):
  capacity = max(CAPACITY, 64, -(-s // 64) * 64)
  plan = hydrajax.plan_tree(
      hydrajax.PromptNode(p, num_samples=b), private_capacity=capacity, private_lengths=s
  )
  layout = plan.to_device()
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, HEAD_DIM), DTYPE)
  kc = jax.random.normal(keys[1], (plan.kv_tokens, k, HEAD_DIM), DTYPE)
  vc = jax.random.normal(keys[2], (plan.kv_tokens, k, HEAD_DIM), DTYPE)
  return plan, layout, q, kc, vc


def floor_us(b, p, s, n, k, bandwidth, rate):
  kv = 2 * HEAD_DIM * k * 2 * (p + b * s)  # K and V, shared prefix once plus private
  qo = 2 * b * n * HEAD_DIM * 2 + b * n * 4
  flops = 4 * b * n * (p + s) * HEAD_DIM
  return max((kv + qo) / bandwidth, flops / rate) * 1e6, kv + qo, flops


def cupti_us(fn, arg_sets, iterations=5):
  """Median over iterations of (sum of kernel times of one pass over arg_sets) / len(arg_sets)."""
  from jax.experimental.mosaic.gpu import profiler

  many = jax.jit(lambda sets: [fn(*a) for a in sets])
  _, timings = profiler.measure(many, aggregate=False, iterations=iterations)(arg_sets)
  if iterations == 1:
    timings = [timings]
  per_call = [sum(t for _, t in it) * 1e3 / len(arg_sets) for it in timings]
  by_kernel = {}
  for name, t in timings[-1]:
    by_kernel[name] = by_kernel.get(name, 0.0) + t * 1e3 / len(arg_sets)
  return statistics.median(per_call), by_kernel


def ceilings():
  from jax.experimental.mosaic.gpu import profiler

  a = jax.random.normal(jax.random.key(1), (8192, 8192), DTYPE)
  bm = jax.random.normal(jax.random.key(2), (8192, 8192), DTYPE)
  _, ms = profiler.measure(jax.jit(lambda x, y: x @ y), iterations=5)(a, bm)
  rate = 2 * 8192**3 / (statistics.median(ms) * 1e-3)
  x = jax.random.normal(jax.random.key(3), (2**30,), DTYPE)  # 2 GiB
  _, ms = profiler.measure(jax.jit(lambda v: v * 2), iterations=5)(x)
  bandwidth = 2 * x.nbytes / (statistics.median(ms) * 1e-3)
  return rate, bandwidth


def errors(got, want):
  o, r = np.asarray(got.out, np.float32), np.asarray(want.out, np.float32)
  rel = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
  gl, wl = np.asarray(got.lse), np.asarray(want.lse)
  same_inf = bool((np.isinf(gl) == np.isinf(wl)).all())
  fin = np.isfinite(wl)
  lse = float(np.abs(gl[fin] - wl[fin]).max(initial=0.0))
  return dict(out_rel_l2=rel, lse_max_abs=lse, inf_agree=same_inf, nan=bool(np.isnan(o).any()))


def attended_mask(plan) -> np.ndarray:
  """[L] bool: the tokens some row attends."""
  mask = np.zeros(plan.kv_tokens, bool)
  indices, lengths = plan.row_token_indices()
  for row, n in enumerate(lengths):
    mask[indices[row, :n]] = True
  return mask


def dirty_layer(plan, mask, cache):
  """(buffer [2 * L', K, H] holding `cache` at layer 1 and NaN/inf/-inf wherever no row
  attends, L' = L rounded up to a page; the layer's offset L')."""
  stride = -(-plan.kv_tokens // plan.page_size) * plan.page_size
  junk = jnp.array([np.nan, np.inf, -np.inf], cache.dtype)[jnp.arange(2 * stride) % 3]
  buf = jnp.broadcast_to(junk[:, None, None], (2 * stride,) + cache.shape[1:])
  layer = jnp.where(jnp.asarray(mask)[:, None, None], cache, buf[stride : stride + plan.kv_tokens])
  return buf.at[stride : stride + plan.kv_tokens].set(layer), stride


DEEP_BUFFER_BYTES = 48 << 30  # the deep buffers' budget (32 MHA layers at B=1024 are 69 GB)


def deep_buffer_bytes() -> int:
  """DEEP_BUFFER_BYTES, or half the device's memory where that is less: on an H100 the 48 GB
  beside the rotated input sets ran out of memory (s54, shape 6)."""
  stats = jax.devices()[0].memory_stats() or {}
  return min(DEEP_BUFFER_BYTES, int(0.5 * stats.get('bytes_limit', 2 * DEEP_BUFFER_BYTES)))


def deep_layer_time(fn_a, prepared, plan, sets, layer):
  """CUPTI time of attend on each set's K/V placed at `layer` of a (layer + 1)-layer buffer.

  The layer is lowered to fit `deep_buffer_bytes()`; returns (us, kernels, layer used).
  """
  stride = -(-plan.kv_tokens // plan.page_size) * plan.page_size
  k0 = sets[0][1]
  per_layer = 2 * len(sets) * stride * math.prod(k0.shape[1:]) * k0.dtype.itemsize
  layer = max(0, min(layer, deep_buffer_bytes() // per_layer - 1))
  deep = []
  for q_, k_, v_, _ in sets:
    place = lambda x: jnp.zeros(((layer + 1) * stride,) + x.shape[1:], x.dtype).at[
        layer * stride : layer * stride + x.shape[0]].set(x)
    deep.append((q_, place(k_), place(v_), prepared))
  offset = jnp.int32(layer * stride)
  return (*cupti_us(lambda q, k, v, p: fn_a(q, k, v, p, offset), deep), layer)


def attend_fn(q, kc, layout, variant):
  """jit(q, k, v, prepared, offset) -> attend, and the prepared plan."""
  config = mosaic.MosaicGpuConfig(**variant)
  shapes = mosaic.KernelShapes.of(q, kc)
  prepared = mosaic.prepare(layout, shapes, config)
  fn = jax.jit(lambda q, k, v, p, off: mosaic.attend(
      q, k, v, p, shapes=shapes, config=config, kv_offset=off))
  return fn, prepared


def profile(shape, variant, folder):
  """One `attend` of the shape with Mosaic GPU's in-kernel profiler on (`profiling`): per
  kernel trace written, the time per named region (the private kernel's step phases)."""
  os.makedirs(folder, exist_ok=True)
  os.environ[profiling.PROFILE_DIR] = folder
  jax.clear_caches()  # kernels are built when traced: build them with the profiler
  try:
    plan, layout, q, kc, vc = problem(*shape)
    fn_a, prepared = attend_fn(q, kc, layout, variant)
    jax.block_until_ready(fn_a(q, kc, vc, prepared, jnp.int32(0)))
    jax.effects_barrier()  # the traces are written by a host callback
  finally:
    del os.environ[profiling.PROFILE_DIR]
    jax.clear_caches()
  return {name: profiling.summarize(os.path.join(folder, name))
          for name in sorted(os.listdir(folder)) if name.endswith('.json')}


def lower_only(shapes, variants):
  for shape in shapes:
    plan, layout, q, kc, vc = problem(*shape)
    for variant in variants:
      t0 = time.time()
      fn = jax.jit(lambda q, k, v, l, variant=variant: mosaic.tree_attention(q, k, v, l, **variant))
      fn.trace(q, kc, vc, layout).lower(lowering_platforms=('cuda',))
      print(f'lowered {shape} {variant} in {time.time() - t0:.1f}s')


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default=os.environ.get('OUT', '/tmp'))
  parser.add_argument('--lower_only', action='store_true')
  parser.add_argument('--shapes', default='all', help='comma-separated indices into SHAPES')
  parser.add_argument('--legacy', action='store_true', help='tree_attention only (see above)')
  parser.add_argument(
      '--variants', default='0', help="comma-separated indices into VARIANTS, or 'all'"
  )
  parser.add_argument('--attend_only', action='store_true', help='no tree_attention (see above)')
  parser.add_argument(
      '--check_shapes', default='', help="comma-separated indices into CHECK_SHAPES, or 'all'"
  )
  parser.add_argument('--capacity', type=int, default=0,
                      help='private tokens reserved per row, at least S rounded up to 64')
  parser.add_argument('--profile', action='store_true',
                      help='also run each shape once with the in-kernel profiler (traces and '
                           'time per region under --out/profile)')
  parser.add_argument('--deep_layer', type=int, default=0,
                      help='also time attend at this layer of a buffer of deep_layer + 1 layers '
                           '(kv_offset as in a model step)')
  args = parser.parse_args()
  global CAPACITY
  CAPACITY = args.capacity
  shapes = SHAPES if args.shapes == 'all' else [SHAPES[int(i)] for i in args.shapes.split(',') if i]
  checks = (
      CHECK_SHAPES if args.check_shapes == 'all'
      else [CHECK_SHAPES[int(i)] for i in args.check_shapes.split(',') if i]
  )
  variants = (
      VARIANTS if args.variants == 'all'
      else [VARIANTS[int(i)] for i in args.variants.split(',')]
  )
  if args.lower_only:
    return lower_only((*checks, *shapes), variants)
  print(jax.devices(), jax.__version__)
  os.makedirs(args.out, exist_ok=True)
  sink = open(os.path.join(args.out, 'results.jsonl'), 'a')

  start = time.time()

  def record(**kw):
    kw['elapsed_s'] = round(time.time() - start, 1)
    sink.write(json.dumps(kw) + '\n')
    sink.flush()
    print(json.dumps(kw))

  for shape, variant in itertools.product(checks, variants):  # correctness only
    try:
      plan, layout, q, kc, vc = problem(*shape)
      want = jax.jit(hydrajax.tree_attention_xla)(q, kc, vc, layout)
      fn_a, prepared = attend_fn(q, kc, layout, variant)
      got = fn_a(q, kc, vc, prepared, jnp.int32(0))
      mask = attended_mask(plan)
      dk, offset = dirty_layer(plan, mask, kc)
      dv, _ = dirty_layer(plan, mask, vc)
      dirty = fn_a(q, dk, dv, prepared, jnp.int32(offset))
      same = bool(
          np.array_equal(np.asarray(dirty.out), np.asarray(got.out))
          and np.array_equal(np.asarray(dirty.lse), np.asarray(got.lse))
      )
      problem_ = prepared.problem
      record(kind='check', shape=shape, variant=variant, problem=type(problem_).__name__,
             direct=[getattr(problem_, a) for a in ('direct', 'direct_out', 'direct_lse')
                     if hasattr(problem_, a)],
             garbage_bitwise_equal=same, **errors(got, want))
      del plan, layout, q, kc, vc, want, got, dk, dv, dirty
    except Exception as e:
      trace = ''.join(traceback.format_exception(e))[-3000:]
      record(kind='error', shape=shape, variant=variant, stage='check', error=trace)

  rate, bandwidth = ceilings()
  record(kind='ceilings', matmul_tflops=rate / 1e12, copy_tbps=bandwidth / 1e12)
  table = []
  for shape in shapes:
    b, p, s, n, k = shape
    try:
      plan, layout, q, kc, vc = problem(*shape)
    except Exception as e:  # out of memory, say
      record(kind='error', shape=shape, stage='setup', error=repr(e)[:500])
      continue
    fl, nbytes, flops = floor_us(b, p, s, n, k, bandwidth, rate)
    xla = jax.jit(lambda q, k, v, l: hydrajax.tree_attention_xla(q, k, v, l))
    want = xla(q, kc, vc, layout)
    copies = max(1, min(8, math.ceil(256 * 2**20 / (kc.nbytes + vc.nbytes))))
    sets = [(q, kc, vc, layout)]
    for i in range(1, copies):
      _, _, qi, ki, vi = problem(*shape, seed=i)
      sets.append((qi, ki, vi, layout))
    row = dict(shape=shape, floor_us=fl, bytes=nbytes, flops=flops)
    extra = SMALL_BATCH_VARIANTS if b <= SMALL_BATCH else ()
    for variant in (*variants, *extra):
      name = 'mosaic ' + (','.join(f'{a}={v}' for a, v in variant.items()) or 'default')
      fn = jax.jit(lambda q, k, v, l, variant=variant: mosaic.tree_attention(q, k, v, l, **variant))
      if not args.attend_only:
        try:
          got = fn(q, kc, vc, layout)
          err = errors(got, want)
          us, kernels = cupti_us(fn, sets)
          record(kind='time', shape=shape, impl=name, us=us, x_floor=us / fl, kernels=kernels,
                 **err)
          row[name] = (us, err['out_rel_l2'])
        except Exception as e:
          trace = ''.join(traceback.format_exception(e))[-3000:]
          record(kind='error', shape=shape, impl=name, error=trace)
          continue
      if args.legacy:
        continue
      name = name.replace('mosaic ', 'mosaic attend ')
      try:
        fn_a, prepared = attend_fn(q, kc, layout, variant)
        if args.attend_only:  # attend is the one checked against XLA
          got = fn_a(q, kc, vc, prepared, jnp.int32(0))
          err = errors(got, want)
          record(kind='check', shape=shape, impl=name, **err)
        mask = attended_mask(plan)
        dk, offset = dirty_layer(plan, mask, kc)
        dv, _ = dirty_layer(plan, mask, vc)
        dirty = fn_a(q, dk, dv, prepared, jnp.int32(offset))
        same = bool(
            np.array_equal(np.asarray(dirty.out), np.asarray(got.out))
            and np.array_equal(np.asarray(dirty.lse), np.asarray(got.lse))
        )
        record(kind='garbage', shape=shape, impl=name, bitwise_equal=same, **errors(dirty, got))
        del dk, dv, dirty
        us, kernels = cupti_us(  # the prepared plan as an argument, as in a model's step
            lambda q, k, v, p: fn_a(q, k, v, p, jnp.int32(0)),
            [(q_, k_, v_, prepared) for q_, k_, v_, _ in sets],
        )
        record(kind='time', shape=shape, impl=name, us=us, x_floor=us / fl, kernels=kernels)
        row[name] = (us, err['out_rel_l2'])
        step = mosaic.for_step(prepared)
        if step.lanes is not None:
          # A layer of a model's step: the lane table built once a step (`for_step`), not in
          # the call; the table timed alone beside it (a decode step pays it once, all layers).
          steps = [step] * len(sets)
          us, kernels = cupti_us(lambda q, k, v, p: fn_a(q, k, v, p, jnp.int32(0)),
                                 [(q_, k_, v_, p) for (q_, k_, v_, _), p in zip(sets, steps)])
          record(kind='time', shape=shape, impl=name + ' (step plan)', us=us, x_floor=us / fl,
                 kernels=kernels)
          row[name + ' (step plan)'] = (us, err['out_rel_l2'])
          us, kernels = cupti_us(lambda p: mosaic.for_step(p).lanes, [(prepared,)] * len(sets))
          record(kind='time', shape=shape, impl='lane table (for_step)', us=us, kernels=kernels)
        if args.deep_layer:
          us, kernels, layer = deep_layer_time(fn_a, prepared, plan, sets, args.deep_layer)
          record(kind='time', shape=shape, impl=name + f',layer={layer}', x_floor=us / fl,
                 us=us, kernels=kernels)
          row[name + f' layer {layer}'] = (us, err['out_rel_l2'])
      except Exception as e:
        trace = ''.join(traceback.format_exception(e))[-3000:]
        record(kind='error', shape=shape, impl=name, error=trace)
    if args.profile:
      try:
        folder = os.path.join(args.out, 'profile', '_'.join(map(str, shape)))
        record(kind='profile', shape=shape, regions=profile(shape, variants[0], folder))
      except Exception as e:
        trace = ''.join(traceback.format_exception(e))[-3000:]
        record(kind='error', shape=shape, stage='profile', error=trace)
    try:
      us, kernels = cupti_us(xla, sets)
      record(kind='time', shape=shape, impl='xla', us=us, x_floor=us / fl, kernels=kernels)
      row['xla'] = (us, 0.0)
    except Exception as e:
      record(kind='error', shape=shape, impl='xla', error=repr(e)[:1000])
    table.append(row)
    del sets, plan, layout, q, kc, vc, want

  print('\n| B | P | S | q/kv | floor us | impl | us | x floor | out rel err |')
  print('|---|---|---|---|---|---|---|---|---|')
  for row in table:
    b, p, s, n, k = row['shape']
    for impl, value in row.items():
      if impl in ('shape', 'floor_us', 'bytes', 'flops'):
        continue
      us, err = value
      print(f'| {b} | {p} | {s} | {n}/{k} | {row["floor_us"]:.0f} | {impl} | {us:.1f} | '
            f'{us / row["floor_us"]:.2f} | {err:.1e} |')
  sink.close()


if __name__ == '__main__':
  sys.exit(main())
