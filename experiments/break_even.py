r"""Break-even of batched (shared) against per-sequence attention of one shared segment.

Workload per point (heads N/K, batch B, length n, rows r): B/r groups of r rows,
each group sharing its own root segment of n tokens, each row with a
`--suffix`-token private page (its last T tokens are the queries); n is whole
pages, so the root can be demoted. The attention (--impl, prepared once per
point as the engine prepares once per tree change, and its per-step part built
by `for_step` outside the timed call: a call is a layer of a decode step) runs
on the plan as is (batched: one shared segment per group) and on
`SharingPolicy.demote_all().apply(plan)` (per-sequence: every row reads its
root's pages itself, i.e. plain paged decode). Both outputs are checked against
the naive float32 oracle on a few rows (--check: at the first point of each
(heads, B), or at every point); when either is wrong the point is recorded as
wrong and neither is timed. ratio = batched time / per-sequence time (device
time, L2 flushed: --timer=device is `experiments.benchmarking.timing.device_time`,
--timer=cupti the median over --repeats single calls of the CUPTI kernel times,
which reuses each compiled program and is what the H200 run uses).

Search (--search=staircase, the default): thresholds are r_min(n) per (group
size N/K, B), and batched gains with both r and n, so per (heads, B) the points
walk a staircase: n from the longest down, r up from the smallest candidate
that did not already lose at a longer segment; the first r at which batched is
within the slack ends an n. An n at which every r loses ends the walk (shorter
segments lose too); r=1 (batched does strictly more work) is left out by the
default --rows. Points whose K/V buffers exceed --max_kv_gib are skipped (they
are listed in the table). The walks of all (heads, B) advance in turn, one
point each, and no point starts after --budget_s seconds: a cut walk keeps what
it measured, and its unmeasured shorter segments are demoted. --search=full
measures every (n, r) of the grid.

Thresholds (`derive_thresholds`), per (group size, B): at each measured n,
r_min = the smallest measured r from which on (that r and every larger measured
one) ratio <= 1 + --slack; when none, B + 1 (demote everything: listed under
`beyond_measured`). A point that failed, was wrong or untimeable counts as
lost. Batches with equal thresholds merge into one table over their range.
Applying them never keeps shared a measured shape whose batched time is more
than --slack above plain paged decode (checked before writing; everything
demoted *is* plain paged decode). --write_thresholds writes the format-2 JSON
that `SharingPolicy.load` and `SharingPolicy.default` read.

The H200 command (defaults: B = 8..1024, n = 64..16K, r = 2..1024, 32/8 and 32/32 heads,
head dim 128, bf16, impl auto = Mosaic GPU; about 4 minutes with the budget):

  PYTHONPATH=. python -m experiments.break_even --timer=cupti --budget_s=170 \
      --workdir=experiments/results/break_even \
      --write_thresholds=hydrajax/data/break_even_h200.json

On CPU in seconds (XLA): --lengths=64,128 --rows=1,2 --batches=8 --heads=4:2 --head_dim=64
Writes, into --workdir (default: the scratch folder workdir/break_even; the committed results
are only written when asked for, as above): results.jsonl (one record per point), table.md,
ratio.png. A point where a median time is <= 0 (below the timer's noise, e.g. on a loaded
machine) is recorded as `untimeable`.
"""

import functools
import gc
import json
import os
import statistics
import time
import traceback
from typing import Callable

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
import hydrajax as hj
from experiments.benchmarking import report, sweep, timing, workloads
from hydrajax.sharing_policy import FORMAT_V2

_LENGTHS = flags.DEFINE_list('lengths', ['64', '256', '1024', '4096', '16384'],
                             'shared segment lengths n')
_ROWS = flags.DEFINE_list('rows', [str(2**i) for i in range(1, 11)],
                          'candidate rows r per shared segment (those dividing B, <= B, are used)')
_BATCHES = flags.DEFINE_list('batches', ['8', '32', '128', '512', '1024'], 'batch sizes B')
_HEADS = flags.DEFINE_list('heads', ['32:8', '32:32'], 'query heads : kv heads, one or more')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 128, 'head dim H')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float16', 'float32'], 'q/KV dtype')
_QUERY_LEN = flags.DEFINE_integer('query_len', 1, 'query tokens T per row')
_SUFFIX = flags.DEFINE_integer('suffix', 1, 'private tokens per row (>= query_len, <= page_size)')
_PAGE_SIZE = flags.DEFINE_integer('page_size', 64, 'tokens per page (the chunk cache default)')
_IMPL = flags.DEFINE_enum('impl', 'auto', [i.value for i in hj.AttentionImpl], 'attention impl')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'timed repeats per variant (median reported)')
_TARGET_MS = flags.DEFINE_float('target_ms', 5.0, 'length of one timed loop, ms (--timer=device)')
_TIMER = flags.DEFINE_enum('timer', 'device', ['device', 'cupti'],
                           'device: fori-loop difference; cupti: kernel times of single calls')
_ROWS_CHECKED = flags.DEFINE_integer('rows_checked', 8, 'rows compared with the oracle per point')
_CHECK = flags.DEFINE_enum('check', 'first', ['first', 'all'],
                           'oracle check at the first point of each (heads, B), or at every point')
_SEARCH = flags.DEFINE_enum('search', 'staircase', ['staircase', 'full'], 'which points run')
_BUDGET_S = flags.DEFINE_float('budget_s', 0.0, 'start no point after this many seconds (0: none)')
_MAX_KV_GIB = flags.DEFINE_float('max_kv_gib', 24.0, 'skip points whose K+V buffers exceed this')
_SLACK = flags.DEFINE_float('slack', 0.03, 'batched counts as not slower at ratio <= 1 + slack')
_SEED = flags.DEFINE_integer('seed', 0, 'input seed')
_WORKDIR = cli.workdir_flag('break_even')
_RESUME = flags.DEFINE_bool('resume', False, 'keep --workdir/results.jsonl and replay its points '
                            'of the same workload: a sweep cut by --budget_s goes on')
_WRITE_THRESHOLDS = flags.DEFINE_string(
    'write_thresholds', '', 'also write the derived thresholds JSON here (SharingPolicy.load)'
)
cli.at_least(1, 'head_dim', 'query_len', 'suffix', 'page_size', 'repeats', 'rows_checked')
cli.at_least(0, 'budget_s', 'slack')
cli.at_least(0.001, 'target_ms', 'max_kv_gib')
cli.int_list('lengths')
cli.int_list('rows')
cli.int_list('batches')

VARIANTS = ('batched', 'per_sequence')
# Statuses of a measured point at which batched counts as lost (an exception, a wrong result,
# a time below the timer's noise): keeping it shared is not justified by a measurement.
LOST = ('failed', 'wrong', 'untimeable')


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


def kv_tokens(batch: int, length: int, rows: int, page_size: int) -> int:
  """Tokens of `make_plan`'s K/V buffer: the roots, then one private page per row."""
  return batch // rows * length + batch * page_size


def kv_bytes(batch: int, length: int, rows: int, heads, config: dict) -> int:
  """Bytes of the point's K and V buffers."""
  per_token = heads[1] * config['head_dim'] * jnp.dtype(config['dtype']).itemsize * 2
  return kv_tokens(batch, length, rows, config['page_size']) * per_token


_ATTEND = jax.jit(lambda q, k, v, plan: hj.attend(q, k, v, plan))  # one jit: compiles are reused
_FLUSH = jax.jit(lambda x: jnp.sum(x))


def cupti_time(fn, *args, repeats: int = 5, flush_bytes: int | None = None,
               **unused) -> timing.Timing:
  """Median over `repeats` single calls of the summed CUPTI kernel times, L2 flushed before each.

  One compiled program per shape serves every call (no timing loop to compile); GPU only.
  """
  del unused
  flush_bytes = timing.default_flush_bytes() if flush_bytes is None else flush_bytes
  flush = jnp.ones((max(1, flush_bytes // 4),), jnp.float32)
  jax.block_until_ready(fn(*args))  # compile and warm
  samples = []
  for _ in range(repeats):
    jax.block_until_ready(_FLUSH(flush))
    _, kernels = timing.kernel_times(fn, *args)
    samples.append(sum(k[1] for k in kernels) * 1e-6)
  return timing.Timing(
      median_s=statistics.median(samples), samples_s=tuple(samples), iterations=1,
      method='CUPTI kernel time of one call (sum over its kernels), L2 flushed before each',
      flush_bytes=flush_bytes,
  )


def _cupti_works() -> bool:
  """Whether CUPTI kernel timing runs here (else --timer=device is used, with a warning)."""
  try:
    _, kernels = timing.kernel_times(_FLUSH, jnp.ones((1024,), jnp.float32))
    if kernels:
      return True
    reason = 'no kernel was recorded'
  except Exception as e:  # a CPU jaxlib, a missing extension
    reason = f'{type(e).__name__}: {e}'
  logging.warning('--timer=cupti unavailable (%s): timing with --timer=device', reason)
  return False


def _inputs(batch: int, heads, length: int, rows: int, config: dict, cache: dict):
  """q for the point and K/V buffers, reused across points of the same heads when they fit."""
  n_heads, kv_heads = heads
  dtype = jnp.dtype(config['dtype'])
  kq, kk, kv = jax.random.split(jax.random.key(config['seed']), 3)
  q = jax.random.normal(kq, (batch, config['query_len'], n_heads, config['head_dim']), dtype)
  need = kv_tokens(batch, length, rows, config['page_size'])
  held = cache.get(heads)
  if held is None or held[0].shape[0] < need:
    cache.pop(heads, None)
    gc.collect()
    size = max(need, config.get('kv_tokens_hint', {}).get(heads, 0))
    held = cache[heads] = tuple(_random_buffer(key, size, kv_heads, config['head_dim'], dtype)
                                for key in (kk, kv))
  return q, held[0], held[1]


_BLOCK_TOKENS = 65536


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_buffer(key, size: int, kv_heads: int, head_dim: int, dtype) -> jax.Array:
  """[size, K, H] normal values: one block of 64K tokens repeated (one call of jax.random for
  tens of GiB would pass threefry's limit and take longer; the oracle reads the same buffer)."""
  block = jax.random.normal(key, (min(size, _BLOCK_TOKENS), kv_heads, head_dim), dtype)
  return jnp.tile(block, (-(-size // block.shape[0]), 1, 1))[:size]


def run_point(heads, batch: int, length: int, rows: int, config: dict, *,
              time_fn: Callable[..., timing.Timing] = timing.device_time, check: bool = True,
              buffers: dict | None = None) -> dict:
  """Checks both variants against the oracle (when `check`), then times them; returns the record.

  `time_fn(fn, *args, **config['timing'])` times one variant (`timing.device_time`, `cupti_time`;
  tests pass given timings). `buffers`: K/V buffers per heads, reused between points.
  """
  n_heads, kv_heads = heads
  rec = dict(
      kind='point', length=length, rows=rows, batch=batch, groups=batch // rows,
      num_q_heads=n_heads, num_kv_heads=kv_heads, group_size=n_heads // kv_heads,
      head_dim=config['head_dim'], dtype=config['dtype'], query_len=config['query_len'],
      suffix=config['suffix'], page_size=config['page_size'], impl_requested=config['impl'],
      tolerance=sweep.TOLERANCE.get(config['dtype'], 2e-2), checked=check,
  )
  plan = make_plan(batch, length, rows, config['suffix'], config['page_size'])
  per_sequence = hj.SharingPolicy.demote_all().apply(plan)
  if per_sequence.segments:
    return dict(rec, status='failed', reason='the root segments were not demoted')
  try:
    q, k_cache, v_cache = _inputs(batch, heads, length, rows, config,
                                  {} if buffers is None else buffers)
    shapes = hj.AttentionShapes.of(q, k_cache)
    # Each timed call is a layer of a decode step: what the step derives from its lengths
    # (`for_step`: the Mosaic GPU lane table) is built once, outside it, as the model does.
    # (The shipped thresholds, grid_2026-12-01, timed calls that built it themselves.)
    plans = {name: hj.prepare_attention(p.to_device(), shapes, impl=config['impl']).for_step()
             for name, p in (('batched', plan), ('per_sequence', per_sequence))}
    rec['impl'] = plans['batched'].impl.value
    if check:
      checked = np.asarray(workloads.check_rows(batch, config['rows_checked']))
      indices, lengths = plan.row_token_indices()
      idx = jnp.asarray(indices[checked])
      lengths = jnp.asarray(lengths[checked])
      expected = hj.naive_attention(q[checked], k_cache[idx], v_cache[idx], lengths).out
      expected = np.asarray(expected, np.float32)
      for name in VARIANTS:
        out = np.asarray(_ATTEND(q, k_cache, v_cache, plans[name]).out, np.float32)
        rec[f'rel_error_{name}'] = sweep.relative_error(out[checked], expected)
      if not all(rec[f'rel_error_{name}'] <= rec['tolerance'] for name in VARIANTS):
        return dict(rec, status='wrong')
    for name in VARIANTS:
      t = time_fn(_ATTEND, q, k_cache, v_cache, plans[name], **config['timing'])
      rec.update({
          f'time_{name}_us': t.median_us,
          f'samples_{name}_us': [x * 1e6 for x in t.samples_s],
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


def won(rec: dict | None, slack: float) -> bool:
  """Batched was measured within `slack` of per-sequence (or faster)."""
  return bool(rec) and rec.get('status') == 'ok' and rec['ratio'] <= 1 + slack


def staircase(batch: int, lengths, rows, feasible: Callable[[int, int], bool], slack: float):
  """The points of one (heads, B): a generator of (n, r) that is sent each point's record.

  n from the longest down; r from the smallest candidate (dividing B, <= B, feasible) above
  every r that lost at a longer segment, galloping up (1, 2, 4 candidates further) to the
  first win, then bisecting back to the smallest winning candidate. An n lost at every r ends
  the walk.
  """
  rs = [r for r in sorted(set(rows)) if r <= batch and batch % r == 0]
  low = 0  # rs[:low] lost at a longer segment: they lose at shorter ones too
  for n in sorted(set(lengths), reverse=True):
    i = low
    while i < len(rs) and not feasible(n, rs[i]):
      i += 1
    if i == len(rs):
      continue  # nothing fits at this n
    # lost: below it nothing is probed at n (lost at n or longer, or over the K/V cap);
    # measured: whether some r lost at n itself.
    lost, win, step, measured = i - 1, None, 1, False
    while win is None and lost < len(rs) - 1:
      rec = yield n, rs[i]
      if won(rec, slack):
        win = i
      else:
        lost, i, step, measured = i, min(i + step, len(rs) - 1), step * 2, True
    while win is not None and win - lost > 1:
      mid = (lost + win) // 2
      rec = yield n, rs[mid]
      if won(rec, slack):
        win = mid
      else:
        lost, measured = mid, True
    if measured:
      low = max(low, lost + 1)
    if win is None:
      return


def full_grid(batch: int, lengths, rows, feasible: Callable[[int, int], bool], slack: float):
  """Every feasible (n, r) of one (heads, B), as a generator like `staircase`."""
  del slack
  for n in lengths:
    for r in rows:
      if r <= batch and batch % r == 0 and feasible(n, r):
        yield n, r


SEARCHES = {'staircase': staircase, 'full': full_grid}


def derive_thresholds(records, slack: float) -> dict | None:
  """Format-2 thresholds from the measured points (see the module docstring); None if none ok."""
  measured: dict[tuple[int, int], dict[int, dict[int, float]]] = {}
  heads_of: dict[int, list[int]] = {}
  any_ok = False
  for r in records:
    if r.get('kind') != 'point' or r.get('status') not in ('ok',) + LOST:
      continue
    any_ok |= r['status'] == 'ok'
    g = r.get('group_size', 1)
    heads_of.setdefault(g, [r.get('num_q_heads'), r.get('num_kv_heads')])
    ratio = r['ratio'] if r['status'] == 'ok' else float('inf')
    measured.setdefault((g, r['batch']), {}).setdefault(r['length'], {})[r['rows']] = ratio
  if not any_ok:
    return None
  per_cell, beyond = {}, []
  for (g, b), by_n in sorted(measured.items()):
    steps = []
    for n in sorted(by_n):
      rows = sorted(by_n[n])
      first = len(rows)  # index of the smallest r from which on batched is never slower
      while first > 0 and by_n[n][rows[first - 1]] <= 1 + slack:
        first -= 1
      if first == len(rows):
        beyond.append([g, b, n])
      steps.append([n, rows[first] if first < len(rows) else b + 1])
    # Canonical: min_rows is the first step's r_min; only steps that change r_min remain.
    min_rows = steps[0][1]
    kept, last = [], min_rows
    for n, r in steps:
      if r != last:
        kept.append([n, r])
        last = r
    per_cell[g, b] = (min_rows, kept)
  tables = []
  for g in sorted({g for g, _ in per_cell}):
    for b in sorted(b for gg, b in per_cell if gg == g):
      min_rows, steps = per_cell[g, b]
      last = tables[-1] if tables else None
      if last and last['group_size'] == g and (last['min_rows'], last['steps']) == (
          min_rows, steps):
        last['batches'][1] = b
      else:
        tables.append(dict(group_size=g, batches=[b, b], min_rows=min_rows, steps=steps))
  return {
      'format': FORMAT_V2,
      'status': 'measured',
      'tables': tables,
      'beyond_measured': beyond,
      'slack': slack,
      'heads': {str(g): h for g, h in sorted(heads_of.items())},
      # None: lost without a ratio (failed, wrong or untimeable).
      'ratios': {str(g): {str(b): {str(n): {str(r): v if v != float('inf') else None
                                            for r, v in sorted(x.items())}
                                   for n, x in sorted(by_n.items())}}
                 for (g, b), by_n in sorted(measured.items())},
  }


def violations(policy: hj.SharingPolicy, records, slack: float) -> list[dict]:
  """Measured points that `policy` keeps shared although batched was over `slack` slower."""
  out = []
  for r in records:
    if r.get('kind') != 'point' or r.get('status') not in ('ok',) + LOST:
      continue
    needed = policy.rows_needed(r['length'], num_rows=r['batch'], group_size=r['group_size'])
    if r['rows'] >= needed and not won(r, slack):
      out.append(r)
  return out


def plot_ratio(records, path: str) -> bool:
  """ratio vs r, one line per n, one panel per (heads, B); False (nothing written) without ok."""
  import matplotlib  # imported here: only plotting needs it
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  ok = [r for r in records if r.get('status') == 'ok']
  cells = sorted({(r['num_q_heads'], r['num_kv_heads'], r['batch']) for r in ok})
  if not cells:
    return False
  cols = min(len(cells), 5)
  nrows = -(-len(cells) // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
  for ax in axes.flat[len(cells):]:
    ax.set_visible(False)
  for ax, (nh, kh, b) in zip(axes.flat, cells):
    mine = [r for r in ok if (r['num_q_heads'], r['num_kv_heads'], r['batch']) == (nh, kh, b)]
    for n in sorted({r['length'] for r in mine}):
      pts = sorted((r['rows'], r['ratio']) for r in mine if r['length'] == n)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=f'n={n}')
    ax.axhline(1.0, color='k', lw=0.8)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    rows = sorted({r['rows'] for r in mine})
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel('rows r per shared segment')
    ax.set_ylabel('batched / per-sequence')
    ax.set_title(f'{nh}/{kh} heads, B={b}: below 1, batched wins', fontsize=8)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def _ratio_cell(r: dict) -> str:
  if 'ratio' in r:
    return f'{r["ratio"]:.3f}'
  if r.get('status') == 'wrong':
    errors = [r.get(f'rel_error_{v}') for v in VARIANTS]
    return 'rel. errors ' + ', '.join(f'{e:.2g}' for e in errors if e is not None)
  return r.get('reason', '')


def write_table(records, thresholds: dict | None, path: str, notes=()) -> None:
  points = [r for r in records if r.get('kind') == 'point']
  meta = points[0]['meta'] if points else {}
  first = points[0] if points else {}
  fmt = lambda r, k: f'{r[k]:.1f}' if r.get(k) is not None else ''
  columns = [
      ('heads', lambda r: f'{r["num_q_heads"]}/{r["num_kv_heads"]}'),
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
      f'Head dim {first.get("head_dim")}, {first.get("dtype")}, T={first.get("query_len")}, '
      f'private suffix {first.get("suffix")}, page size {first.get("page_size")}. B/r groups of r '
      'rows share a root of n tokens. Device time per call (median, L2 flushed; '
      f'{first.get("timing_method", "")}); ratio = batched / per-sequence (below 1: batched '
      'wins). Outputs checked against the naive oracle where `checked` (the first point of each '
      '(heads, B)).', '',
      report.markdown_table(points, columns), '',
  ]
  lines += [f'- {note}' for note in notes] + ([''] if notes else [])
  if thresholds:
    slack = thresholds['slack']
    lines += [f'## Thresholds (ratio <= 1 + {slack:g} from r_min on, per group size N/K and B)',
              '']
    rows = []
    for t in thresholds['tables']:
      rmin = [f'{t["min_rows"]}'] + [f'{r} from n={n}' for n, r in t['steps']]
      rows.append(dict(g=t['group_size'], b='{}..{}'.format(*t['batches']), r=', '.join(rmin)))
    lines += [report.markdown_table(rows, [('N/K', 'g'), ('B', 'b'), ('r_min', 'r')]), '']
    if thresholds['beyond_measured']:
      lines += ['Batched lost at every measured r (N/K, B, n): ' + ', '.join(
          str(tuple(x)) for x in thresholds['beyond_measured']), '']
  with open(path, 'w') as f:
    f.write('\n'.join(lines))


def parse_heads(specs) -> list[tuple[int, int]]:
  out = []
  for spec in specs:
    try:
      heads = tuple(int(x) for x in spec.split(':'))
    except ValueError:
      heads = ()
    if len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1]:
      raise app.UsageError(f'--heads must be N:K with N a multiple of K, got {spec!r}')
    out.append(heads)
  return out


def check_config(lengths, page: int, query_len: int, suffix: int) -> None:
  """Checks the grid's flags before any work."""
  if page < 1 or any(n % page for n in lengths):
    raise app.UsageError(f'--lengths {lengths} must be multiples of --page_size={page}')
  if not 1 <= query_len <= suffix <= page:
    raise app.UsageError('need 1 <= --query_len <= --suffix <= --page_size')


def _point_key(rec: dict) -> tuple:
  return ((rec['num_q_heads'], rec['num_kv_heads']), rec['batch'], rec['length'], rec['rows'])


# What must match for a point of an earlier run to stand for this run's (with --resume).
_SAME_WORKLOAD = ('head_dim', 'dtype', 'query_len', 'suffix', 'page_size')


def earlier_points(path: str, config: dict) -> dict[tuple, dict]:
  """Points of an earlier run in `path` measured on this workload, by (heads, B, n, r)."""
  if not os.path.exists(path):
    return {}
  out = {}
  for rec in report.read_jsonl(path):
    if rec.get('kind') == 'point' and all(rec.get(k) == config[k] for k in _SAME_WORKLOAD):
      out[_point_key(rec)] = rec
  return out


def run(cells, config: dict, workdir: str, *, slack: float, search: str = 'full',
        budget_s: float = 0.0, max_kv_bytes: float = float('inf'),
        time_fn: Callable[..., timing.Timing] = timing.device_time, check: str = 'first',
        resume: bool = False):
  """Walks the points of each (heads, batch) cell in turn into workdir.

  Returns (records, thresholds or None). `config['lengths']`, `config['rows']`: the grid.
  Writes results.jsonl (replaced; with `resume`, kept, and the walks replay its points of the
  same workload without running them, so a sweep cut by --budget_s goes on where it stopped),
  table.md and ratio.png (when a point was timed).
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'results.jsonl')
  earlier = earlier_points(path, config) if resume else {}
  if os.path.exists(path) and not resume:
    os.remove(path)
  writer = report.JsonlWriter(path)
  records, notes, skipped = [], [], []
  walks = []
  for heads, b in cells:
    def feasible(n, r, heads=heads, b=b):
      fits = kv_bytes(b, n, r, heads, config) <= max_kv_bytes
      if not fits and (heads, b, n, r) not in skipped:
        skipped.append((heads, b, n, r))
      return fits
    walk = SEARCHES[search](b, config['lengths'], config['rows'], feasible, slack)
    walks.append([heads, b, walk, None, True])  # heads, batch, walk, last record, first point
  buffers: dict = {}
  start = time.monotonic()
  ticks = report.progress_counter(desc='break_even points')  # the walks end adaptively
  while walks:
    for w in list(walks):
      heads, b, walk, last, first = w
      try:
        n, r = walk.send(last) if last is not None else next(walk)
      except StopIteration:
        walks.remove(w)
        continue
      rec = earlier.get((heads, b, n, r))  # replayed: no device time, no budget
      if rec is None:
        if budget_s and time.monotonic() - start > budget_s:
          notes.append(f'{heads[0]}/{heads[1]} heads, B={b}: cut by --budget_s={budget_s:g} '
                       'before its walk ended')
          walks.remove(w)
          continue
        rec = writer.append(run_point(heads, b, n, r, config, time_fn=time_fn,
                                      check=first or check == 'all', buffers=buffers))
      records.append(rec)
      ticks.update()
      w[3], w[4] = rec, False
      logging.info('%d/%d B=%d n=%d r=%d: %s %s (%.0f s)', heads[0], heads[1], b, n, r,
                   rec['status'], f'ratio {rec["ratio"]:.3f}' if 'ratio' in rec else
                   rec.get('reason', ''), time.monotonic() - start)
  ticks.close()
  if skipped:
    notes.append('skipped (K/V over --max_kv_gib), (heads, B, n, r): ' + ', '.join(
        f'({h[0]}/{h[1]}, {b}, {n}, {r})' for h, b, n, r in skipped))
  thresholds = derive_thresholds(records, slack)
  write_table(records, thresholds, os.path.join(workdir, 'table.md'), notes)
  plot_ratio(records, os.path.join(workdir, 'ratio.png'))
  with open(os.path.join(workdir, 'table.md')) as f:
    report.write_workdir_readme(workdir, 'Break-even: batched vs per-sequence attention',
                                f.read(), writer.meta)
  logging.info('wrote %s, table.md in %.0f s', path, time.monotonic() - start)
  return records, thresholds


def write_thresholds(thresholds: dict, records, config: dict, path: str) -> None:
  """The thresholds JSON with where they come from, checked to load as a `SharingPolicy` that
  keeps no measured shape shared where batched lost."""
  meta = records[-1]['meta']
  thresholds = dict(
      thresholds, device=meta['device'], command=meta['command'],
      git_commit=meta.get('git_commit'), timestamp=records[-1]['timestamp'],
      impl=sorted({r['impl'] for r in records if 'impl' in r}),
      workload={k: config[k] for k in ('head_dim', 'dtype', 'query_len', 'suffix', 'page_size',
                                       'lengths', 'rows')},
  )
  policy = hj.SharingPolicy.from_dict(thresholds)  # what default() will load must load
  bad = violations(policy, records, thresholds['slack'])
  if bad:
    raise AssertionError(f'thresholds keep {len(bad)} measured points shared that lost: '
                         f'{[(r["group_size"], r["batch"], r["length"], r["rows"]) for r in bad]}')
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(thresholds, f, indent=2)
    f.write('\n')
  logging.info('wrote thresholds %s', path)


def main(argv):
  del argv
  lengths, rows, batches = (_ints(f.name, f.value) for f in (_LENGTHS, _ROWS, _BATCHES))
  heads_list = parse_heads(_HEADS.value)
  check_config(lengths, _PAGE_SIZE.value, _QUERY_LEN.value, _SUFFIX.value)
  config = dict(
      head_dim=_HEAD_DIM.value, dtype=_DTYPE.value, query_len=_QUERY_LEN.value,
      suffix=_SUFFIX.value, page_size=_PAGE_SIZE.value, impl=_IMPL.value,
      rows_checked=_ROWS_CHECKED.value, seed=_SEED.value, lengths=lengths, rows=rows,
  )
  if _TIMER.value == 'cupti' and _cupti_works():
    time_fn, config['timing'] = cupti_time, dict(repeats=_REPEATS.value)
  else:
    time_fn = timing.device_time
    config['timing'] = dict(repeats=_REPEATS.value, target_s=_TARGET_MS.value * 1e-3)
  # One K/V buffer per heads, sized for the largest point that fits: no reallocation per point.
  max_bytes = _MAX_KV_GIB.value * 2**30
  hint = {}
  for heads in heads_list:
    sizes = [kv_tokens(b, n, r, _PAGE_SIZE.value) for b in batches for n in lengths for r in rows
             if r <= b and b % r == 0 and kv_bytes(b, n, r, heads, config) <= max_bytes]
    hint[heads] = max(sizes, default=0)
  config['kv_tokens_hint'] = hint
  cells = [(h, b) for b in batches for h in heads_list]
  records, thresholds = run(cells, config, _WORKDIR.value, slack=_SLACK.value,
                            search=_SEARCH.value, budget_s=_BUDGET_S.value,
                            max_kv_bytes=max_bytes, time_fn=time_fn, check=_CHECK.value,
                            resume=_RESUME.value)
  with open(os.path.join(_WORKDIR.value, 'table.md')) as f:
    print(f.read())
  if _WRITE_THRESHOLDS.value:
    if thresholds is None:
      raise app.Error('no point was timed (each failed, was wrong or untimeable): no thresholds '
                      'written')
    config.pop('kv_tokens_hint')
    write_thresholds(thresholds, records, config, _WRITE_THRESHOLDS.value)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
