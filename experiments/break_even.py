r"""Break-even of batched (shared) against per-sequence attention of one shared segment.

Workload per point (length n, rows r, batch B): B/r groups of r rows, each group
sharing its own root segment of n tokens, each row with a `--suffix`-token
private page (its last T tokens are the queries); n is whole pages, so the
root can be demoted. `tree_attention` (--impl) runs on the plan as is
(batched: one shared segment per group) and on
`SharingPolicy.demote_all().apply(plan)` (per-sequence: every row reads its
root's pages itself, i.e. plain paged decode). Both outputs are checked against
the naive float32 oracle on a few rows before timing; when either is wrong the
point is recorded as wrong and neither is timed. ratio = batched time /
per-sequence time (device time, L2 flushed, `hydrajax.benchmarking.timing`).

Thresholds: at each batch, r_min(n, B) = the smallest measured r from which on
(that r and every larger measured one) ratio <= 1 + --slack; r_min(n) = the
largest over the batches. When no measured r qualifies, r_min(n) = largest
measured r + 1 (listed under `beyond_measured`: batched lost everywhere it was
measured). --write_thresholds writes them as the JSON that
`SharingPolicy.load` and `SharingPolicy.default` read.

The H200 command (defaults: n = 64..4096, r = 1..8, B = 32 and 256, 32/8 heads,
head dim 128, bf16, impl auto = Mosaic GPU):

  PYTHONPATH=. python -m experiments.break_even --repeats=3 --target_ms=10 \
      --workdir=experiments/results/break_even \
      --write_thresholds=hydrajax/data/break_even_h200.json

On CPU in seconds (XLA): --lengths=64,128 --rows=1,2 --batches=8 --heads=4:2 --head_dim=64
Writes, into --workdir (default: the scratch folder workdir/break_even; the committed results
are only written when asked for, as above): results.jsonl (one record per point), table.md,
ratio.png. A point where a median time is <= 0 (below the timer's noise, e.g. on a loaded
machine) is recorded as `untimeable` and left out of the thresholds.
"""

import gc
import json
import os
import traceback
from typing import Callable

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

import hydrajax as hj
from hydrajax.benchmarking import report, sweep, timing, workloads

_LENGTHS = flags.DEFINE_list('lengths', ['64', '256', '1024', '4096'], 'shared segment lengths n')
_ROWS = flags.DEFINE_list('rows', ['1', '2', '4', '8'], 'rows r per shared segment')
_BATCHES = flags.DEFINE_list('batches', ['32', '256'], 'batch sizes B (multiples of every r)')
_HEADS = flags.DEFINE_string('heads', '32:8', 'query heads : kv heads')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 128, 'head dim H')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float16', 'float32'], 'q/KV dtype')
_QUERY_LEN = flags.DEFINE_integer('query_len', 1, 'query tokens T per row')
_SUFFIX = flags.DEFINE_integer('suffix', 1, 'private tokens per row (>= query_len, <= page_size)')
_PAGE_SIZE = flags.DEFINE_integer('page_size', 64, 'tokens per page (the chunk cache default)')
_IMPL = flags.DEFINE_enum('impl', 'auto', [i.value for i in hj.AttentionImpl], 'attention impl')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'timed repeats per variant (median reported)')
_TARGET_MS = flags.DEFINE_float('target_ms', 20.0, 'length of one timed loop, ms')
_ROWS_CHECKED = flags.DEFINE_integer('rows_checked', 8, 'rows compared with the oracle per point')
_SLACK = flags.DEFINE_float('slack', 0.02, 'batched counts as not slower at ratio <= 1 + slack')
_SEED = flags.DEFINE_integer('seed', 0, 'input seed')
_WORKDIR = flags.DEFINE_string('workdir', 'workdir/break_even', 'output folder (scratch)')
_WRITE_THRESHOLDS = flags.DEFINE_string(
    'write_thresholds', '', 'also write the derived thresholds JSON here (SharingPolicy.load)'
)

VARIANTS = ('batched', 'per_sequence')


def _ints(name: str, values) -> list[int]:
  try:
    out = [int(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f'--{name} must be integers, got {values}') from e
  if not out or min(out) < 1:
    raise app.UsageError(f'--{name} must be integers >= 1, got {values}')
  return out


def make_plan(batch: int, length: int, rows: int, suffix: int, page_size: int) -> hj.SharingPlan:
  """B/r roots of `length` tokens with r rows each; one private page of `page_size` per row."""
  roots = [hj.PromptNode(length, num_samples=rows, label=f'root{g}') for g in range(batch // rows)]
  return hj.plan_tree(roots, private_capacity=page_size, private_lengths=suffix)


def run_point(batch: int, length: int, rows: int, config: dict, *,
              time_fn: Callable[..., timing.Timing] = timing.device_time) -> dict:
  """Checks both variants against the oracle, then times them; returns the point's record.

  `time_fn(fn, *args, **config['timing'])` times one variant (`timing.device_time`; tests pass
  given timings).
  """
  n_heads, kv_heads = config['heads']
  rec = dict(
      kind='point', length=length, rows=rows, batch=batch, groups=batch // rows,
      num_q_heads=n_heads, num_kv_heads=kv_heads, head_dim=config['head_dim'],
      dtype=config['dtype'], query_len=config['query_len'], suffix=config['suffix'],
      page_size=config['page_size'], impl_requested=config['impl'],
      tolerance=sweep.TOLERANCE.get(config['dtype'], 2e-2),
  )
  plan = make_plan(batch, length, rows, config['suffix'], config['page_size'])
  per_sequence = hj.SharingPolicy.demote_all().apply(plan)
  if per_sequence.segments:
    return dict(rec, status='failed', reason='the root segments were not demoted')
  dtype = jnp.dtype(config['dtype'])
  kq, kk, kv = jax.random.split(jax.random.key(config['seed']), 3)
  q = jax.random.normal(kq, (batch, config['query_len'], n_heads, config['head_dim']), dtype)
  kv_shape = (plan.kv_tokens, kv_heads, config['head_dim'])
  k_cache, v_cache = jax.random.normal(kk, kv_shape, dtype), jax.random.normal(kv, kv_shape, dtype)
  layouts = {'batched': plan.to_device(), 'per_sequence': per_sequence.to_device()}
  try:
    checked = np.asarray(workloads.check_rows(batch, config['rows_checked']))
    indices, lengths = plan.row_token_indices()
    idx = jnp.asarray(indices[checked])
    lengths = jnp.asarray(lengths[checked])
    expected = hj.naive_attention(q[checked], k_cache[idx], v_cache[idx], lengths).out
    expected = np.asarray(expected, np.float32)
    impl, _ = hj.resolve(config['impl'], q, k_cache, v_cache, layouts['batched'])
    rec['impl'] = impl.value
    fn = lambda q, k, v, layout: hj.tree_attention(q, k, v, layout, impl=impl)
    for name in VARIANTS:
      out = np.asarray(jax.jit(fn)(q, k_cache, v_cache, layouts[name]).out, np.float32)
      rec[f'rel_error_{name}'] = sweep.relative_error(out[checked], expected)
    if not all(rec[f'rel_error_{name}'] <= rec['tolerance'] for name in VARIANTS):
      return dict(rec, status='wrong')
    for name in VARIANTS:
      t = time_fn(fn, q, k_cache, v_cache, layouts[name], **config['timing'])
      rec.update({
          f'time_{name}_us': t.median_us,
          f'samples_{name}_us': [s * 1e6 for s in t.samples_s],
          f'iterations_{name}': t.iterations,
      })
    rec['timing_method'] = t.method
    if min(rec['time_batched_us'], rec['time_per_sequence_us']) <= 0:
      return dict(rec, status='untimeable', reason=sweep.UNTIMEABLE)
    rec['ratio'] = rec['time_batched_us'] / rec['time_per_sequence_us']
    rec['status'] = 'ok'
  except Exception as e:  # a failing point is a result, not a crash
    logging.warning('point n=%d r=%d B=%d failed: %s', length, rows, batch,
                    traceback.format_exc(limit=3))
    rec.update(status='failed', reason=f'{type(e).__name__}: {e}'.replace('\n', ' ')[:400])
  return rec


def derive_thresholds(records, slack: float) -> dict | None:
  """r_min per measured length from the ok points (see the module docstring); None if none."""
  ratios: dict[int, dict[int, dict[int, float]]] = {}
  for r in records:
    if r.get('kind') == 'point' and r.get('status') == 'ok':
      ratios.setdefault(r['length'], {}).setdefault(r['batch'], {})[r['rows']] = r['ratio']
  if not ratios:
    return None
  steps, beyond = [], []
  for n in sorted(ratios):
    needed = []
    for by_rows in ratios[n].values():
      rows = sorted(by_rows)
      first = len(rows)  # index of the smallest r from which on batched is never slower
      while first > 0 and by_rows[rows[first - 1]] <= 1 + slack:
        first -= 1
      needed.append(rows[first] if first < len(rows) else rows[-1] + 1)
      if first == len(rows):
        beyond.append(n)
    steps.append([n, max(needed)])
  return {
      'format': 'hydrajax.sharing_policy/1',
      'status': 'measured',
      'min_rows': steps[0][1],
      'steps': steps,
      'beyond_measured': sorted(set(beyond)),
      'slack': slack,
      'ratios': {str(n): {str(b): {str(r): v for r, v in sorted(x.items())}
                          for b, x in sorted(by_b.items())} for n, by_b in sorted(ratios.items())},
  }


def plot_ratio(records, path: str) -> bool:
  """ratio vs r, one line per n, one panel per batch; False (nothing written) without ok points."""
  import matplotlib  # imported here: only plotting needs it
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  ok = [r for r in records if r.get('status') == 'ok']
  batches = sorted({r['batch'] for r in ok})
  if not batches:
    return False
  fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
  for ax, b in zip(axes.flat, batches):
    for n in sorted({r['length'] for r in ok if r['batch'] == b}):
      pts = sorted((r['rows'], r['ratio']) for r in ok if r['batch'] == b and r['length'] == n)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=f'n={n}')
    ax.axhline(1.0, color='k', lw=0.8)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    rows = sorted({r['rows'] for r in ok if r['batch'] == b})
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel('rows r per shared segment')
    ax.set_ylabel('batched time / per-sequence time')
    ax.set_title(f'B={b}: below 1, batched wins', fontsize=9)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _ratio_cell(r: dict) -> str:
  if 'ratio' in r:
    return f'{r["ratio"]:.3f}'
  if r.get('status') == 'wrong':
    errors = [r.get(f'rel_error_{v}') for v in VARIANTS]
    return 'rel. errors ' + ', '.join(f'{e:.2g}' for e in errors if e is not None)
  return r.get('reason', '')


def write_table(records, thresholds: dict | None, path: str) -> None:
  points = [r for r in records if r.get('kind') == 'point']
  meta = points[0]['meta'] if points else {}
  first = points[0] if points else {}
  fmt = lambda r, k: f'{r[k]:.1f}' if r.get(k) is not None else ''
  columns = [
      ('n', 'length'), ('r', 'rows'), ('B', 'batch'), ('impl', 'impl'), ('status', 'status'),
      ('batched µs', lambda r: fmt(r, 'time_batched_us')),
      ('per-sequence µs', lambda r: fmt(r, 'time_per_sequence_us')),
      ('ratio', _ratio_cell),
  ]
  lines = [
      '# Break-even: batched (shared) vs per-sequence attention of a shared segment', '',
      f'Device: {meta.get("device")} ({meta.get("backend")}), JAX {meta.get("jax_version")}, '
      f'run {first.get("timestamp", "")}.', '',
      f'Command: `{meta.get("command")}`', '',
      f'Heads {first.get("num_q_heads")}/{first.get("num_kv_heads")}, head dim '
      f'{first.get("head_dim")}, {first.get("dtype")}, T={first.get("query_len")}, private suffix '
      f'{first.get("suffix")}, page size {first.get("page_size")}. B/r groups of r rows share a '
      'root of n tokens. Device time per call (median, L2 flushed); ratio = batched / '
      'per-sequence (below 1: batched wins). Both outputs were checked against the naive oracle '
      'before timing.', '',
      report.markdown_table(points, columns), '',
  ]
  if thresholds:
    slack = thresholds['slack']
    lines += [f'## Thresholds (ratio <= 1 + {slack:g} from r_min on, at every batch)', '']
    rows = [dict(n=n, r=r, beyond='yes' if n in thresholds['beyond_measured'] else '')
            for n, r in thresholds['steps']]
    lines += [report.markdown_table(rows, [('n', 'n'), ('r_min', 'r'),
                                           ('batched lost at every measured r', 'beyond')]), '']
  with open(path, 'w') as f:
    f.write('\n'.join(lines))


def check_config(lengths, rows_list, batches, heads_spec: str, page: int, query_len: int,
                 suffix: int) -> tuple[int, int]:
  """Checks the grid's flags before any work; returns (query heads, kv heads)."""
  try:
    heads = tuple(int(x) for x in heads_spec.split(':'))
  except ValueError:
    heads = ()
  if len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1]:
    raise app.UsageError(f'--heads must be N:K with N a multiple of K, got {heads_spec!r}')
  if page < 1 or any(n % page for n in lengths):
    raise app.UsageError(f'--lengths {lengths} must be multiples of --page_size={page}')
  if not 1 <= query_len <= suffix <= page:
    raise app.UsageError('need 1 <= --query_len <= --suffix <= --page_size')
  if any(b % r for b in batches for r in rows_list):
    raise app.UsageError(f'every --batches {batches} must be a multiple of each --rows {rows_list}')
  return heads


def run(grid, config: dict, workdir: str, *, slack: float,
        time_fn: Callable[..., timing.Timing] = timing.device_time):
  """Runs the (batch, length, rows) points into workdir; returns (records, thresholds or None).

  Writes results.jsonl (replaced), table.md and ratio.png (when a point was timed).
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'results.jsonl')
  if os.path.exists(path):
    os.remove(path)
  writer = report.JsonlWriter(path)
  records = []
  for b, n, r in report.progress(grid, total=len(grid), desc='break_even'):
    rec = writer.append(run_point(b, n, r, config, time_fn=time_fn))
    records.append(rec)
    logging.info('B=%d n=%d r=%d: %s %s', b, n, r, rec['status'],
                 f'ratio {rec["ratio"]:.3f}' if 'ratio' in rec else rec.get('reason', ''))
    gc.collect()
  thresholds = derive_thresholds(records, slack)
  write_table(records, thresholds, os.path.join(workdir, 'table.md'))
  plot_ratio(records, os.path.join(workdir, 'ratio.png'))
  logging.info('wrote %s, table.md', path)
  return records, thresholds


def write_thresholds(thresholds: dict, records, config: dict, path: str) -> None:
  """The thresholds JSON with where they come from, checked to load as a `SharingPolicy`."""
  meta = records[-1]['meta']
  thresholds = dict(
      thresholds, device=meta['device'], command=meta['command'],
      git_commit=meta.get('git_commit'), timestamp=records[-1]['timestamp'],
      impl=sorted({r['impl'] for r in records if 'impl' in r}),
      workload={k: config[k] for k in ('heads', 'head_dim', 'dtype', 'query_len', 'suffix',
                                       'page_size')},
  )
  hj.SharingPolicy.from_dict(thresholds)  # what default() will load must load
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(thresholds, f, indent=2)
    f.write('\n')
  logging.info('wrote thresholds %s', path)


def main(argv):
  del argv
  lengths, rows_list, batches = (_ints(f.name, f.value) for f in (_LENGTHS, _ROWS, _BATCHES))
  heads = check_config(lengths, rows_list, batches, _HEADS.value, _PAGE_SIZE.value,
                       _QUERY_LEN.value, _SUFFIX.value)
  config = dict(
      heads=heads, head_dim=_HEAD_DIM.value, dtype=_DTYPE.value, query_len=_QUERY_LEN.value,
      suffix=_SUFFIX.value, page_size=_PAGE_SIZE.value, impl=_IMPL.value,
      rows_checked=_ROWS_CHECKED.value, seed=_SEED.value,
      timing=dict(repeats=_REPEATS.value, target_s=_TARGET_MS.value * 1e-3),
  )
  grid = [(b, n, r) for b in batches for n in lengths for r in rows_list]
  records, thresholds = run(grid, config, _WORKDIR.value, slack=_SLACK.value)
  with open(os.path.join(_WORKDIR.value, 'table.md')) as f:
    print(f.read())
  if _WRITE_THRESHOLDS.value:
    if thresholds is None:
      raise app.Error('no point was timed (each failed, was wrong or untimeable): no thresholds '
                      'written')
    write_thresholds(thresholds, records, config, _WRITE_THRESHOLDS.value)


if __name__ == '__main__':
  app.run(main)
