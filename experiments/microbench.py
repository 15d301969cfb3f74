r"""Shared-prefix attention microbenchmark: hydrajax against its baselines, with the floor.

The command for experiments/results/microbench/ (one H200, about 2-3 minutes; on
a GPU machine write to workdir/microbench and copy the files back):

  PYTHONPATH=. python3 -m experiments.microbench --grid=targets \
      --workdir=experiments/results/microbench

Defaults: the Hydragen figure-5 grid and the ChunkAttention table-3 grid
(`--grid=hydragen,chunkattention`, long). `--grid=smoke` runs tiny float32
shapes on CPU in a minute or two, with small settings for whatever flag is not given
(SMOKE_SETTINGS: a 16 MB copy and a 256 matmul for the ceilings, short timed loops).
A point whose median time is <= 0 (below the timer's noise, e.g. on a loaded
laptop) is recorded as `untimeable`, not as a time. `--impls` picks
implementations (default: all; the ones that cannot run a point, e.g. PyTorch
without CUDA, are recorded as unsupported with the reason). Writes, into --workdir: results.jsonl (one record
per implementation and point, plus the measured ceilings), table.md, and plots.
"""

import os

# PyTorch peers share the GPU with JAX: let JAX grow its pool instead of taking 75% at start.
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.7')

from absl import app, flags, logging  # noqa: E402

from experiments import cli  # noqa: E402
from experiments import baselines  # noqa: E402
from experiments.benchmarking import report, roofline, sweep, workloads  # noqa: E402

_GRID = flags.DEFINE_list('grid', ['hydragen', 'chunkattention'], f'grids: {sorted(workloads.GRIDS)}')
_IMPLS = flags.DEFINE_list('impls', list(baselines.IMPLEMENTATIONS), 'implementations to run')
_WORKDIR = cli.workdir_flag('microbench')
_MAX_COPY_GB = flags.DEFINE_float('max_copy_gb', 24.0, 'cap on per-sequence KV copies (K+V), GB')
_PAGE_SIZE = flags.DEFINE_integer('page_size', 16, 'tokens per page of the paged baselines')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'timed repeats per implementation (median '
                                'reported; smoke: 3)')
_TARGET_MS = flags.DEFINE_float('target_ms', 20.0, 'length of one timed loop, ms (smoke: 5)')
_ROWS_CHECKED = flags.DEFINE_integer('rows_checked', 8, 'rows compared with the oracle per point')
_COPY_GB = flags.DEFINE_float('copy_gb', 2.0, 'size of the copy that measures bandwidth, GB '
                              '(smoke: 0.016)')
_MATMUL_SIZE = flags.DEFINE_integer('matmul_size', 8192, 'size of the matmul that measures the '
                                    'rate (smoke: 256)')
_SEED = flags.DEFINE_integer('seed', 0, 'input seed')
cli.at_least(1, 'page_size', 'repeats', 'rows_checked', 'matmul_size')
cli.at_least(0.001, 'max_copy_gb', 'target_ms', 'copy_gb')

# What `--grid=smoke` uses for each of these flags that the command line does not give: the
# defaults above size the ceilings for an H200 (a 2 GB copy, an 8192 matmul: minutes on a CPU).
SMOKE_SETTINGS = dict(copy_gb=0.016, matmul_size=256, repeats=3, target_ms=5.0)


def settings() -> dict:
  """The value of each SMOKE_SETTINGS flag: the command line's, else smoke's or the default."""
  smoke = _GRID.value == ['smoke']
  holders = dict(copy_gb=_COPY_GB, matmul_size=_MATMUL_SIZE, repeats=_REPEATS, target_ms=_TARGET_MS)
  return {name: SMOKE_SETTINGS[name] if smoke and not flag.present else flag.value
          for name, flag in holders.items()}


def main(argv):
  del argv
  unknown = [i for i in _IMPLS.value if i not in baselines.IMPLEMENTATIONS]
  if unknown:
    raise app.UsageError(f'unknown --impls {unknown}; expected from {list(baselines.IMPLEMENTATIONS)}')
  try:
    shapes = workloads.grid(_GRID.value)
  except ValueError as e:
    raise app.UsageError(f'--grid: {e}') from None
  chosen = settings()
  if chosen['copy_gb'] <= 0 or chosen['matmul_size'] < 1 or chosen['repeats'] < 1:
    raise app.UsageError(f'need --copy_gb > 0, --matmul_size >= 1, --repeats >= 1; got {chosen}')
  logging.info('settings: %s', chosen)
  builders = {i: baselines.IMPLEMENTATIONS[i] for i in _IMPLS.value}
  timing = dict(repeats=chosen['repeats'], target_s=chosen['target_ms'] * 1e-3)
  options = baselines.Options(_MAX_COPY_GB.value * 1e9, _PAGE_SIZE.value, timing)
  writer = report.fresh_jsonl(os.path.join(_WORKDIR.value, 'results.jsonl'))

  ceilings = roofline.measure_ceilings(int(chosen['copy_gb'] * 1e9), chosen['matmul_size'],
                                       **timing)
  if any(i.startswith('torch') for i in builders):
    torch_bw = baselines.torch_copy_bandwidth()
    if torch_bw is not None:
      ceilings.details['torch_copy_bandwidth'] = torch_bw
      ceilings = ceilings.with_copy_bandwidth(torch_bw, 'torch device-to-device copy')
  writer.append(ceilings.record())
  logging.info('ceilings: copy %.3g TB/s, matmul %.3g TFLOP/s (%s)', ceilings.copy_bandwidth / 1e12,
               ceilings.matmul_rate / 1e12, ceilings.details)

  records = []
  bar = report.progress(range(len(shapes) * len(builders)), desc='microbench')
  tick = lambda _: next(bar, None)
  for shape in shapes:
    logging.info('point %s (%s)', shape.name, shape.label)
    point = sweep.run_point(shape, builders, options, ceilings, rows_checked=_ROWS_CHECKED.value,
                            seed=_SEED.value, on_done=tick)
    sweep.add_speedups(point, baselines.HYDRAJAX)
    for r in point:
      records.append(writer.append(r))
      logging.info('  %-22s %-11s %s', r['impl'], r['status'],
                   f'{r["time_us"]:.1f} us, {r["time_over_floor"]:.2f}x floor' if r['status'] == 'ok'
                   else r.get('reason', r.get('rel_error', '')))
    # Rewritten after every point, so a run cut short still leaves a table.
    paths = sweep.summarize(records, _WORKDIR.value, impls=list(builders), ours=baselines.HYDRAJAX,
                            ceilings=ceilings, title='Shared-prefix attention microbenchmark')
  for _ in bar:
    pass
  with open(paths['table']) as f:
    table = f.read()
  print(table)
  report.write_workdir_readme(_WORKDIR.value, 'Shared-prefix attention microbenchmark', table,
                              writer.meta)
  logging.info('wrote %s and %s', writer.path, ', '.join(paths.values()))


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
