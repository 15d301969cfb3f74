"""Compile the Mosaic TPU kernels and whole Llama steps for named TPU slices, from a CPU host.

No TPU is needed: libtpu's compiler runs deviceless (`pallas_kernels.tpu.aot`). For each
topology this compiles

* `kernels`: `hj.tree_attention(impl='mosaic_tpu')` on one chip at the ROOFLINE.md shapes (B
  rows sharing a P-token prefix, N/K heads, one decode token; head dim 128, and 64 as real
  small models have it, packed two kv heads a 128-lane vreg, beside the same call padded to
  128), and the training kernels' forward and backward (`prefill_attention`'s gradient);
* `decode` / `prefill`: one Llama step for each preset (prefill with impl='auto': the Mosaic
  kernels where their VMEM plan fits, else XLA), tensor parallel over the slice (and dp:2
  x tp where the slice has 4 chips or more), from abstract parameters (`jax.eval_shape`: no
  weights are made);
* `train`: one GRPO training step (`make_train_step`) of the smallest preset, tensor parallel.

Each program's row (JSONL) holds the compiler's per-chip argument / output / temporary bytes
against the chip's HBM, the collectives of the optimized HLO (kind, count, bytes),
`cost_analysis()` flops and bytes, the compiler's time estimate, and the roofline of those
flops and bytes on the chip (`pallas_kernels.tpu.aot.CHIPS`). `table.md` and `README.md` go
beside it.

    JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 PYTHONPATH=.:.libtpu python -m experiments.tpu_aot \
      --workdir=/tmp/tpu_aot
"""

import json
import os
import sys
import time

import jax
from absl import app, flags, logging

import hydrajax as hj
from experiments import cli
from experiments.benchmarking import report
from experiments.tpu_programs import (decode_plan, grpo_step, model_step, padded_tree_attention,
                                      training_kernels, tree_attention_kernels)
from models import sharding_rules as sr
from models.config import PRESETS, get_config
from pallas_kernels.tpu import aot

PROGRAMS = ('kernels', 'decode', 'prefill', 'train')
_WORKDIR = cli.workdir_flag('tpu_aot', 'where results.jsonl, table.md, README.md go')
_TOPOLOGIES = flags.DEFINE_list(
    'topologies', ['v5e:1x1', 'v5e:2x2', 'v5e:2x4', 'v5p:2x2x1', 'v5p:2x2x2', 'v6e:1x1',
                   'v6e:2x4'], 'named TPU slices (generation:chips); `v5e:2x4=decode+train` '
    'runs only those programs there (else --programs)')
_PRESETS = flags.DEFINE_list('presets', ['llama3_2_1b', 'llama3_1_8b', 'codellama_13b',
                                         'codellama_34b', 'llama3_1_70b'],
                              'models/config.py presets')
_PROGRAMS = flags.DEFINE_list('programs', list(PROGRAMS), f'any of {PROGRAMS}')
_BATCH = flags.DEFINE_integer('batch', 256, 'decode rows (sharing one prefix)')
_PREFIX = flags.DEFINE_integer('prefix', 16384, 'shared prefix tokens of the decode batch')
_PREFILL_TOKENS = flags.DEFINE_integer('prefill_tokens', 128, 'tokens a row in the prefill step')
_PREFILL_ROWS = flags.DEFINE_integer('prefill_rows', 8, 'rows in the prefill step')
_RESUME = flags.DEFINE_bool('resume', False, 'keep the rows of results.jsonl in --workdir and '
                            'compile only the programs it lacks')
cli.at_least(1, 'batch', 'prefix', 'prefill_tokens', 'prefill_rows')
cli.choices('programs', PROGRAMS)
cli.choices('presets', sorted(PRESETS))


def _meshes(topology):
  """(name, mesh): tp over every chip, and dp:2 x tp over the rest where there are 4 or more."""
  n = len(aot.devices(topology))
  yield f'tp:{n}', aot.mesh(topology, (n,), (sr.TP,))
  if n >= 4:
    yield f'dp:2,tp:{n // 2}', aot.mesh(topology, (2, n // 2), (sr.DP, sr.TP))


def _topologies():
  """(topology, programs) of --topologies."""
  for entry in _TOPOLOGIES.value:
    topology, _, programs = entry.partition('=')
    yield topology, set(programs.split('+') if programs else _PROGRAMS.value)


def _jobs(topology, asked):
  """(program, name, compile thunk) of every program asked for on this topology."""
  if 'kernels' in asked:
    for h in (128, 64):
      shape = dict(batch=_BATCH.value, prefix=_PREFIX.value, heads=32, kv_heads=8, head_dim=h)
      yield 'kernels', f'tree_attention B={_BATCH.value} P={_PREFIX.value} 32/8 H={h}', (
          lambda shape=shape: tree_attention_kernels(topology, **shape))
    yield 'kernels', 'tree_attention same, H=64 padded to 128', (
        lambda shape=shape: padded_tree_attention(topology, padded_dim=128, **shape))
    yield 'kernels', 'training fwd+bwd P=2048 G=2 T=512 32/8 H=128', (
        lambda: training_kernels(topology))
  for name in _PRESETS.value:
    config = get_config(name)
    for mesh_name, mesh in _meshes(topology):
      if config.num_heads % sr.axis_size(mesh, sr.TP):
        continue
      if 'decode' in asked:
        plan = decode_plan(_BATCH.value // sr.axis_size(mesh, sr.DP), _PREFIX.value)
        yield 'decode', f'{name} {mesh_name} B={_BATCH.value} P={_PREFIX.value}', (
            lambda config=config, mesh=mesh, plan=plan: model_step(
                config, mesh, rows=plan.num_rows, query_tokens=1, plan=plan))
      if 'prefill' in asked:
        rows = max(1, _PREFILL_ROWS.value // sr.axis_size(mesh, sr.DP))
        plan = hj.plan_tree(hj.PromptNode(0, num_samples=rows),
                            private_capacity=_PREFILL_TOKENS.value)
        yield 'prefill', f'{name} {mesh_name} {_PREFILL_ROWS.value}x{_PREFILL_TOKENS.value}', (
            lambda config=config, mesh=mesh, plan=plan, rows=rows: model_step(
                config, mesh, rows=rows, query_tokens=_PREFILL_TOKENS.value, plan=plan,
                impl='auto'))
  if 'train' in asked and _PRESETS.value:
    config = get_config(_PRESETS.value[0])
    n = len(aot.devices(topology))
    if config.num_heads % n == 0 and config.num_kv_heads % n == 0:
      yield 'train', f'grpo {config.name} tp:{n} 1x4 P=512 T=256', (
          lambda: grpo_step(config, aot.mesh(topology, (n,), (sr.TP,))))


def _check_flags():
  for t, _ in _topologies():
    try:
      aot.generation(t)
    except ValueError as e:
      raise app.UsageError(f'--topologies: {e}') from None
  unknown = set(_PROGRAMS.value).union(*(p for _, p in _topologies())) - set(PROGRAMS)
  if unknown:
    raise app.UsageError(f'--programs: unknown {sorted(unknown)}; known: {PROGRAMS}')
  bad = [p for p in _PRESETS.value if p not in PRESETS]
  if bad:
    raise app.UsageError(f'--presets: unknown {bad}; known: {sorted(PRESETS)}')
  reason = aot.libtpu_reason()
  if reason:
    raise app.UsageError(f'{reason}; `make tpu-aot` installs it (see the module doc)')


def _row_text(r):
  gib = lambda x: f'{x / 2**30:.2f}'
  if r['status'] != 'ok':
    return f"| {r['topology']} | {r['program']} | {r['name']} | {r['status']} |" + ' |' * 7
  b = r['bytes']
  coll = ', '.join(f"{k} {v['count']} ({v['bytes'] / 2**20:.1f} MiB)"
                   for k, v in r['collectives'].items() if v['count']) or 'none'
  est = r['compiler_seconds']
  return (f"| {r['topology']} | {r['program']} | {r['name']} | ok | {gib(b['argument'])} / "
          f"{gib(b['temp'])} / {gib(b['output'])} | {gib(r['hbm_bytes'])} "
          f"{'fits' if r['fits_hbm'] else 'DOES NOT FIT'} | {r['mosaic_kernels']} | {coll} | "
          f"{r['flops'] / 1e9:.1f} / {r['bytes_accessed'] / 2**20:.0f} | "
          f"{'-' if est is None else f'{est * 1e6:.0f}'} | {r['roofline_seconds'] * 1e6:.0f} |")


TABLE_HEAD = (
    '| topology | program | shapes | status | per chip GiB: args / temp / out | HBM GiB | Mosaic '
    'kernels | collectives (per chip) | GFLOP / MiB accessed | compiler estimate µs | roofline '
    'µs |\n|' + ' --- |' * 11)


def _write_reports(rows, command):
  with open(os.path.join(_WORKDIR.value, 'table.md'), 'w') as f:
    f.write(TABLE_HEAD + '\n' + '\n'.join(_row_text(r) for r in rows) + '\n')
  with open(os.path.join(_WORKDIR.value, 'README.md'), 'w') as f:
    commands = list(dict.fromkeys(r.get('command', command) for r in rows))
    f.write('# TPU programs compiled from a CPU host (libtpu, no TPU)\n\n'
            'Commands (each row records its own; a resumed run keeps the rows it finds):\n\n'
            + ''.join(f'    {c}\n' for c in commands) + '\n'
            f'(JAX {jax.__version__}; `JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1`, libtpu on the '
            'path: `make tpu-aot`). Rows: `results.jsonl`; the table: `table.md`.\n\n'
            'Per chip figures are the compiler\'s (`memory_analysis`, `cost_analysis`); the '
            'roofline is max(flops / peak bf16, bytes / HBM bandwidth) of those figures. '
            'Mosaic kernels report no flops to the cost analysis, so a kernel row\'s flops '
            'are its XLA glue only, and the compiler gives no time estimate for a program '
            'with Mosaic calls (`-`).\n\n' + TABLE_HEAD + '\n'
            + '\n'.join(_row_text(r) for r in rows) + '\n')


def main(argv):
  del argv
  _check_flags()
  os.makedirs(_WORKDIR.value, exist_ok=True)
  path = os.path.join(_WORKDIR.value, 'results.jsonl')
  rows = report.resume_records(path, (lambda r: True) if _RESUME.value else None)
  done = {(r['topology'], r['program'], r['name']) for r in rows}
  command = ' '.join(['python -m experiments.tpu_aot'] + sys.argv[1:])
  with open(path, 'a') as out:
    for topology, programs in _topologies():
      for program, name, thunk in _jobs(topology, programs):
        if (topology, program, name) in done:
          continue
        start = time.perf_counter()
        row = dict(topology=topology, program=program, name=name, command=command)
        try:
          row.update(status='ok', **aot.stats(thunk(), topology))
        except Exception as e:  # noqa: BLE001 (a program the compiler refuses is a result)
          # Out of HBM is the compiler's answer to "does it fit": a result, not a failure.
          kind = 'does not fit' if 'RESOURCE_EXHAUSTED' in str(e) else 'error'
          row.update(status=f'{kind}: {type(e).__name__}: {str(e)[:300]}')
        row['compile_seconds'] = round(time.perf_counter() - start, 1)
        logging.info('%s %s %s: %s (%.0f s)', topology, program, name, row['status'][:120],
                     row['compile_seconds'])
        out.write(json.dumps(row) + '\n')
        out.flush()
        rows.append(row)
        _write_reports(rows, command)
  _write_reports(rows, command)
  logging.info('%d rows in %s', len(rows), _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main)
