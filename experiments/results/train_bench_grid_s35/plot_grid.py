"""Speedup of shared-prompt training attention over per-sequence cuDNN, one panel per G.

  python experiments/results/train_bench_grid_s35/plot_grid.py RESULTS.jsonl [RESULTS.jsonl ...] OUT.png

Each results.jsonl is a `experiments.train_bench` run (A.jsonl+B.jsonl: several files as one
run); a later run's points replace an earlier one's (same G, P, T), and the replaced ones are
drawn dashed as "before". Prints the latest points as a markdown table, with the time and
speedup they replaced.
"""

import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402


def records(paths):
  """{(G, P, T): {impl: record}} of the attention points of '+'-joined results.jsonl files."""
  by_point = {}
  for path in paths.split('+'):
    for line in open(path):
      r = json.loads(line)
      if r.get('kind') == 'attention' and r.get('status') == 'ok':
        by_point.setdefault((r['G'], r['P'], r['T']), {})[r['impl']] = r
  return {k: v for k, v in by_point.items() if 'per_seq_cudnn' in v and 'shared_mosaic_gpu' in v}


def speedups(paths):
  return {k: v['per_seq_cudnn']['time_s'] / v['shared_mosaic_gpu']['time_s']
          for k, v in records(paths).items()}


def table(paths):
  """Markdown rows of the last run's points, with the shared time an earlier run measured."""
  last, earlier = records(paths[-1]), {}
  for run in paths[:-1]:
    earlier.update(records(run))
  print('| G | P | T | cuDNN ms | shared ms (before) | shared ms | x cuDNN (before) | x cuDNN '
        '| shared / floor |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for (g, p, t), v in sorted(last.items()):
    cudnn, shared = v['per_seq_cudnn']['time_s'], v['shared_mosaic_gpu']['time_s']
    old = earlier.get((g, p, t))
    old_ms = f'{old["shared_mosaic_gpu"]["time_s"] * 1e3:.2f}' if old else ''
    old_x = (f'{old["per_seq_cudnn"]["time_s"] / old["shared_mosaic_gpu"]["time_s"]:.2f}'
             if old else '')
    print(f'| {g} | {p} | {t} | {cudnn * 1e3:.2f} | {old_ms} | {shared * 1e3:.2f} | {old_x} | '
          f'{cudnn / shared:.2f} | {v["shared_mosaic_gpu"]["time_over_floor"]:.2f} |')


def main(paths, out):
  table(paths)
  runs = [speedups(p) for p in paths]
  latest = {}
  for run in runs:
    latest.update(run)
  before = {k: v for run in runs[:-1] for k, v in run.items() if k in runs[-1]}
  groups = sorted({g for g, _, _ in latest})
  fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), sharey=True)
  for ax, g in zip(axes, groups):
    for t, color in zip((256, 1024, 2048), ('C0', 'C1', 'C2')):
      pts = sorted((p, s) for (gg, p, tt), s in latest.items() if gg == g and tt == t)
      if pts:
        ax.plot(*zip(*pts), 'o-', color=color, label=f'completions {t}')
      old = sorted((p, s) for (gg, p, tt), s in before.items() if gg == g and tt == t)
      if old:
        ax.plot(*zip(*old), 'x--', color=color, alpha=0.5)
    ax.axhline(1.0, color='gray', lw=0.8)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log', base=2)
    ax.set_yticks([0.5, 1, 2, 4, 8, 16], ['0.5', '1', '2', '4', '8', '16'])
    ax.set_xticks([1024, 2048, 4096, 8192], ['1K', '2K', '4K', '8K'])
    ax.set_xlabel('prompt tokens')
    ax.set_title(f'G = {g} samples a prompt')
  axes[0].set_ylabel('x faster than per-sequence cuDNN')
  axes[-1].legend(fontsize=8, title='solid: latest, dashed: before' if before else None,
                  title_fontsize=7)
  fig.suptitle('Training attention forward + backward, H200, 32/8 heads, d=128, bf16')
  fig.tight_layout()
  fig.savefig(out, dpi=110)


if __name__ == '__main__':
  main(sys.argv[1:-1], sys.argv[-1])
