"""Table and plot of a compile-once probe run (`probe.py`): each step's wall time and the step's
compiled programs, slot-sized against length-sized prompt segments.

  python3 experiments/results/train_compile_once/report.py experiments/results/train_compile_once/call1
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402


def main(folder):
  folder = pathlib.Path(folder)
  records = [json.loads(line) for line in (folder / 'results.jsonl').read_text().splitlines()]
  rows = ['| segments sized by | step | prompt lengths | wall s | compiled programs |',
          '| --- | --- | --- | --- | --- |']
  for r in records:
    rows.append(f"| {r['mode']} | {r['step']} | {r['prompt_lengths']} | {r['wall_s']:.2f} | "
                f"{r['compiled']} |")
  totals = {m: sum(r['wall_s'] for r in records if r['mode'] == m) for m in ('slot', 'length')}
  rows.append('')
  rows.append(f"Loop of {len(records) // 2} steps: {totals['slot']:.1f} s sized by slot, "
              f"{totals['length']:.1f} s sized by length.")
  (folder / 'table.md').write_text('\n'.join(rows) + '\n')
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for mode in ('slot', 'length'):
    steps = [r for r in records if r['mode'] == mode]
    total, xs, ys = 0.0, [], []
    for r in steps:
      total += r['wall_s']
      xs.append(r['step'])
      ys.append(total)
    ax.plot(xs, ys, marker='o', label=f'segments sized by {mode}')
  ax.set_xlabel('step (new prompt lengths each)')
  ax.set_ylabel('cumulative wall time, s')
  ax.set_title(f"GRPO loop, {records[0]['preset']} {records[0]['layers']} layers, "
               f"{records[0]['backend']}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(folder / 'wall.png', dpi=120)
  print('\n'.join(rows))


if __name__ == '__main__':
  main(sys.argv[1])
