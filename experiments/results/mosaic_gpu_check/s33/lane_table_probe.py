"""The lane table alone, before (session 32's `lane_table`, copied below) and after (the library's:
elementwise over a frame's rows), CUPTI kernel time and XLA fusions, at check_on_device's shapes.

    PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s33/lane_table_probe.py --shapes 0,1,5

Checks that both tables are equal first. `--random_cases N` (any backend, CPU included) only
compares the two tables on N random problems (B, T, G, page size, lengths with zeros, pages),
as `test_lane_table_is_the_kernels_chunk_walk` draws them.
"""
import argparse
import dataclasses
import json

import jax
import numpy as np

import pallas_kernels.mosaic_gpu.private_attention as pa
from pallas_kernels.mosaic_gpu import check_on_device as cod
from pallas_kernels.mosaic_gpu import tree_attention as mosaic
from pallas_kernels.mosaic_gpu.private_attention import *  # the old table's names
from pallas_kernels.mosaic_gpu.private_attention import _LANES, CHUNK, WG_M

def old_lane_table(private_lengths, private_pages, problem: PrivateProblem) -> jax.Array:
  """The plan of every step of every frame, as the kernel's chunk walk would make it.

  [num_frames, lane_steps, LANE_FIELDS] int32: per step, each lane's first KV token (relative
  to the layer: the kernel adds kv_offset; 0 for a lane with no chunk), whether the 8 chunks
  are 64 contiguous tokens, and the lanes' valid tokens packed 4 bits a lane. A step's lanes
  depend only on the rows' private lengths and pages, so one table per decode step serves all
  layers and kv heads, and the kernel's plan is 10 reads instead of a walk of 8 dependent
  lanes. Rows run after each other, max(chunks, 1) lanes a row (a row with no chunk takes one
  empty lane), rows past the batch none.
  """
  steps = problem.lane_steps
  r_rows, b_rows, c = problem.rows_per_frame, problem.num_rows, problem.page_size
  tgp, t_tok, g_size = problem.rows_per_query, problem.query_tokens, problem.group_size
  frames = jnp.arange(problem.num_frames, dtype=jnp.int32)
  if r_rows > 1 or tgp <= WG_M:
    row0, q0 = frames * r_rows, jnp.zeros_like(frames)
  else:  # one query row over several 64-row tiles
    tiles = tgp // WG_M
    row0, q0 = frames // tiles, (frames % tiles) * WG_M
  rows = row0[:, None] + jnp.arange(r_rows, dtype=jnp.int32)  # [F, R]
  inside = rows < b_rows
  lengths = jnp.asarray(private_lengths, jnp.int32)
  length = jnp.where(inside, lengths[jnp.minimum(rows, b_rows - 1)], 0)
  if t_tok == 1 or r_rows > 1 or tgp <= WG_M:
    seen = length  # the last query token sees the whole row
  else:  # the tile's last query token
    t_last = jnp.minimum((q0 + WG_M - 1) // g_size, t_tok - 1)[:, None]
    seen = jnp.clip(length - t_tok + 1 + t_last, 0, length)
  chunks = (seen + CHUNK - 1) // CHUNK
  ends = jnp.cumsum(jnp.where(inside, jnp.maximum(chunks, 1), 0), axis=1)  # [F, R]
  lane = jnp.arange(steps * _LANES, dtype=jnp.int32)
  r = jnp.sum(ends[:, None, :] <= lane[None, :, None], axis=-1)  # [F, lanes]: its row, R past
  rr = jnp.minimum(r, r_rows - 1)
  take = lambda a: jnp.take_along_axis(a, rr, axis=1)
  i = lane[None] - (take(ends) - jnp.where(take(inside), jnp.maximum(take(chunks), 1), 0))
  real = (r < r_rows) & (i < take(chunks))
  pos = i * CHUNK
  valid = jnp.where(real, jnp.clip(take(length) - pos, 0, CHUNK), 0)
  pages = jnp.asarray(private_pages, jnp.int32)
  page = jnp.clip(pos // c, 0, pages.shape[1] - 1)
  page_row = jnp.minimum(row0[:, None] + rr, pages.shape[0] - 1)
  tok = jnp.where(real, pages[page_row, page] * c + pos - page * c, 0)
  shape = (problem.num_frames, steps, _LANES)
  tok, real, r, valid = (x.reshape(shape) for x in (tok, real, r, valid))
  step = jnp.arange(_LANES, dtype=jnp.int32) * CHUNK
  contiguous = jnp.all(real & (r == r[..., :1]) & (tok == tok[..., :1] + step), axis=-1)
  packed = jnp.zeros(shape[:2], jnp.int32)
  for j in range(_LANES):  # lane 7's bit 31 wraps to the sign, as the kernel's int32 does
    packed = packed | lax.shift_left(valid[..., j], jnp.int32(4 * j))
  return jnp.concatenate([tok, contiguous[..., None].astype(jnp.int32), packed[..., None]], -1)


def compare_random(cases: int, seed: int):
  from pallas_kernels.mosaic_gpu import schedule
  rng = np.random.default_rng(seed)
  unequal = 0
  for _ in range(cases):
    b, t = int(rng.integers(1, 1100)), int(rng.choice([1, 1, 2, 3, 8]))
    g, page = int(rng.choice([1, 2, 4, 8, 32, 64])), int(rng.choice([8, 16, 64, 128]))
    tgp = schedule.padded_rows_per_query(t * g)
    problem = PrivateProblem(b, t, g, tgp, schedule.private_frame_rows(b, tgp, 8, 132), page)
    max_pages = int(rng.integers(1, 5))
    problem = dataclasses.replace(problem, lane_steps=pa.lane_steps(problem, max_pages))
    lengths = rng.integers(0, max_pages * page + 1, b)
    lengths[rng.random(b) < 0.2] = 0
    pages = rng.permutation(4 * b * max_pages)[: b * max_pages].reshape(b, max_pages)
    equal = np.array_equal(np.asarray(old_lane_table(lengths, pages, problem)),
                           np.asarray(pa.lane_table(lengths, pages, problem)))
    unequal += not equal
  print(json.dumps(dict(random_cases=cases, seed=seed, unequal=unequal,
                        backend=jax.default_backend())), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--shapes', default='0,1,5')
  parser.add_argument('--capacity', type=int, default=128)
  parser.add_argument('--random_cases', type=int, default=0)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  if args.random_cases:
    return compare_random(args.random_cases, args.seed)
  cod.CAPACITY = args.capacity
  for i in args.shapes.split(','):
    shape = cod.SHAPES[int(i)]
    plan, layout, q, kc, vc = cod.problem(*shape)
    prepared = mosaic.prepare(layout, mosaic.KernelShapes.of(q, kc), mosaic.MosaicGpuConfig())
    problem = prepared.problem
    args_ = (prepared.private_lengths, prepared.private_pages)
    row = dict(shape=shape, lane_steps=problem.lane_steps, frames=problem.num_frames,
               rows_per_frame=problem.rows_per_frame)
    tables = {}
    for name, fn in (('old', old_lane_table), ('new', pa.lane_table)):
      f = jax.jit(lambda l, p, fn=fn: fn(l, p, problem))
      tables[name] = np.asarray(f(*args_))
      us, kernels = cod.cupti_us(f, [args_] * 4, iterations=9)
      row[name] = dict(us=round(us, 2), kernels={k: round(v, 2) for k, v in kernels.items()})
    row['equal'] = bool(np.array_equal(tables['old'], tables['new']))
    print(json.dumps(row), flush=True)


if __name__ == '__main__':
  main()
