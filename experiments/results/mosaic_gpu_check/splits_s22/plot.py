"""splits.png: the shared kernel's time against its kv splits (call 6) and `launch_time`'s estimate.

Run from the repository root: PYTHONPATH=. python experiments/results/mosaic_gpu_check/splits_s22/plot.py
"""
import os

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt

from pallas_kernels.mosaic_gpu import schedule

# µs a call of the shared kernel (results.jsonl, kind "time"), by kv heads and splits
MEASURED = {20: {1: 411.7, 2: 319.2, 3: 294.3, 4: 281.9}, 40: {1: 631.7, 2: 552.2, 3: 554.4}}
ROW_TILES, BLOCKS = 8, 129  # B=1024 rows of one query each: 8 tiles of 128; a 16K prefix: 129 blocks

fig, ax = plt.subplots(figsize=(6, 4))
for heads, points in MEASURED.items():
  splits = sorted(points)
  ax.plot(splits, [points[k] / points[1] for k in splits], 'o-', label=f'{heads} heads: measured')
  estimate = [schedule.launch_time([(ROW_TILES * k, schedule.cdiv(BLOCKS, k))] * heads,
                                   num_sms=132) for k in range(1, 9)]
  ax.plot(range(1, 9), [e / estimate[0] for e in estimate], 'x--',
          label=f'{heads} heads: launch_time estimate')
ax.set_xlabel('kv splits per segment')
ax.set_ylabel('shared-kernel time / time at 1 split')
ax.set_title('13B per-GPU shapes, B=1024, P=16K (H200, CUPTI)')
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'splits.png'), dpi=110)
