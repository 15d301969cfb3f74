"""The serving benchmark's report: rates at a latency bound, their on/off ratio, tables, plots.

No flags here (experiments.serving defines them): tests import this module.
"""

import os

import numpy as np

from experiments.benchmarking import report


def rate_at_bound(points, bound: float) -> tuple[float | None, str]:
  """The highest rate whose mean normalized latency stays <= bound on a measured curve.

  Args:
    points: (rate, mean ms/token) per measured rate; a latency of None (the point
      timed out, or finished nothing) counts as over the bound.
    bound: the latency bound, ms/token.

  Walks the rates upwards to the first one over the bound. Returns (rate, status):
    'interpolated': linear interpolation between that rate and the one before;
    'at_least': that rate has no latency: the rate before it, a lower bound;
    'above_range': every measured rate is under the bound: the highest one, a lower bound;
    'below_range': the lowest measured rate is already over: None (it is below that rate);
    'no_data': no points.
  """
  prev = None
  for rate, latency in sorted(points, key=lambda p: p[0]):
    if latency is None or latency > bound:
      if prev is None:
        return None, 'below_range'
      if latency is None:
        return prev[0], 'at_least'
      r0, l0 = prev
      return r0 + (bound - l0) * (rate - r0) / (latency - l0), 'interpolated'
    prev = (rate, latency)
  return (prev[0], 'above_range') if prev else (None, 'no_data')


def rate_ratio(on: tuple[float | None, str], off: tuple[float | None, str],
               lowest: tuple[float, float]) -> tuple[float | None, str | None]:
  """Sharing on / off rates at the bound: (value, '=', '>=' or '<='), or (None, None).

  `on`, `off` are `rate_at_bound` results; `lowest` the lowest measured rate of
  each (what a 'below_range' rate is known to be under).
  """
  def kind(result, low):  # exact, a lower bound, an upper bound, or nothing known
    rate, status = result
    if status == 'interpolated':
      return 'E', rate
    if status in ('at_least', 'above_range'):
      return 'L', rate
    return ('U', low) if status == 'below_range' else (None, None)

  (k_on, v_on), (k_off, v_off) = kind(on, lowest[0]), kind(off, lowest[1])
  if k_on is None or k_off is None or not v_off:
    return None, None
  lower = k_on in 'EL' and k_off in 'EU'  # on/off is at least v_on / v_off
  upper = k_on in 'EU' and k_off in 'EL'  # at most
  if lower and upper:
    return v_on / v_off, '='
  if lower or upper:
    return v_on / v_off, '>=' if lower else '<='
  return None, None


_STATUS_NOTES = {
    'at_least': 'the next rate timed out', 'above_range': 'above the highest rate measured',
    'below_range': 'not reached: over the bound at the lowest rate measured',
}


def _rate_cell(row, sharing):
  rate, status = row.get(f'rate_{sharing}'), row.get(f'status_{sharing}')
  if status in (None, 'no_data'):
    return ''
  if status == 'interpolated':
    return f'{rate:.3g}'
  if status == 'below_range':
    return f'< {row[f"lowest_rate_{sharing}"]:g} ({_STATUS_NOTES[status]})'
  return f'>= {rate:.3g} ({_STATUS_NOTES[status]})'


def _ratio_cell(row):
  if row.get('ratio') is None:
    return 'unknown' if 'status_on' in row and 'status_off' in row else ''
  return (f'{row["ratio"]:.3g}' if row['ratio_bound'] == '=' else
          f'{row["ratio_bound"].replace(">=", "≥").replace("<=", "≤")} {row["ratio"]:.3g}')


def _most_cell(row, sharing):
  if row.get(f'most_tok_s_{sharing}') is None:
    return ''
  return (f'{row[f"most_tok_s_{sharing}"]:.0f} ({row[f"most_tok_s_batch_{sharing}"]:.0f}/'
          f'{row.get(f"max_batch_{sharing}")})')


def bound_summary(records: list[dict], bound_ms: float) -> list[dict]:
  """Per (prompt length, shared fraction, samples): each engine's rate at the latency bound.

  Also the tokens/s there (interpolated like the rate), each engine's host
  overhead per decode step and KV per live sequence at its point of largest mean
  batch, and its most tokens/s over the points that were not cut short (with that
  point's mean batch: an
  engine whose mean batch there is near its max_batch was saturated; the on/off
  ratio of these is a lower bound on the ratio of sustainable rates when only
  the engine without sharing was saturated). Points whose decode steps met a
  shape for the first time (a compile inside the point) are left out; their
  rates are listed in `compiled_rates_*`.
  """
  rows = []

  def setting(r):
    return r['prompt_len'], r['shared_frac'], r.get('num_samples', 1)

  for key in sorted({setting(r) for r in records}):
    row = dict(kind='rate_at_bound', prompt_len=key[0], shared_frac=key[1], num_samples=key[2],
               latency_bound_ms=bound_ms)
    results, lowest = {}, {}
    for sharing in ('on', 'off'):
      pts = sorted((r for r in records if setting(r) == key and r['sharing'] == sharing),
                   key=lambda r: r['rate'])
      compiled = [r['rate'] for r in pts if r.get('new_shape_steps')]
      pts = [r for r in pts if not r.get('new_shape_steps')]  # their latency has a compile in it
      if not pts:
        continue
      curve = [(r['rate'], None if r['timed_out'] else r['mean_norm_latency_ms']) for r in pts]
      rate, status = results[sharing] = rate_at_bound(curve, bound_ms)
      lowest[sharing] = pts[0]['rate']
      tok_s = None
      if rate is not None:
        tok_s = float(np.interp(rate, [r['rate'] for r in pts],
                                [r['throughput_tok_s'] for r in pts]))
      busiest = max(pts, key=lambda r: r['mean_batch'])
      whole = [r for r in pts if not r['timed_out']]  # a cut point's throughput is partial
      fastest = max(whole, key=lambda r: r['throughput_tok_s'], default={})
      row.update({
          f'compiled_rates_{sharing}': compiled,
          f'most_tok_s_{sharing}': fastest.get('throughput_tok_s'),
          f'most_tok_s_batch_{sharing}': fastest.get('mean_batch'),
          f'max_batch_{sharing}': fastest.get('max_batch'),
          f'rate_{sharing}': rate, f'status_{sharing}': status, f'tok_s_{sharing}': tok_s,
          f'lowest_rate_{sharing}': pts[0]['rate'], f'highest_rate_{sharing}': pts[-1]['rate'],
          f'batch_{sharing}': busiest['mean_batch'],
          f'host_ms_{sharing}': busiest['mean_decode_host_ms'],
          f'step_ms_{sharing}': busiest['mean_decode_step_ms'],
          f'host_pct_{sharing}': 100 * busiest['host_overhead_fraction'],
          f'peak_kv_{sharing}': max(r['peak_kv_gb'] for r in pts),
          f'kv_per_seq_{sharing}': busiest.get('kv_per_seq_mb'),
      })
    if not results:  # every point of the setting had a compile in it
      continue
    if len(results) == 2:
      row['ratio'], row['ratio_bound'] = rate_ratio(results['on'], results['off'],
                                                    (lowest['on'], lowest['off']))
      if row['most_tok_s_on'] and row['most_tok_s_off']:
        row['most_tok_s_ratio'] = row['most_tok_s_on'] / row['most_tok_s_off']
    rows.append(row)
  return rows


def summarize(records: list[dict], bounds_ms: list[float], workdir: str,
              writer=None) -> list[dict]:
  """table.md (every point + the rates at each latency bound), plots; returns the bound rows.

  With a writer, the bound rows are also appended to results.jsonl.
  """
  columns = [('sharing', 'sharing'), ('P', 'prompt_len'), ('shared', 'shared_frac'),
             ('n', lambda r: r.get('num_samples', 1)),
             ('rate req/s', 'rate'), ('done', 'completed'),
             ('ms/token mean', 'mean_norm_latency_ms'), ('p90', 'p90_norm_latency_ms'),
             ('TTFT s', 'mean_ttft_s'), ('tok/s', 'throughput_tok_s'), ('batch', 'mean_batch'),
             ('peak KV GB', 'peak_kv_gb'), ('KV/seq MB', lambda r: r.get('kv_per_seq_mb')),
             ('prefill tok', 'prefill_tokens'),
             ('cached tok', 'cached_tokens'), ('step ms', 'mean_decode_step_ms'),
             ('host ms', 'mean_decode_host_ms'),
             ('host %', lambda r: 100 * r['host_overhead_fraction']),
             ('new shapes', 'new_shape_steps'), ('attention', 'resolved_impl')]
  text = ('# Serving sweep\n\n'
          'Latency is per request (per sample), queueing included; rates count prompts. '
          'Host = decode step wall time minus the wait for the device (tree, metadata, Python, '
          'dispatch). KV/seq = KV in use per live sequence, mean over decode steps (cached '
          'prefixes included). Decode steps with shapes new to the engine (maybe a compile: '
          '"new shapes") are left out of the step and host figures, not of the latencies; the '
          'plots show only points without such a compile that were not cut short.\n\n'
          + report.markdown_table(records, columns))
  rows = []
  previous = None  # (bound, table) of the bound before
  for bound_ms in bounds_ms:
    best = bound_summary(records, bound_ms)
    rows += best
    table = bound_table(best)
    text += f'\n## Request rate at mean normalized latency <= {bound_ms:g} ms/token\n\n'
    if previous is not None and table == previous[1]:
      # E.g. a CPU smoke run: every latency is far under bounds sized for a 7B model on an H200.
      text += (f'Same table as at <= {previous[0]:g} ms/token: no measured mean normalized '
               'latency lies between the two bounds (the rows are in results.jsonl).\n')
      continue
    previous = (bound_ms, table)
    text += ('Highest rate whose mean normalized latency stays under the bound, interpolated '
             'linearly between the measured rates around the crossing; on/off is their ratio at '
             'that equal latency (≥ / ≤ where a rate is only bounded). Host ms and %, and KV per '
             'sequence, at each engine\'s point of largest mean batch. Most tok/s: the best '
             'delivered throughput over the points, with its mean batch and the engine\'s '
             'max batch. Points with a compile inside them are left out.\n\n' + table)
  if writer is not None:
    for row in rows:
      writer.append(row)
  with open(os.path.join(workdir, 'table.md'), 'w') as f:
    f.write(text)
  print(text)
  clean = [r for r in records if not r.get('new_shape_steps') and not r['timed_out']]
  if not clean:
    return rows
  report.plot_sweeps(clean, x='rate', y='throughput_tok_s', series='sharing',
                     fixed=['prompt_len', 'shared_frac'], ylabel='output tokens / s',
                     path=os.path.join(workdir, 'throughput.png'),
                     title='Delivered throughput vs request rate')
  report.plot_sweeps(clean, x='rate', y='mean_norm_latency_ms', series='sharing',
                     fixed=['prompt_len', 'shared_frac'], ylabel='ms per output token',
                     path=os.path.join(workdir, 'latency.png'),
                     title='Normalized latency vs request rate')
  report.plot_sweeps(clean, x='rate', y='peak_kv_gb', series='sharing',
                     fixed=['prompt_len', 'shared_frac'], ylabel='peak KV GB',
                     path=os.path.join(workdir, 'kv_memory.png'), title='Peak KV memory')
  return rows


def bound_table(best: list[dict]) -> str:
  """The markdown table of one latency bound's `bound_summary` rows."""
  return report.markdown_table(best, [
        ('P', 'prompt_len'), ('shared', 'shared_frac'), ('n', 'num_samples'),
        ('rate on', lambda r: _rate_cell(r, 'on')),
        ('rate off', lambda r: _rate_cell(r, 'off')), ('on/off', _ratio_cell),
        ('tok/s on', 'tok_s_on'), ('tok/s off', 'tok_s_off'),
        ('host ms on', 'host_ms_on'), ('host % on', 'host_pct_on'),
        ('batch on', 'batch_on'), ('host ms off', 'host_ms_off'),
        ('host % off', 'host_pct_off'), ('batch off', 'batch_off'),
        ('peak KV GB on', 'peak_kv_on'), ('peak KV GB off', 'peak_kv_off'),
        ('KV/seq MB on', lambda r: r.get('kv_per_seq_on')),
        ('KV/seq MB off', lambda r: r.get('kv_per_seq_off')),
        ('most tok/s on (batch/max)', lambda r: _most_cell(r, 'on')),
        ('most tok/s off (batch/max)', lambda r: _most_cell(r, 'off')),
        ('most tok/s on/off', lambda r: r.get('most_tok_s_ratio')),
        ('left out (compiled)', lambda r: ', '.join(
            f'{s} {r[f"compiled_rates_{s}"]}' for s in ('on', 'off')
            if r.get(f'compiled_rates_{s}')))])


def profile_table(profiles: list[dict]) -> str:
  """The decode profiles (`experiments.serving --profile_batches`) as a markdown section."""
  return ('\n## Decode steps of a full batch\n\nMean over the timed steps. Host = prepare (the '
          'tree, layout and batch arrays) + dispatch (the jitted call: arguments, uploads, '
          'kernel launches) + handing out tokens; device ms = the kernels of one profiled step '
          '(CUPTI, GPU only); layout ms = building the step\'s layout from the cache (cached '
          'metadata).\n\n'
          + report.markdown_table(profiles, [
              ('sharing', 'sharing'), ('P', 'prompt_len'), ('shared', 'shared_frac'),
              ('batch', 'batch'), ('padded', 'padded_rows'), ('step ms', 'mean_decode_step_ms'),
              ('host ms', 'mean_decode_host_ms'),
              ('prepare ms', lambda r: r.get('mean_decode_prepare_ms')),
              ('dispatch ms', lambda r: r.get('mean_decode_dispatch_ms')),
              ('wait ms', 'mean_decode_wait_ms'), ('device ms', lambda r: r.get('device_ms')),
              ('layout ms', 'layout_ms'), ('KV/seq MB', 'kv_per_seq_mb'),
              ('attention', 'resolved_impl'),
              ('overlap', lambda r: 'yes' if r.get('overlap_decode') else 'no'),
              ('CUDA graphs', lambda r: 'off' if r.get('command_buffers') is False else 'on')]))
