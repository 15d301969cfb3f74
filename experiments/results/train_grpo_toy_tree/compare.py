"""Reward curves of toy GRPO runs with independent samples and with rollout trees, over seeds.

  python experiments/results/train_grpo_toy_tree/compare.py   # from the repository root

Reads each run's metrics.jsonl (`experiments.train_grpo_toy`, runs listed in RUNS), writes
compare.png and prints a markdown table (mean reward and exact answers over the last 100 steps).
"""

import json
import os

import matplotlib
import numpy as np

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)
# (label, runs): seed 0 is each setting's main folder, seeds 1 and 2 under seeds/.
RUNS = [
    ('G = 8 independent samples', [f'{RESULTS}/train_grpo_toy'] +
     [f'{HERE}/seeds/b0_s{s}' for s in (1, 2)]),
    ('trees: 2 branches x 4', [f'{HERE}/branches2'] + [f'{HERE}/seeds/b2_s{s}' for s in (1, 2)]),
    ('trees: 4 branches x 2', [f'{HERE}/branches4'] + [f'{HERE}/seeds/b4_s{s}' for s in (1, 2)]),
]


def steps(path):
  with open(os.path.join(path, 'metrics.jsonl')) as f:
    return [r for r in map(json.loads, f) if 'step' in r]


def main():
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  print('| rollouts | seeds | reward, last 100 steps (max 2) | exact answers, last 100 steps |')
  print('| --- | --- | --- | --- |')
  for label, runs in RUNS:
    records = [steps(r) for r in runs]
    reward = np.array([[r['reward'] for r in rs] for rs in records])
    exact = np.array([[r['exact'] for r in rs] for rs in records])
    window = 25
    smooth = np.array([np.convolve(x, np.ones(window) / window, mode='valid') for x in reward])
    line, = ax.plot(np.arange(smooth.shape[1]) + window - 1, smooth.mean(0), label=label)
    ax.fill_between(np.arange(smooth.shape[1]) + window - 1, smooth.min(0), smooth.max(0),
                    color=line.get_color(), alpha=0.2)
    last = lambda x: ', '.join(f'{v:.3f}' for v in x[:, -100:].mean(1))
    print(f'| {label} | {len(runs)} | {last(reward)} | {last(exact)} |')
  ax.set_xlabel('GRPO step')
  ax.set_ylabel('mean reward (25-step mean)')
  ax.set_title('toy GRPO, sums of two digits: 3 seeds each (band: min to max)')
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, 'compare.png'), dpi=120)


if __name__ == '__main__':
  main()
