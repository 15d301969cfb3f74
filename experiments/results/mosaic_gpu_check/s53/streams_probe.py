"""Does a second CUDA stream let the shared kernel (tensor cores) run beside the private kernel
(memory) on a Hopper GPU? A probe for issue 10, not library code.

The CodeLlama-7B step runs the two Mosaic GPU kernels of a layer one after the other, while the
attention floor counts them as overlapped: at B=1024, P=1K the shared kernel takes ~37 µs a layer
and the private one 73-81 (s50), against a floor of about the private reads alone; at P=16K the
shared ~440 and the private ~62 against the shared FLOPs. Within one layer the private kernel
merges the shared kernel's partial state, so they depend on each other. Here a chain of layers
breaks that on purpose: layer i's private kernel merges layer i-1's shared partial state, so
shared(i) and private(i) are independent and XLA may run them on two streams
(`jax.experimental.compute_on`, `gpu_stream:1`: XLA's stream annotation, custom calls included).
If the chain's wall time per layer drops from shared + private towards max(shared, private),
splitting a real layer's kv heads into two halves (shared(A), then private(A) beside shared(B),
then private(B)) is worth building. Timed by wall clock over whole calls (CUPTI's kernel sums
cannot show overlap), each variant's outputs checked equal to the one-stream chain.

  PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s53/streams_probe.py --out $OUT
"""

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from pallas_kernels.mosaic_gpu import check_on_device as cod
from pallas_kernels.mosaic_gpu import tree_attention as mosaic
from pallas_kernels.mosaic_gpu.private_attention import private_attention
from pallas_kernels.mosaic_gpu.schedule import ALIGN, TILE_M, round_up
from pallas_kernels.mosaic_gpu.segment_attention import segment_attention

LAYERS = 8


def kernels(q, kc, layout, interpret=False):
  """(fold, shared, private) of `mosaic._attend`'s non-paged branch at the default config."""
  config = mosaic.DEFAULT_CONFIG
  shapes = mosaic.KernelShapes.of(q, kc)
  prepared = mosaic.for_step(mosaic.prepare(layout, shapes, config))
  problem = prepared.problem
  b, _, n, _ = q.shape
  kh, tgp = shapes.num_kv_heads, problem.rows_per_query
  rows = round_up(max(b * tgp, problem.num_frames * problem.frame_rows) + TILE_M, ALIGN)
  by_row = problem.q_by_row
  scale = shapes.head_dim**-0.5

  def fold(q):
    if by_row:
      g = n // kh
      return q.reshape(b * tgp // g, kh, *((g,) if g > 1 else ()), q.shape[-1])
    return mosaic._fold_queries(q, kh, tgp, rows)

  def shared(qf, k, v, p):
    return segment_attention(qf, k, v, p.segments, p.schedule, scale=scale,
                             config=config.segment_kernel, kv_offset=jnp.int32(0), q_by_row=by_row,
                             interpret=interpret)

  def private(qf, k, v, p, partial_out, partial_lse):
    return private_attention(qf, k, v, p.private_pages, p.private_lengths, p.row_segments,
                             p.segments, p.schedule, partial_out, partial_lse, problem,
                             scale=scale, kv_offset=jnp.int32(0), lanes=p.lanes,
                             interpret=interpret)
  return prepared, fold, shared, private


def chain(fold, shared, private, where: str):
  """LAYERS layers; layer i's private kernel merges layer i-1's shared partial state.
  where: 'one' (one stream), 'shared' or 'private' (that kernel on gpu_stream:1)."""
  on_side = lambda f: compute_on(f, compute_type='gpu_stream:1',
                                 out_memory_spaces=jax.memory.Space.Device)
  shared_k = on_side(shared) if where == 'shared' else shared
  private_k = on_side(private) if where == 'private' else private

  @jax.jit
  def run(qs, k, v, p):
    qfs = [fold(q) for q in qs]
    partial = shared(qfs[0], k, v, p)
    outs = []
    for i in range(1, LAYERS + 1):
      nxt = shared_k(qfs[i], k, v, p) if i < LAYERS else None
      outs.append(private_k(qfs[i - 1], k, v, p, *partial))
      partial = nxt
    return outs
  return run


def wall_us(fn, args, repeats=20):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e6


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default=os.environ.get('OUT', '/tmp'))
  parser.add_argument('--prefixes', default='1024,16384')
  parser.add_argument('--batch', type=int, default=1024)
  parser.add_argument('--private', type=int, default=13)
  parser.add_argument('--heads', type=int, default=32)
  parser.add_argument('--interpret', action='store_true', help='CPU check of the chain (tiny)')
  args = parser.parse_args()
  global LAYERS
  if args.interpret:
    LAYERS = 2
  cod.CAPACITY = 128  # the 7B step's private pages
  records = []
  for p in (int(x) for x in args.prefixes.split(',')):
    _, layout, q, kc, vc = cod.problem(args.batch, p, args.private, args.heads, args.heads)
    qs = [q * (1 + 0.01 * i) for i in range(LAYERS + 1)]
    prepared, fold, shared, private = kernels(q, kc, layout, args.interpret)
    # Each kernel alone, LAYERS times in one call (CUPTI sums and wall clock).
    qfs = jax.jit(lambda qs: [fold(q) for q in qs])(qs[:LAYERS])
    partial = jax.jit(shared)(qfs[0], kc, vc, prepared)
    alone = {
        'shared': jax.jit(lambda qfs, k, v, p, part: [shared(q, k, v, p) for q in qfs]),
        'private': jax.jit(lambda qfs, k, v, p, part: [private(q, k, v, p, *part) for q in qfs]),
    }
    rec = dict(batch=args.batch, prefix=p, private=args.private, layers=LAYERS,
               device=jax.devices()[0].device_kind)
    for name, fn in alone.items():
      fargs = (qfs, kc, vc, prepared, partial)
      rec[f'{name}_alone_wall_us'] = wall_us(fn, fargs, repeats=2 if args.interpret else 20) / LAYERS
      if not args.interpret:
        rec[f'{name}_alone_cupti_us'] = cod.cupti_us(fn, [fargs])[0] / LAYERS
    want = None
    for where in ('one', 'shared', 'private'):
      try:
        fn = chain(fold, shared, private, where)
        got = fn(qs, kc, vc, prepared)
        if want is None:
          want = [np.asarray(o.astype(jnp.float32) if o.dtype != jnp.float32 else o)
                  for pair in got for o in pair]
        else:
          same = all(np.array_equal(np.asarray(o.astype(jnp.float32)
                                               if o.dtype != jnp.float32 else o), w)
                     for o, w in zip((o for pair in got for o in pair), want))
          rec[f'{where}_equal'] = same
        rec[f'{where}_wall_us'] = wall_us(fn, (qs, kc, vc, prepared),
                                          repeats=2 if args.interpret else 20) / LAYERS
        hlo = fn.lower(qs, kc, vc, prepared).compile().as_text()
        rec[f'{where}_stream_annotated'] = '_xla_stream_annotation' in hlo
      except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
        rec[f'{where}_error'] = f'{type(e).__name__}: {e}'[:1500]
    print(json.dumps(rec), flush=True)
    records.append(rec)
  with open(os.path.join(args.out, 'streams_probe.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)


if __name__ == '__main__':
  main()
