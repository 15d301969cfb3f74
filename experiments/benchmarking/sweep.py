"""Check-then-time sweeps of attention implementations over workload grids.

Per point: the naive oracle runs on a subset of rows; every implementation's
output is compared with it before it is timed, and a wrong one is recorded as
wrong, not timed. Each record holds the time, the roofline floor, time/floor
and the speedup of hydrajax's implementations over every baseline.
"""

import dataclasses
import gc
import logging
import os
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from experiments.benchmarking import report
from experiments.benchmarking.roofline import Ceilings
from experiments.benchmarking.timing import Timing
from experiments.benchmarking.workloads import Problem, Shape, check_rows, make_problem

log = logging.getLogger(__name__)

# Relative L2 error ||out - ref|| / ||ref|| allowed per dtype (bf16 operands: 1e-3..1e-2).
TOLERANCE = {'bfloat16': 2e-2, 'float16': 5e-3, 'float32': 2e-3}


# The reason of a point whose median time is <= 0 (status 'untimeable').
UNTIMEABLE = 'a time <= 0: below the timer noise'


class Unsupported(Exception):
  """This implementation does not run this point; the message says why."""


@dataclasses.dataclass
class Candidate:
  """One implementation bound to one problem.

  Attributes:
    run: computes the output once; returns out [B, T, N, H] as a float32 numpy array.
    time: measures it; returns a `Timing`.
    note: what exactly ran (e.g. which backend of a library).
  """

  run: Callable[[], np.ndarray]
  time: Callable[[], Timing]
  note: str = ''


Builder = Callable[[Problem, Any], Candidate]


def relative_error(out: np.ndarray, expected: np.ndarray) -> float:
  """||out - expected|| / ||expected|| (inf when out has NaN/inf)."""
  out = np.asarray(out, np.float64)
  expected = np.asarray(expected, np.float64)
  if out.shape != expected.shape:
    raise ValueError(f'output shape {out.shape} != expected {expected.shape}')
  if not np.all(np.isfinite(out)):
    return float('inf')
  return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


def _short(e: BaseException) -> str:
  text = f'{type(e).__name__}: {e}'.replace('\n', ' ')
  return text[:400]


def run_point(
    shape: Shape,
    builders: dict[str, Builder],
    options: Any,
    ceilings: Ceilings,
    *,
    rows_checked: int = 8,
    seed: int = 0,
    on_done: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
  """Checks and times every implementation on one shape; returns one record each."""
  problem = make_problem(shape, seed)
  rows = check_rows(shape.batch, rows_checked)
  expected = np.asarray(problem.oracle(rows).out, np.float32)
  tolerance = TOLERANCE.get(shape.dtype, 2e-2)
  cost, cost_copies = shape.shared_cost(), shape.per_sequence_cost()
  floor_s = cost.floor_s(ceilings)
  base = dict(
      shape.fields(),
      kind='point',
      floor_us=floor_s * 1e6,
      floor_bound='memory' if cost.bytes / ceilings.copy_bandwidth >= cost.flops / ceilings.matmul_rate else 'compute',
      floor_per_sequence_us=cost_copies.floor_s(ceilings) * 1e6,
      bytes=cost.bytes,
      flops=cost.flops,
      rows_checked=len(rows),
      tolerance=tolerance,
  )
  records = []
  for name, build in builders.items():
    rec = dict(base, impl=name)
    try:
      candidate = build(problem, options)
      rec['note'] = candidate.note
      out = candidate.run()
      rec['rel_error'] = relative_error(out[np.asarray(rows)], expected)
      if not rec['rel_error'] <= tolerance:
        rec['status'] = 'wrong'
      else:
        timing = candidate.time()
        rec.update(timing.clock)  # the SM clock its timed repeats ran at (NVIDIA GPUs)
        rec.update(samples_us=[t * 1e6 for t in timing.samples_s], iterations=timing.iterations,
                   timing_method=timing.method)
        if timing.median_s <= 0:  # below the timer's noise (a loaded or tiny machine): no time
          rec.update(status='untimeable', reason=UNTIMEABLE)
        else:
          rec.update(
              status='ok',
              time_us=timing.median_us,
              time_over_floor=timing.median_s / floor_s,
              achieved_bandwidth=cost.bytes / timing.median_s,
              achieved_flops=cost.flops / timing.median_s,
          )
    except Unsupported as e:
      rec.update(status='unsupported', reason=str(e))
    except Exception as e:  # a failing implementation is a result, not a crash
      log.warning('%s on %s failed: %s', name, shape.name, traceback.format_exc(limit=3))
      rec.update(status='failed', reason=_short(e))
    finally:
      candidate = None
      gc.collect()
    records.append(rec)
    if on_done:
      on_done(name)
  del problem
  gc.collect()
  return records


def add_speedups(records: list[dict[str, Any]], ours: Sequence[str]) -> None:
  """Adds, to each of our records, speedup_vs_<baseline> = baseline time / our time."""
  times = {r['impl']: r['time_us'] for r in records if r.get('status') == 'ok'}
  for r in records:
    if r['impl'] in ours and r['impl'] in times:
      for other, t in times.items():
        if other not in ours and times[r['impl']] > 0:
          r[f'speedup_vs_{other}'] = t / times[r['impl']]


def _cell(r: dict[str, Any] | None) -> str:
  if r is None:
    return ''
  if r.get('status') == 'ok':
    return f'{r["time_us"]:.0f} ({r["time_over_floor"]:.1f}x)'
  if r.get('status') == 'wrong':
    return f'wrong (err {r["rel_error"]:.2g})'
  return {'unsupported': 'n/a', 'untimeable': 'untimeable'}.get(r.get('status'), 'failed')


def summarize(
    records: Sequence[dict[str, Any]],
    workdir: str,
    *,
    impls: Sequence[str],
    ours: Sequence[str],
    ceilings: Ceilings,
    title: str,
) -> dict[str, str]:
  """Writes table.md and the plots into workdir; returns {what: path}."""
  points = [r for r in records if r.get('kind') == 'point']
  by_shape: dict[str, dict[str, dict]] = {}
  for r in points:
    by_shape.setdefault(r['name'], {})[r['impl']] = r
  shapes = list(by_shape)
  first = {name: next(iter(v.values())) for name, v in by_shape.items()}
  impls = [i for i in impls if any(i in v for v in by_shape.values())]

  columns = [('shape', lambda n: n), ('label', lambda n: first[n]['label']),
             ('floor µs', lambda n: f'{first[n]["floor_us"]:.0f} ({first[n]["floor_bound"][:3]})')]
  columns += [(f'{i} µs (x floor)', lambda n, i=i: _cell(by_shape[n].get(i))) for i in impls]
  rows = [{'n': n} for n in shapes]
  table = report.markdown_table(rows, [(h, lambda r, f=f: f(r['n'])) for h, f in columns])

  baselines = [i for i in impls if i not in ours]
  speed_cols = [('shape', lambda r: r['name'])] + [('ours', lambda r: r['impl'])]
  speed_cols += [(f'vs {b}', lambda r, b=b: r.get(f'speedup_vs_{b}')) for b in baselines]
  ours_rows = [r for r in points if r['impl'] in ours and r.get('status') == 'ok']
  speed_table = report.markdown_table(ours_rows, speed_cols)

  reasons = sorted({(r['impl'], r.get('status'), r.get('reason', '')) for r in points
                    if r.get('status') in ('unsupported', 'failed', 'wrong', 'untimeable')})
  notes = sorted({(r['impl'], r['note']) for r in points if r.get('note')})
  meta = points[0]['meta'] if points else {}
  lines = [
      f'# {title}', '',
      f'Device: {meta.get("device")} ({meta.get("backend")}), JAX {meta.get("jax_version")}, '
      f'run {points[0]["timestamp"] if points else ""}.', '',
      f'Command: `{meta.get("command")}`', '',
      f'Ceilings measured in this run: copy {ceilings.copy_bandwidth / 1e12:.3g} TB/s '
      f'(read + written; {ceilings.details.get("copy_bandwidth_source")}), '
      f'bf16 matmul {ceilings.matmul_rate / 1e12:.3g} TFLOP/s. '
      'floor = max(bytes moved once / copy bandwidth, FLOPs / matmul rate), with the prefix '
      'read once; mem/com says which term binds.', '',
      'Times: device time per call in µs, median; (x floor) = time / floor. Each output was '
      'checked against the naive float32 oracle before timing; a wrong one is not timed. '
      'untimeable: the median time was <= 0 (below the timer noise), so no time is reported.', '',
      '## Times', '', table, '',
      '## Speedup of hydrajax over each baseline (baseline time / ours)', '', speed_table, '',
  ]
  if reasons:
    lines += ['## Not timed', '']
    lines += [f'- {impl}: {status}: {reason}' for impl, status, reason in reasons]
    lines.append('')
  if notes:
    lines += ['## What ran', ''] + [f'- {impl}: {note}' for impl, note in notes] + ['']
  paths = {'table': os.path.join(workdir, 'table.md')}
  with open(paths['table'], 'w') as f:
    f.write('\n'.join(lines))

  ok = [r for r in points if r.get('status') == 'ok']
  for x, fixed in (('batch', ('prefix', 'suffix', 'heads')),
                   ('prefix', ('batch', 'suffix', 'heads')),
                   ('suffix', ('batch', 'prefix', 'heads'))):
    path = os.path.join(workdir, f'time_vs_{x}.png')
    if report.plot_sweeps(ok, x=x, y='time_us', series='impl', fixed=fixed, path=path,
                          title=f'time vs {x}', ylabel='µs'):
      paths[f'time_vs_{x}'] = path
  if shapes:
    path = os.path.join(workdir, 'time_over_floor.png')
    report.plot_bars(shapes, {i: [by_shape[n].get(i, {}).get('time_over_floor') for n in shapes] for i in impls},
                     path=path, ylabel='time / floor', title='time as a multiple of the floor', hline=1.0)
    paths['time_over_floor'] = path
  best = {}
  for n in shapes:
    mine = [by_shape[n][o] for o in ours if by_shape[n].get(o, {}).get('status') == 'ok']
    best[n] = min(mine, key=lambda r: r['time_us']) if mine else None
  if any(best.values()) and baselines:
    path = os.path.join(workdir, 'speedup.png')
    report.plot_bars(
        shapes,
        {b: [best[n].get(f'speedup_vs_{b}') if best[n] else None for n in shapes] for b in baselines},
        path=path, ylabel='baseline time / hydrajax time', title='speedup of hydrajax (best of ours)', hline=1.0,
    )
    paths['speedup'] = path
  return paths
