"""`experiments.tp_greedy_check` with a trained model: greedy tokens at tp:2 equal one device's.

Run as a subprocess on 2 fake CPU devices (experiments register absl flags, so they are never
imported by a test worker).
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_trained_model_gives_one_devices_tokens_at_tp2(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''),
             XLA_FLAGS='--xla_force_host_platform_device_count=2', JAX_PLATFORMS='cpu')
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.tp_greedy_check',
       '--checkpoint=' + os.path.join(ROOT, 'experiments', 'data', 'tiny_coder_h64'),
       '--meshes=none;tp:2', '--impl=xla', '--samples=2', '--new_tokens=16',
       f'--workdir={tmp_path}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / 'results.jsonl') as f:
    records = [json.loads(line) for line in f]
  assert [r['mesh'] for r in records] == ['none', 'tp:2']
  assert all(r['identical_to_first'] and r['rows_differing'] == 0 for r in records)
  assert records[0]['rows'] == 4 and records[0]['new_tokens'] == 16
  # Real margins (a random model's are often below 0.01 nats): the check can fail only for a
  # real difference between the meshes, not for rounding at a near-tie.
  assert min(r['smallest_margin'] for r in records) > 0.5
