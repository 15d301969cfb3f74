"""s46's CodeLlama-7B decode steps (`../s46/call2/grid*_throughput.jsonl`) as raw records of
a57ff0f's `models.decode_benchmark`: the profiled step's private tokens (`kernel_suffix`: it ran
right after the timed steps), the timed steps' mean (`suffix_mid`), the Mosaic kernels' own sum
(`impl_kernels_s`, both of them are in each record's top 16), and as `kernel_profile` the top 16
kernels s46 kept (not every kernel: the matched share is then over those 16 of each step).
Then, from the repository root:

  python3 experiments/results/mosaic_gpu_check/s47/reread_s46.py
  python3 -m experiments.throughput --rebuild=experiments/results/mosaic_gpu_check/s47/reread_s46/grid1/raw.jsonl \
    --workdir=experiments/results/mosaic_gpu_check/s47/reread_s46/grid1       # and grid2
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DERIVED = ('attention_', 'tree_attention_floor_s', 'devices', 'matmul_flops_per_step',
           'matmul_efficiency', 'fraction_of_ceiling', 'predicted_tokens_per_s', 'speedup_vs_')

for grid in ('grid1', 'grid2'):
  out = os.path.join(HERE, 'reread_s46', grid)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(HERE, '..', 's46', 'call2', f'{grid}_throughput.jsonl')) as f, \
       open(os.path.join(out, 'raw.jsonl'), 'w') as raw:
    for line in f:
      r = {k: v for k, v in json.loads(line).items() if not k.startswith(DERIVED)}
      if r.get('status') == 'ok':
        first, steps = r['first_step'], r['steps_timed']
        r['suffix_mid'] = first + (steps - 1) / 2
        r['kernel_suffix'] = first + steps
        r['kernel_profile'] = r['top_kernels']  # the top 16 only
        if r['mode'] == 'tree':
          r['impl_kernels_s'] = 1e-6 * sum(us for name, us, _ in r['top_kernels']
                                           if 'mosaic_gpu_kernel' in name)
      raw.write(json.dumps(r) + '\n')
