r"""What XLA:GPU launches in one decode step, compiled for an H100 or H200 on a machine with none.

`experiments.throughput`'s decode program (the same `models.generate.decode` call,
`experiments.decode_benchmark.decode_call`: greedy, Mosaic GPU tree attention or no attention) is
compiled ahead of time for a GPU described by a target config, with abstract weights and cache
(nothing is allocated). The compiled program's while-loop body is one decode step: its kernel
launches are listed in order, with what each fusion computes, and counted by kind (the Mosaic
GPU kernels, GEMMs, fusions) and by whether XLA's rematerialization pass made them (`.remat`
names: work computed again). No timing: the launch list is what a GPU profile of the step would
show, before running one. GEMMs are not autotuned without a device (cuBLAS is asked for; the
choice of kernel may differ on a GPU).

Needs the JAX CUDA plugin of the installed JAX, and no GPU (pick the CUDA major of the plugin;
the compile reads the target config, not a device):

  pip install "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 CUDA_VISIBLE_DEVICES=-1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
      PYTHONPATH=. python -m experiments.xla_programs --preset=codellama_7b --batch=1024 \
      --prefixes=1024,16384 --remat=both --workdir=workdir/xla_programs

`--remat=on` compiles with XLA's rematerialization pass on (XLA's default), `off` as the
library's cache programs do (`models.kv_cache.CACHE_PROGRAM_OPTIONS`), `both` each.
Writes programs.jsonl, table.md, steps.md (each step's launches) and launches.png.
"""

import dataclasses
import importlib.util
import json
import os
import time

from absl import app, flags, logging

from experiments import cli
from experiments.benchmarking.hlo_launches import step_launches, summarize

os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')  # no GPU, no driver to check

FLAGS = flags.FLAGS
flags.DEFINE_string('preset', 'codellama_7b', 'model preset (models.config.PRESETS)')
flags.DEFINE_integer('batch', 1024, 'rows B sharing the prefix')
flags.DEFINE_list('prefixes', ['1024', '16384'], 'shared prefix lengths P')
flags.DEFINE_integer('new_tokens', 128, 'tokens generated per row (the private capacity)')
flags.DEFINE_integer('layers', 0, 'decoder layers (0: the preset\'s)')
flags.DEFINE_list('modes', ['tree', 'no_attention'], 'tree (Mosaic GPU) and/or no_attention')
flags.DEFINE_enum('target', 'h200', ['h100', 'h200'], 'the GPU the program is compiled for')
flags.DEFINE_enum('remat', 'both', ['on', 'off', 'both'], "XLA's rematerialization pass")
flags.DEFINE_bool('fuse_qkv', True, 'one q/k/v weight per layer (as experiments.throughput runs '
                  'by default); false: wq and wkv apart')
_WORKDIR = cli.workdir_flag('xla_programs')
flags.register_validator('modes', lambda v: bool(v) and set(v) <= {'tree', 'no_attention'},
                         '--modes must list tree and/or no_attention')
flags.register_validator('prefixes', lambda v: bool(v) and all(p.isdigit() and int(p) > 0
                                                                for p in v),
                         '--prefixes must list positive integers (tokens)')
flags.register_validator('batch', lambda v: v > 0, '--batch must be >= 1')
cli.at_least(1, 'new_tokens')
cli.at_least(0, 'layers')

# XLA:GPU target configs (`GpuTargetConfigProto` text): what a deviceless compile reads in place
# of a device. Sizes from the two GPUs' specifications.
_TARGET = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{name}"
"""
TARGETS = {
    'h100': _TARGET.format(name='NVIDIA H100 80GB HBM3', memory=84_929_347_584,
                           bandwidth=3_352_320_000_000),
    'h200': _TARGET.format(name='NVIDIA H200', memory=150_754_820_096,
                           bandwidth=4_800_000_000_000),
}

def _compile(case, config, remat: str, target: str, fuse_qkv: bool):
  """The decode program of `case` (`experiments.decode_benchmark.decode_call`, as `run_case` times
  it), compiled for `target` (jax.stages.Compiled)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.experimental import topologies

  from experiments import decode_benchmark as db
  from models.kv_cache import KVCache
  from models.llama import Llama

  topology = topologies.get_topology_desc(platform='cuda', target_config=TARGETS[target],
                                          topology='1x1x1')
  mesh = topologies.make_mesh(topology, (1,), ('x',))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def make():
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    return model.fuse_qkv() if fuse_qkv else model

  setup = db.decode_setup(case, page_size=64)
  cache = jax.eval_shape(lambda: KVCache.zeros(config, setup.kv_tokens, jnp.bfloat16))
  first = jax.ShapeDtypeStruct((config.vocab_size,), jnp.float32)
  call, state = db.decode_call(nnx.eval_shape(make), case, setup, cache, first,
                               sharding=replicated)
  # The kernels' device check (`hydrajax.devices.hopper_reason`) reads the mesh's device: the
  # target's, not this machine's.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = call.lower(state)
  # '' empties the disabled-pass list that the program's own options set (remat on).
  options = {'xla_disable_hlo_passes': 'rematerialization' if remat == 'off' else ''}
  return lowered.compile(compiler_options=options)


def _check_plugin() -> None:
  if importlib.util.find_spec('jax_plugins') is None or not any(
      importlib.util.find_spec(f'jax_plugins.xla_cuda{v}') for v in (13, 12)):
    raise SystemExit('experiments.xla_programs needs the JAX CUDA plugin of the installed JAX '
                     '(pip install "jax[cuda13]==<jax version>"); no GPU is needed')


def main(argv):
  del argv
  _check_plugin()
  from experiments import decode_benchmark as db
  from models.config import get_config

  config = get_config(FLAGS.preset)
  if FLAGS.layers:
    config = dataclasses.replace(config, num_layers=FLAGS.layers)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  remats = ('on', 'off') if FLAGS.remat == 'both' else (FLAGS.remat,)
  records, steps = [], []
  for prefix in map(int, FLAGS.prefixes):
    for mode in FLAGS.modes:
      case = db.Case(mode, '' if mode == 'no_attention' else 'mosaic_gpu', FLAGS.batch, prefix,
                     FLAGS.new_tokens)
      for remat in remats:
        start = time.perf_counter()
        compiled = _compile(case, config, remat, FLAGS.target, FLAGS.fuse_qkv)
        launches = step_launches(compiled.as_text())
        memory = compiled.memory_analysis()
        record = dict(
            preset=config.name, layers=config.num_layers, target=FLAGS.target, mode=mode,
            batch=FLAGS.batch, prefix=prefix, new_tokens=FLAGS.new_tokens, remat_pass=remat,
            fuse_qkv=FLAGS.fuse_qkv,
            compile_s=round(time.perf_counter() - start, 1),
            program_gib=round((memory.argument_size_in_bytes + memory.output_size_in_bytes
                               + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
                              / 2**30, 2),
            **summarize(launches))
        logging.info('%s P=%d remat %s: %d launches a step, %d rematerialized (%.0f s)', mode,
                     prefix, remat, record['launches'], record['remat_launches'],
                     record['compile_s'])
        records.append(record)
        steps.append((record, launches))
  with open(os.path.join(FLAGS.workdir, 'programs.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  _write_tables(records, steps)
  _plot(records)


def _write_tables(records, steps) -> None:
  cats = ('mosaic', 'gemm', 'fusion', 'collective')
  lines = [
      f'# Kernel launches of one decode step, compiled for an {FLAGS.target.upper()} (no GPU)',
      '', 'command: `python -m experiments.xla_programs ' + ' '.join(
          f'--{k}={v}' for k, v in (('preset', FLAGS.preset), ('batch', FLAGS.batch),
                                    ('prefixes', ','.join(FLAGS.prefixes)),
                                    ('layers', FLAGS.layers), ('target', FLAGS.target),
                                    ('remat', FLAGS.remat), ('fuse_qkv', FLAGS.fuse_qkv))) + '`',
      '',
      '| mode | P | remat pass | launches | ' + ' | '.join(cats)
      + ' | rematerialized | run more than once a step | program GiB |',
      '|---|---|---|---|' + '---|' * len(cats) + '---|---|---|']
  for r in records:
    repeated = ', '.join(f'{k} x{n}' for k, n in sorted(r['repeated'].items(),
                                                         key=lambda kv: -kv[1]))
    lines.append(f"| {r['mode']} | {r['prefix']} | {r['remat_pass']} | {r['launches']} | "
                 + ' | '.join(str(r['by_category'].get(c, 0)) for c in cats)
                 + f" | {r['remat_launches']} | {repeated or '-'} | {r['program_gib']} |")
  with open(os.path.join(FLAGS.workdir, 'table.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  out = []
  for r, launches in steps:
    out += [f"## {r['mode']}, P={r['prefix']}, remat pass {r['remat_pass']}", '',
            '| # | launch | kind | computes |', '|---|---|---|---|']
    out += [f'| {i} | {l.name} | {l.kind} | {l.what} |' for i, l in enumerate(launches)]
    out.append('')
  with open(os.path.join(FLAGS.workdir, 'steps.md'), 'w') as f:
    f.write('\n'.join(out))


def _plot(records) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  cats = ('mosaic', 'gemm', 'fusion', 'collective')
  labels = [f"{r['mode']}\nP={r['prefix']}\nremat {r['remat_pass']}" for r in records]
  fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(records)), 4))
  bottom = [0] * len(records)
  for c in cats:
    values = [r['by_category'].get(c, 0) for r in records]
    ax.bar(labels, values, bottom=bottom, label=c)
    bottom = [b + v for b, v in zip(bottom, values)]
  ax.plot(labels, [r['remat_launches'] for r in records], 'kx', label='rematerialized')
  ax.set_ylabel('kernel launches per decode step')
  ax.set_title(f"{records[0]['preset']}, B={records[0]['batch']}, {FLAGS.target.upper()} "
               '(compiled, not run)')
  ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(os.path.join(FLAGS.workdir, 'launches.png'), dpi=120)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
