r"""Tensor-parallel scaling from two `experiments.throughput` runs.

Reads the `throughput.jsonl` of a TP=1 and a TP=2 run of the same grid and writes, per
(mode, B, P): tok/s at each, the speedup, the scaling efficiency (TP=2 tok/s / (2 x TP=1
tok/s)), and, from each point's profiled step (`--profile_kernels`), the share of device time in
NCCL all-reduce kernels; as scaling.md, scaling.jsonl and scaling.png in --workdir.

  python -m experiments.tp_scaling --tp1=experiments/results/tp_scaling/13b_tp1 \
      --tp2=experiments/results/tp_scaling/13b_tp2 --workdir=experiments/results/tp_scaling
"""

import json
import os

from absl import app, flags

from experiments import cli
from experiments.benchmarking import markdown_table, read_jsonl, report

_TP1 = flags.DEFINE_string('tp1', None, 'folder of the TP=1 throughput run', required=True)
_TP2 = flags.DEFINE_string('tp2', None, 'folder of the TP=2 throughput run', required=True)
_WORKDIR = cli.workdir_flag('tp_scaling')


def collective_share(record: dict) -> float | None:
  """Fraction of the profiled step's kernel time (all devices) in NCCL kernels."""
  kernels = record.get('top_kernels')
  if not kernels:
    return None
  total = sum(k[1] for k in kernels)
  return sum(k[1] for k in kernels if 'nccl' in k[0].lower()) / total


def scaling_rows(tp1: list[dict], tp2: list[dict]) -> list[dict]:
  """One row per (mode, B, P) measured ok in both runs."""
  key = lambda r: (r['name'], r['batch'], r['prefix'])
  one = {key(r): r for r in tp1 if r.get('status') == 'ok'}
  rows = []
  for r2 in tp2:
    r1 = one.get(key(r2))
    if r2.get('status') != 'ok' or r1 is None:
      continue
    speedup = r2['tokens_per_s'] / r1['tokens_per_s']
    rows.append(dict(
        mode=r2['name'], batch=r2['batch'], prefix=r2['prefix'], preset=r2.get('preset'),
        tp1_tokens_per_s=r1['tokens_per_s'], tp2_tokens_per_s=r2['tokens_per_s'],
        speedup=speedup, efficiency=speedup / 2, tp1_step_ms=1e3 * r1['step_s'],
        tp2_step_ms=1e3 * r2['step_s'], tp2_collective_share=collective_share(r2),
        tp2_attention_over_floor=r2.get('attention_over_floor'),
        tp1_attention_over_floor=r1.get('attention_over_floor')))
  return rows


def main(argv):
  del argv
  rows = scaling_rows(read_jsonl(os.path.join(_TP1.value, 'throughput.jsonl')),
                      read_jsonl(os.path.join(_TP2.value, 'throughput.jsonl')))
  if not rows:
    raise app.UsageError('no (mode, B, P) measured ok in both runs')
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, 'scaling.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  table = markdown_table(rows, [
      ('mode', 'mode'), ('B', 'batch'), ('P', 'prefix'), ('TP=1 tok/s', 'tp1_tokens_per_s'),
      ('TP=2 tok/s', 'tp2_tokens_per_s'), ('speedup', 'speedup'), ('efficiency', 'efficiency'),
      ('TP=1 step ms', 'tp1_step_ms'), ('TP=2 step ms', 'tp2_step_ms'),
      ('NCCL share (TP=2)', 'tp2_collective_share'),
      ('attn/floor TP=1', 'tp1_attention_over_floor'),
      ('attn/floor TP=2', 'tp2_attention_over_floor')])
  text = f'# TP=2 vs TP=1: {rows[0]["preset"]}\n\nFrom `{_TP1.value}` and `{_TP2.value}`.\n\n' + table
  with open(os.path.join(_WORKDIR.value, 'scaling.md'), 'w') as f:
    f.write(text)
  print(table)

  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  labels = [f'{r["mode"]}\nB={r["batch"]} P={r["prefix"]}' for r in rows]
  fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
  ax.bar(range(len(rows)), [r['speedup'] for r in rows], color='tab:blue')
  ax.axhline(2.0, color='gray', ls='--', label='ideal (2x)')
  ax.axhline(1.0, color='black', lw=0.8)
  ax.set_xticks(range(len(rows)), labels, fontsize=7)
  ax.set_ylabel('TP=2 / TP=1 decode tok/s')
  ax.set_title(f'{rows[0]["preset"]}: tensor-parallel speedup on two H200s')
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(_WORKDIR.value, 'scaling.png'), dpi=120)
  report.write_workdir_readme(_WORKDIR.value, f'TP=2 vs TP=1: {rows[0]["preset"]}', text)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
