"""The run and the report shared by the rollout-tree benchmarks (`train_tree_bench`,
`train_tree_step`): points P:B:L:G:T, one record per variant and point (written when the variant
ends), and a point's `speedups` record (the tree's, written when the point ends)."""

import contextlib
import gc
import os
import time
import traceback
from typing import Callable, Sequence

from absl import app, logging
import jax

from hydrajax.shapes import AttentionShapes
from experiments.benchmarking import report, roofline, sweep, timing
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.attention.dispatch import training_unsupported_reason

POINT_FIELDS = ('P', 'B', 'L', 'G', 'T')


def impl_of(name: str) -> AttentionImpl:
  """A variant's attention kernels: its name ends in mosaic_gpu or is on the XLA path."""
  return AttentionImpl.MOSAIC_GPU if name.endswith('mosaic_gpu') else AttentionImpl.XLA


def unsupported(name: str, shapes: AttentionShapes) -> str | None:
  """Why a variant cannot run here (shapes: its attention's), or None."""
  if name == 'per_seq_cudnn' and jax.default_backend() != 'gpu':
    return 'cuDNN needs a GPU'
  if name.endswith('mosaic_gpu'):
    return training_unsupported_reason(AttentionImpl.MOSAIC_GPU, shapes)
  return None


def parse_points(points: Sequence[str]) -> list[tuple[int, ...]]:
  """'P:B:L:G:T' strings -> tuples; a usage error unless five ints >= 1 with G a multiple of B."""
  parsed = [tuple(int(x) for x in p.split(':')) for p in points]
  for p in parsed:
    if len(p) != 5 or min(p) < 1 or p[3] % p[1]:
      raise app.UsageError(f'--points: P:B:L:G:T with G a multiple of B, got {p}')
  return parsed


@contextlib.contextmanager
def variant(rec: dict, emit: Callable[[dict], None]):
  """Runs one variant's measurement: an exception in it is logged and recorded as rec's
  status 'error' (one failing variant must not end the sweep); rec is emitted either way."""
  try:
    yield
  except Exception as e:
    logging.error('%s at %s: %s', rec['impl'], ':'.join(str(rec[f]) for f in POINT_FIELDS),
                  traceback.format_exc(limit=3))
    rec.update(status='error', reason=f'{type(e).__name__}: {str(e)[:300]}')
  logging.info('%s at %s: %s, %s s', rec['impl'], ':'.join(str(rec[f]) for f in POINT_FIELDS),
               rec.get('status'), rec.get('time_s'))
  emit(rec)
  gc.collect()


def record_time(rec: dict, fn, args, *, repeats: int, target_s: float) -> None:
  """Sets rec's status and time: fn(*args)'s median device time over its floor_s, or
  'untimeable' at or below the timer's noise (a loaded or tiny machine)."""
  time_s = timing.device_time(fn, *args, repeats=repeats, target_s=target_s,
                              min_iters=1).median_s
  if time_s <= 0:
    rec.update(status='untimeable', reason=sweep.UNTIMEABLE)
  else:
    rec.update(status='ok', time_s=time_s, time_over_floor=time_s / rec['floor_s'])


def add_speedups(records: list[dict], is_tree: Callable[[str], bool]) -> dict | None:
  """speedup_vs_<impl> on the first timed tree variant of one point's records: each other timed
  variant's time over its own. Returns them as a `speedups` record (None without a timed tree)."""
  tree = next((r for r in records if is_tree(r['impl']) and r.get('time_s')), None)
  if tree is None:
    return None
  for r in records:
    if r is not tree and r.get('time_s'):
      tree[f"speedup_vs_{r['impl']}"] = r['time_s'] / tree['time_s']
  return {'kind': 'speedups', 'impl': tree['impl'], **{f: tree[f] for f in POINT_FIELDS},
          **{k: v for k, v in tree.items() if k.startswith('speedup_vs_')}}


def run(workdir: str, points, impls: Sequence[str], run_point, *,
        is_tree: Callable[[str], bool], columns: Sequence[tuple], header: str, title: str,
        ylabel: str) -> list[dict]:
  """Measures the ceilings, runs `run_point(point, ceilings, emit)` at every point (each record
  it emits is written at once, so a lost machine keeps every variant that ended), then the
  point's speedups (`add_speedups`), then writes table.md (`header`, then the table: the point,
  time, floor, the tree variant's speedups, `columns`, status), time.png and README.md into
  `workdir`."""
  writer = report.fresh_jsonl(os.path.join(workdir, 'results.jsonl'))
  start = time.perf_counter()
  ceilings = roofline.measure_backend_ceilings()
  writer.append(ceilings.record())
  records = []
  for point in report.progress(points, desc=title):
    logging.info('point P:B:L:G:T=%s (%.0f s)', point, time.perf_counter() - start)
    mine = []
    run_point(point, ceilings, lambda r: (writer.append(r), mine.append(r)))
    speedups = add_speedups(mine, is_tree)
    if speedups:
      writer.append(speedups)
    records += mine
  tree = next((i for i in impls if is_tree(i)), None)
  table = report.markdown_table(records, [
      ('impl', 'impl'), *[(f, f) for f in POINT_FIELDS],
      ('time ms', lambda r: r.get('time_s') and 1e3 * r['time_s']),
      ('floor ms', lambda r: 1e3 * r['floor_s']),
      ('time / floor', 'time_over_floor'),
      *[(f'tree x vs {i}', f'speedup_vs_{i}') for i in impls if i != tree],
      *columns,
      ('status', lambda r: r['status'] if r['status'] == 'ok'
       else f"{r['status']}: {r.get('reason', '')}"),
  ])
  text = (f'Backend {jax.default_backend()}, ceilings: copy {ceilings.copy_bandwidth / 1e9:.0f} '
          f'GB/s, matmul {ceilings.matmul_rate / 1e12:.1f} TFLOP/s. {header}\n\n' + table)
  with open(os.path.join(workdir, 'table.md'), 'w') as f:
    f.write(text)
  at = lambda r: tuple(r[f] for f in POINT_FIELDS)
  values = {i: [next((r.get('time_s') for r in records if r['impl'] == i and at(r) == point),
                     None) for point in points] for i in impls}
  report.plot_bars([':'.join(map(str, p)) for p in points], values,
                   path=os.path.join(workdir, 'time.png'), ylabel=ylabel, title=title)
  report.write_workdir_readme(workdir, title, text, writer.meta)
  print(table)
  logging.info('done in %.0f s', time.perf_counter() - start)
  return records
