"""The GEMMs' drift between a tree step and a no-attention step of the same run: the sum of the
profiled kernels named nvjet* or gemm_fusion* that both steps launch alike (same name, same
launches: the projections' matrix products), in every committed `experiments.throughput` run
with both modes at B=1024 (over the top kernels each run kept). From the repository root:

  python3 experiments/results/mosaic_gpu_check/s47/matmul_drift.py > experiments/results/mosaic_gpu_check/s47/matmul_drift.txt
"""
import glob
import json

print('run | B | P | no-attention GEMMs µs | tree GEMMs µs | tree - no-attention µs')
for path in sorted(glob.glob('experiments/results/**/*throughput.jsonl', recursive=True)):
  if '/s47/' in path:  # s47's files re-read s46's runs
    continue
  gemms = {}
  for line in open(path):
    r = json.loads(line)
    if r.get('status') != 'ok' or 'top_kernels' not in r:
      continue
    if r['batch'] == 1024:
      gemms.setdefault(r['prefix'], {})[r['name']] = {
          (name, calls): t for name, t, calls in r['top_kernels']
          if name.startswith(('nvjet', 'gemm_fusion'))}
  for p, by in sorted(gemms.items()):
    if 'no_attention' in by and 'tree_mosaic_gpu' in by:
      base, tree = by['no_attention'], by['tree_mosaic_gpu']
      alike = base.keys() & tree.keys()
      b_us, t_us = sum(base[k] for k in alike), sum(tree[k] for k in alike)
      print(f'{path} | 1024 | {p} | {b_us:.0f} | {t_us:.0f} | {t_us - b_us:+.0f}')
