"""Checks and times the training kernels of `training_attention.py` on a Hopper GPU.

On the GPU machine, from the repository root (about a minute):

  PYTHONPATH=. python3 -m experiments.mosaic_gpu.check_training > /tmp/mosaic_check/check_training.txt 2>&1

checks segment_forward / segment_backward against their jnp references on small
shapes (GQA, MQA, MHA, a kv_length that is no block multiple, an empty segment, NaN
in the masked K/V), and causal_forward / causal_backward likewise (T no block
multiple, lengths above and below T), then times each kernel at the benchmark shape
(G=64 x T=1024 query rows, a 8192-token prompt, 32/8 heads, d=128, bf16; causal: the
64 completions of 1024 tokens, and the prompt's 8192 x 8192) with CUPTI.

On a CPU machine, `--lower_only` cross-lowers the benchmark shape for CUDA
(Pallas -> Mosaic GPU MLIR, TMA and layout checks; not ptxas).

`--breakdown=16:1024:2048,...` times prefill_attention's forward + backward at G:P:T points
(CUPTI: the top kernels, and every Mosaic GPU launch in order), under each of `--configs`.

`--configs` checks and times several `TrainingKernelConfig`s in one call, each a
comma-separated list of overrides, the configs separated by semicolons ('' is the
default); a config that fails to build is reported and the next one runs:

  ... -m experiments.mosaic_gpu.check_training --configs=';block_q_dq=128;compute_wgs=1'

With `--out DIR` every check and timing is also a line of `DIR/results.jsonl` (kind check,
time or breakdown; the config's fields in `config`).
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.attention.training import prefill_layout as pl
from pallas_kernels.knobs import config_from_knobs
from pallas_kernels.mosaic_gpu import training_attention as ta

BENCH = dict(m=65536, n=32, k=8, h=128, s=8192)
CAUSAL_BENCH = dict(completions=(64, 1024), prompt=(1, 8192))  # (Z rows, T tokens)
CAUSAL_CHECKS = (  # (N, K, H, T, S, lengths)
    (8, 2, 128, 200, 384, (384, 200, 150)),
    (4, 1, 128, 256, 256, (256, 256)),
    (4, 4, 64, 130, 260, (259, 130)),
)
CHECKS = (  # (M, N, K, H, S, kv_length)
    (384, 8, 2, 128, 512, 300),
    (256, 4, 1, 128, 256, 256),
    (128, 4, 4, 64, 384, 129),
    (128, 4, 2, 128, 256, 0),
)


_SINK = []  # the open results.jsonl when --out is given


def record(kind: str, cfg, **fields):
  """One line of results.jsonl (when --out was given): kind, the config's fields, fields."""
  if _SINK:
    config = dataclasses.asdict(cfg or ta.TrainingKernelConfig())
    _SINK[0].write(json.dumps(dict(kind=kind, config=config, **fields)) + '\n')
    _SINK[0].flush()


def inputs(m, n, k, h, s, length, seed=0, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(seed), 4)
  draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  q, do = draw(keys[0], (m, n, h)), draw(keys[3], (m, n, h))
  kk, v = draw(keys[1], (s, k, h)), draw(keys[2], (s, k, h))
  kk, v = (x.at[length:].set(jnp.nan) for x in (kk, v))  # masked: must not reach outputs
  return q, kk, v, do


def check(m, n, k, h, s, length, cfg=None):
  q, kk, v, do = inputs(m, n, k, h, s, length)
  scale = h**-0.5
  out, lse = jax.jit(lambda *a: ta.segment_forward(*a, scale=scale, config=cfg))(q, kk, v, length)
  r_out, r_lse = ta.segment_forward_reference(q, kk, v, length, scale=scale)
  delta = jnp.sum(do.astype(jnp.float32) * r_out.astype(jnp.float32), -1)
  grads = jax.jit(lambda *a: ta.segment_backward(*a, scale=scale, config=cfg))(
      q, kk, v, do, r_lse, delta, length)
  refs = ta.segment_backward_reference(q, kk, v, do, r_lse, delta, length, scale=scale)
  errs = {}
  for name, a, r in zip(('out', 'lse', 'dq', 'dk', 'dv'), (out, lse) + tuple(grads),
                        (r_out, r_lse) + tuple(refs)):
    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    fin = np.isfinite(r)
    ok = (np.isfinite(a) == fin).all()
    errs[name] = float(np.abs(a[fin] - r[fin]).max(initial=0.0)) if ok else float('nan')
  print(f'check M={m} N={n} K={k} H={h} S={s} kv_length={length}: max abs err {errs}', flush=True)
  passed = all(e <= 3e-2 for e in errs.values())
  record('check', cfg, kernel='segment', shape=dict(m=m, n=n, k=k, h=h, s=s, kv_length=length),
         max_abs_err=errs, passed=passed)
  return passed


def check_causal(n, k, h, t, s, lengths, cfg=None):
  keys = jax.random.split(jax.random.key(1), 4)
  draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
  z = len(lengths)
  q, do = draw(keys[0], (z, t, n, h)), draw(keys[3], (z, t, n, h))
  unseen = (jnp.arange(s)[None, :] >= jnp.asarray(lengths)[:, None])[..., None, None]
  kk, v = (jnp.where(unseen, jnp.nan, draw(key, (z, s, k, h))) for key in keys[1:3])
  lengths, scale = jnp.asarray(lengths), h**-0.5
  out, lse = jax.jit(lambda *a: ta.causal_forward(*a, scale=scale, config=cfg))(q, kk, v, lengths)
  r_out, r_lse = ta.causal_forward_reference(q, kk, v, lengths, scale=scale)
  delta = jnp.sum(do.astype(jnp.float32) * r_out.astype(jnp.float32), -1)
  args = (q, kk, v, do, r_lse, delta, lengths)
  grads = jax.jit(lambda *a: ta.causal_backward(*a, scale=scale, config=cfg))(*args)
  refs = ta.causal_backward_reference(*args, scale=scale)
  errs = {}
  for name, a, r in zip(('out', 'lse', 'dq', 'dk', 'dv'), (out, lse) + tuple(grads),
                        (r_out, r_lse) + tuple(refs)):
    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    fin = np.isfinite(r)
    ok = (np.isfinite(a) == fin).all()
    size = max(1.0, float(np.abs(r[fin]).max(initial=0.0)))  # bf16 outputs: relative to that
    errs[name] = float(np.abs(a[fin] - r[fin]).max(initial=0.0)) / size if ok else float('nan')
  print(f'check causal N={n} K={k} H={h} T={t} S={s} lengths={lengths.tolist()}: '
        f'max err / max(1, max |ref|) {errs}', flush=True)
  passed = all(e <= 3e-2 for e in errs.values())
  record('check', cfg, kernel='causal',
         shape=dict(n=n, k=k, h=h, t=t, s=s, lengths=lengths.tolist()),
         max_err_over_max_ref=errs, passed=passed)
  return passed


def cupti_ms(fn, *args, launches=False):
  """(median ms of a call over 5, {kernel name: ms} of the last call; launches=True: also the
  last call's [(kernel name, ms)] in launch order)."""
  from jax.experimental.mosaic.gpu import profiler

  _, timings = profiler.measure(fn, aggregate=False, iterations=5)(*args)
  per_call = [sum(t for _, t in it) for it in timings]
  by_kernel = {}
  for name, t in timings[-1]:  # kernels of one name (several launches) summed
    by_kernel[name] = by_kernel.get(name, 0.0) + t
  if launches:
    return statistics.median(per_call), by_kernel, list(timings[-1])
  return statistics.median(per_call), by_kernel


def bench(cfg=None):
  """Prints and returns {'<part> <pass>': ms} of every kernel pass at the benchmark shapes."""
  b = BENCH
  times = {}
  q, kk, v, do = inputs(b['m'], b['n'], b['k'], b['h'], b['s'], b['s'])
  scale = b['h']**-0.5
  fwd = jax.jit(lambda *a: ta.segment_forward(*a, scale=scale, config=cfg))
  out, lse = fwd(q, kk, v, b['s'])
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
  bwd = jax.jit(lambda *a: ta.segment_backward(*a, scale=scale, config=cfg))
  flops = 4 * b['m'] * b['n'] * b['s'] * b['h']  # QK^T and PV; the backward has 7 such matmuls
  for name, fn, args, mult in (('forward', fwd, (q, kk, v, b['s']), 1),
                               ('backward', bwd, (q, kk, v, do, lse, delta, b['s']), 3.5)):
    ms, kernels = cupti_ms(fn, *args)
    times[f'segment {name}'] = ms
    record('time', cfg, part=f'segment {name}', shape=b, ms=ms,
           tflops=mult * flops / ms / 1e9, kernels=kernels)
    print(f'{name}: {ms:.2f} ms, {mult * flops / ms / 1e9:.0f} TFLOP/s; kernels (ms): '
          + ', '.join(f'{k[:60]}={t:.2f}' for k, t in kernels.items()), flush=True)
  for label, (z, t) in CAUSAL_BENCH.items():
    keys = jax.random.split(jax.random.key(2), 4)
    draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    q, do = draw(keys[0], (z, t, b['n'], b['h'])), draw(keys[3], (z, t, b['n'], b['h']))
    kk, v = (draw(key, (z, t, b['k'], b['h'])) for key in keys[1:3])
    lengths = jnp.full((z,), t, jnp.int32)
    fwd = jax.jit(lambda *a: ta.causal_forward(*a, scale=scale, config=cfg))
    out, lse = fwd(q, kk, v, lengths)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
    bwd = jax.jit(lambda *a: ta.causal_backward(*a, scale=scale, config=cfg))
    flops = 2 * z * b['n'] * t * t * b['h']  # QK^T and PV over the lower half of T x T
    for name, fn, args, mult in (('forward', fwd, (q, kk, v, lengths), 1),
                                 ('backward', bwd, (q, kk, v, do, lse, delta, lengths), 3.5)):
      ms, kernels = cupti_ms(fn, *args)
      times[f'causal {label} {name}'] = ms
      record('time', cfg, part=f'causal {label} {name}', shape=dict(z=z, t=t, **b), ms=ms,
             tflops=mult * flops / ms / 1e9, kernels=kernels)
      print(f'causal {label} (Z={z}, T={t}) {name}: {ms:.2f} ms, '
            f'{mult * flops / ms / 1e9:.0f} TFLOP/s; kernels (ms): '
            + ', '.join(f'{k[:60]}={t_ms:.2f}' for k, t_ms in kernels.items()), flush=True)
  return times


def parse_config(text: str) -> ta.TrainingKernelConfig:
  """'block_kv=64,compute_wgs=1' -> TrainingKernelConfig with those fields ('' the default)."""
  return config_from_knobs(ta.TrainingKernelConfig, text.split(','))


def sweep(texts):
  """Checks and times each config; one that fails to build or check is reported, not fatal."""
  rows = []
  for text in texts:
    cfg = parse_config(text)
    print(f'== config {text or "default"}: {cfg}', flush=True)
    try:
      ok = all([check(*c, cfg=cfg) for c in CHECKS]
               + [check_causal(*c, cfg=cfg) for c in CAUSAL_CHECKS])
      rows.append((text or 'default', ok, bench(cfg) if ok else {}))
    except Exception as e:  # a config past the registers or shared memory: say so, go on
      print(f'config {text or "default"} failed: {type(e).__name__}: {str(e)[:400]}', flush=True)
      rows.append((text or 'default', False, {}))
  names = sorted({k for _, _, times in rows for k in times})
  print('| config | checks | ' + ' | '.join(f'{k} ms' for k in names) + ' |')
  print('| --- ' * (len(names) + 2) + '|')
  for text, ok, times in rows:
    cells = [f'{times[k]:.2f}' if k in times else '' for k in names]
    print(f'| {text} | {"passed" if ok else "FAILED"} | ' + ' | '.join(cells) + ' |', flush=True)


def prefill_breakdown(g=64, p=8192, t=1024, n=32, kh=8, h=128, cfg=None):
  """CUPTI kernel times of prefill_attention's forward + backward (MOSAIC_GPU): the top 15 by
  name, and every Mosaic GPU launch in order (which part each is: the order of the VJP)."""
  layout = pl.plan_prefill([p], g, t).to_device()
  keys = iter(jax.random.split(jax.random.key(0), 8))
  draw = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(jnp.bfloat16)
  args = (draw(1, p, n, h), draw(g, t, n, h), draw(1, p, kh, h), draw(g, t, kh, h),
          draw(1, p, kh, h), draw(g, t, kh, h))

  def shared(q_p, q_c, k_p, k_c, v_p, v_c):
    kb, vb = pl.write_kv(layout, k_p, k_c), pl.write_kv(layout, v_p, v_c)
    prompt, completion = pl.prefill_attention(q_p, q_c, kb, vb, layout,
                                              impl=AttentionImpl.MOSAIC_GPU, kernel_config=cfg)
    return prompt.out, completion.out

  def run(cotangents, *a):  # random cotangents, passed in (as in experiments.train_bench)
    _, vjp = jax.vjp(shared, *a)
    return vjp(cotangents)

  outs = jax.eval_shape(shared, *args)
  cotangents = tuple(draw(*o.shape) for o in outs)
  ms, kernels, launches = cupti_ms(jax.jit(run), cotangents, *args, launches=True)
  mosaic = [(name.split('_mosaic_gpu')[0], t_ms) for name, t_ms in launches
            if 'mosaic_gpu' in name]
  record('breakdown', cfg, shape=dict(g=g, p=p, t=t, n=n, k=kh, h=h), ms=ms, kernels=kernels,
         mosaic_launches=mosaic)
  print(f'prefill fwd+bwd G={g} P={p} T={t}: {ms:.2f} ms (kernel sum); top kernels (ms):')
  for name, t_ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:15]:
    print(f'  {t_ms:8.3f}  {name[:100]}', flush=True)
  print('  Mosaic GPU launches in order (ms): '
        + ', '.join(f'{name}={t_ms:.3f}' for name, t_ms in mosaic), flush=True)


def _lower(forward, backward, q, kv, stat, length, cfg):
  sd = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  q, kv, stat, length = sd(q), sd(kv), sd(stat, jnp.float32), sd(length, jnp.int32)
  jax.jit(lambda *a: forward(*a, scale=0.1, config=cfg)).trace(q, kv, kv, length).lower(
      lowering_platforms=('cuda',))
  jax.jit(lambda *a: backward(*a, scale=0.1, config=cfg)).trace(
      q, kv, kv, q, stat, stat, length).lower(lowering_platforms=('cuda',))


def lower_only(cfg=None):
  b = BENCH
  n, k, h = b['n'], b['k'], b['h']
  t0 = time.time()
  _lower(ta.segment_forward, ta.segment_backward, (b['m'], n, h), (b['s'], k, h), (b['m'], n), (),
         cfg)
  print(f'lowered segment forward and backward at {b} in {time.time() - t0:.1f}s', flush=True)
  for name, (z, t) in CAUSAL_BENCH.items():
    t0 = time.time()
    _lower(ta.causal_forward, ta.causal_backward, (z, t, n, h), (z, t, k, h), (z, t, n), (z,),
           cfg)
    print(f'lowered causal forward and backward, {name}: Z={z} x T={t}, {n}/{k} heads, d={h}, '
          f'in {time.time() - t0:.1f}s', flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--lower_only', action='store_true')
  parser.add_argument('--no_bench', action='store_true')
  parser.add_argument('--breakdown', nargs='?', const='64:8192:1024', default=None,
                      help='prefill_attention kernel times at G:P:T points (comma-separated; '
                           'under each of --configs)')
  parser.add_argument('--configs', default=None,
                      help="TrainingKernelConfig overrides to check and time, ';'-separated")
  parser.add_argument('--out', default=None, help='folder for results.jsonl (none: print only)')
  args = parser.parse_args()
  if args.lower_only:
    for text in (args.configs or '').split(';'):
      print(f'== config {text or "default"}', flush=True)
      try:
        lower_only(parse_config(text))
      except ValueError as e:  # e.g. past the shared memory: say so, lower the next
        print(f'config {text or "default"} failed to lower: {str(e)[:400]}', flush=True)
    return
  print(jax.devices(), jax.__version__, flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    _SINK.append(open(os.path.join(args.out, 'results.jsonl'), 'a'))
  if args.breakdown:
    for text in (args.configs or '').split(';'):
      print(f'== config {text or "default"}', flush=True)
      for point in args.breakdown.split(','):
        g, p, t = (int(x) for x in point.split(':'))
        prefill_breakdown(g, p, t, cfg=parse_config(text) if text else None)
    return
  if args.configs is not None:
    return sweep(args.configs.split(';'))
  ok = all([check(*c) for c in CHECKS] + [check_causal(*c) for c in CAUSAL_CHECKS])
  print('checks', 'passed' if ok else 'FAILED', flush=True)
  if not args.no_bench:
    bench()


if __name__ == '__main__':
  main()
