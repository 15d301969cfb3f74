r"""What the KV cache's HBM layout costs one TPU decode step: the default layout against the one
the compiler chooses, both compiled from a CPU host (libtpu, no TPU).

The Mosaic TPU kernels read K and V as [L, K*H]. With several kv heads a chip, TPU tiles the
(K, H) dims of the model's [layers, L, K, H] cache, so that view is a relayout copy; the step
also copies the whole cache into the layouts its scatters and kernels want, and back, when the
cache arrives in the default layout. Compiling the same step with the cache's layout left to the
compiler (`Layout.AUTO` for the cache argument and result) shows what those edge copies cost:
temporaries, bytes accessed and the copies of at least a layer's K or V in the optimized HLO
(pallas_kernels/tpu/ROOFLINE.md reads them).

    JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 PYTHONPATH=.libtpu python -m experiments.tpu_cache_layout \
        --topology=v5e:2x4 --preset=codellama_13b --num_layers=2,40
"""

import json
import os
import re
import time

from absl import flags, logging

from experiments import cli
from experiments.benchmarking import markdown_table
from experiments.tpu_programs import decode_plan, model_step
from models import sharding_rules as sr
from models.config import PRESETS, get_config
from pallas_kernels.tpu import aot

_WORKDIR = cli.workdir_flag('tpu_cache_layout', 'where results.jsonl and table.md go')
_TOPOLOGY = flags.DEFINE_string('topology', 'v5e:2x4', 'a named TPU slice (generation:chips)')
_PRESET = flags.DEFINE_string('preset', 'codellama_13b', 'models/config.py preset')
_LAYERS = flags.DEFINE_list('num_layers', ['2'], 'layer counts to compile (0: the preset\'s)')
_BATCH = flags.DEFINE_integer('batch', 256, 'decode rows (sharing one prefix)')
_PREFIX = flags.DEFINE_integer('prefix', 16384, 'shared prefix tokens')
cli.at_least(1, 'batch', 'prefix')
cli.int_list('num_layers', 0)
cli.choices('preset', sorted(PRESETS))


def _compile(config, mesh, auto: bool):
  """(one tensor-parallel decode step compiled, one chip's elements of a layer's K)."""
  plan = decode_plan(_BATCH.value, _PREFIX.value)
  compiled = model_step(config, mesh, rows=plan.num_rows, query_tokens=1, plan=plan,
                        compiler_lays_out_cache=auto)
  heads = config.num_kv_heads * sr.kv_replication(config.num_heads, config.num_kv_heads, mesh)
  tp = sr.axis_size(mesh, sr.TP)
  return compiled, plan.kv_tokens * max(1, heads // tp) * config.head_dim


def _layer_copies(compiled, layer_elements: int) -> tuple[int, int]:
  """(count, GiB) of the optimized HLO's copies of at least one layer's K or V a chip."""
  count, elements = 0, 0
  for line in compiled.as_text().splitlines():
    found = re.search(r'= \w+\[([\d,]+)\]', line)
    if not found or not (' copy(' in line or 'ConcatBitcast' in line):
      continue
    size = 1
    for d in found.group(1).split(','):
      size *= int(d)
    if size >= layer_elements:
      count, elements = count + 1, elements + size
  return count, elements * 2 / 2**30  # bf16


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  n = len(aot.devices(_TOPOLOGY.value))
  mesh = aot.mesh(_TOPOLOGY.value, (n,), (sr.TP,))
  rows = []
  for layers in _LAYERS.value:
    overrides = {'num_layers': int(layers)} if int(layers) else {}
    config = get_config(_PRESET.value, **overrides)
    for auto in (False, True):
      start = time.perf_counter()
      row = dict(topology=_TOPOLOGY.value, preset=_PRESET.value, layers=config.num_layers,
                 mesh=f'tp:{n}', cache_layout='compiler-chosen' if auto else 'default')
      try:
        compiled, layer = _compile(config, mesh, auto)
      except Exception as e:  # noqa: BLE001 (out of HBM is the compiler's answer to "fits?")
        if 'RESOURCE_EXHAUSTED' not in str(e):
          raise
        rows.append(dict(row, fits_hbm=False, status=str(e)[:300],
                         compile_s=round(time.perf_counter() - start, 1)))
        logging.info('%s', rows[-1])
        continue
      stats = aot.stats(compiled, _TOPOLOGY.value)
      copies, copy_gib = _layer_copies(compiled, layer)
      rows.append(dict(
          row, status='ok', temp_gib=stats['bytes']['temp'] / 2**30,
          resident_gib=stats['resident_bytes'] / 2**30, fits_hbm=stats['fits_hbm'],
          bytes_accessed_gb=stats['bytes_accessed'] / 1e9, layer_copies=copies,
          layer_copy_gib=copy_gib, compile_s=round(time.perf_counter() - start, 1)))
      logging.info('%s', rows[-1])
  with open(os.path.join(_WORKDIR.value, 'results.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  table = markdown_table(rows, [
      ('layers', 'layers'), ('cache layout', 'cache_layout'), ('status', lambda r: r['status'][:60]),
      ('temporaries GiB', 'temp_gib'),
      ('resident GiB', 'resident_gib'), ('fits', 'fits_hbm'),
      ('GB accessed', 'bytes_accessed_gb'), ('copies of >= a layer', 'layer_copies'),
      ('their GiB', 'layer_copy_gib'), ('compile s', 'compile_s')])
  head = (f'# KV cache layout of one decode step: {_PRESET.value} on {_TOPOLOGY.value}, '
          f'tp:{n}, B={_BATCH.value}, P={_PREFIX.value}\n\n')
  with open(os.path.join(_WORKDIR.value, 'table.md'), 'w') as f:
    f.write(head + table)
  print(head + table)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
