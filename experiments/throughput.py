r"""End-to-end decode throughput with a shared prefix (Hydragen figures 3/4).

Random bf16 weights of a Llama shape and a prompt of random token ids, or a checkpoint's own
weights (--checkpoint=FILE.gguf or a HF folder) and a prompt of real text: a P-token document with
planted facts and a question about one of them (hydrajax.evaluation.needle). B sequences share
the P-token prompt and generate M tokens each, greedily (so every row continues it alike; row 0's
tokens are recorded per point, with a checkpoint as text too, and the table says whether each
mode's equal the tree's). Modes: no_sharing, paged (vLLM-like), tree (Hydragen;
xla and mosaic_gpu), no_attention (ceiling); see `experiments.decode_benchmark`.
Writes raw.jsonl (as it goes), throughput.jsonl (with floors, attention
shares, speedups), table.md, max_batch.md and plots to --workdir.

The H200 run in experiments/results/throughput/ (a reduced grid, 127 s; see its README):

  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m experiments.throughput --preset=codellama_7b \
      --batches=1024,32,256 --prefixes=16384,1024 --new_tokens=128 --max_decode_s=1.0 \
      --deadline_s=120 --workdir=workdir/throughput

A CPU smoke run:

  python -m experiments.throughput --preset=tiny_gqa --batches=4,2 --prefixes=128,64 \
      --new_tokens=8 --page_size=16 --workdir=workdir/throughput

Tensor parallel: the same code path with `--mesh=tp:2` (the model's heads, MLP
and vocab split over two devices; see hydrajax/PARALLELISM.md); `--mesh=none` is one device,
`--mesh=tp:1` the mesh path on one device. The TP plan on nvidia-h200-x2 (each run < 5 min;
NVLink multicast stays off):

  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 NCCL_NVLS_ENABLE=0
  run() { PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m experiments.throughput \
      --batches=1024,32,256 --prefixes=16384,1024 --new_tokens=128 \
      --modes=no_attention,tree,paged --impls=mosaic_gpu --max_decode_s=0.5 \
      --profile_kernels=20 --deadline_s=200 "$@"; }
  run --preset=codellama_7b --mesh=tp:1 --workdir=workdir/tp/7b_tp1
  run --preset=codellama_7b --mesh=tp:2 --workdir=workdir/tp/7b_tp2
  run --preset=codellama_13b --mesh=tp:1 --workdir=workdir/tp/13b_tp1
  run --preset=codellama_13b --mesh=tp:2 --workdir=workdir/tp/13b_tp2
  run --preset=codellama_13b --mesh=tp:2 --tp_reduce_dtype=bfloat16 --batches=1024,32 \
      --workdir=workdir/tp/13b_tp2_bf16reduce
  run --preset=codellama_7b --mesh=none --batches=1024,32 --modes=no_attention,tree \
      --workdir=workdir/tp/7b_unsharded   # against 7b_tp1: the one-device mesh path's cost
  run --preset=codellama_34b --mesh=tp:2 --batches=256,32 --workdir=workdir/tp/34b_tp2

TP scaling efficiency = TP=2 tok/s / (2 x TP=1 tok/s) at the same (mode, B, P); the
collectives' share of a step: the all-reduce kernels in each point's `top_kernels`.

Rebuild the tables and plots from a run's raw records:

  python -m experiments.throughput --rebuild=experiments/results/throughput/raw.jsonl \
      --workdir=workdir/throughput

A few lines a point, with the costliest kernels of its profiled step (what a device script prints
after each grid):

  python -m experiments.throughput --summary=experiments/results/throughput/throughput.jsonl

A grid cut by --deadline_s (or a device's time limit) goes on with the same flags and --resume:
the points in --workdir/raw.jsonl that ran are kept, the rest run.
"""

import json
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import cli
from hydrajax import AttentionImpl
from experiments.benchmarking import (
    Ceilings, JsonlWriter, markdown_table, measure_ceilings, plot_bars, plot_sweeps, progress,
    read_jsonl, resume_records, write_workdir_readme,
)
from hydrajax.attention.parallel import initialize_distributed, parse_mesh
from experiments import decode_benchmark as db
from models import sharding_rules as sr
from models.checkpoint import checkpoint_config, load_checkpoint
from models.config import PRESETS, get_config
from models.llama import init_model

FLAGS = flags.FLAGS
flags.DEFINE_string('preset', 'codellama_7b', 'model shape (models.config.PRESETS)')
flags.DEFINE_string('checkpoint', '', 'a .gguf file or a HF Llama folder: its trained weights '
                    'and shape instead of --preset\'s random ones')
flags.DEFINE_integer('num_layers', 0, 'override the preset layer count (0: keep)')
flags.DEFINE_list('batches', ['1024', '32', '256'], 'batch sizes B (run in this order)')
flags.DEFINE_list('prefixes', ['16384', '1024'], 'shared prefix lengths P (run in this order)')
flags.DEFINE_integer('new_tokens', 128, 'tokens generated per sequence M')
flags.DEFINE_list('modes', ['no_attention', 'tree', 'paged', 'no_sharing'], 'modes, in run order')
flags.DEFINE_list('impls', ['xla', 'mosaic_gpu'], 'implementations of the attention modes')
flags.DEFINE_integer('page_size', 64, 'page size of the paged and no_sharing caches')
flags.DEFINE_integer('prefill_chunk', 2048, 'prefill tokens per model call')
flags.DEFINE_float('max_decode_s', 1.5, 'time at most about this long per point (fewer steps)')
flags.DEFINE_float('deadline_s', 0.0, 'start no new point after this many seconds (0: none)')
flags.DEFINE_float('memory_limit_gb', 0.0, 'device memory (0: the device says; 8 on CPU)')
_WORKDIR = cli.workdir_flag('throughput')
flags.DEFINE_integer('profile_kernels', 0, 'record the N costliest kernels of one step (GPU)')
flags.DEFINE_string('rebuild', '', 'rebuild the outputs from this raw.jsonl without running')
flags.DEFINE_string('summary', '', 'print a line a point and its costliest kernels from this '
                    'throughput.jsonl (a device script\'s log), then stop')
flags.DEFINE_integer('summary_kernels', 6, 'kernels a point with --summary')
flags.DEFINE_bool('resume', False, 'keep the points of --workdir/raw.jsonl that ran (same preset, '
                  'mesh, new tokens, page size) and run the rest; a kept point may come from '
                  'another machine start, so compare within one run where it matters')
flags.DEFINE_string('mesh', '', "device mesh, e.g. 'tp:2' (tensor parallel; '' or 'none': one "
                    'device); dp is not used by this benchmark')
flags.DEFINE_enum('tp_reduce_dtype', 'float32', ['float32', 'bfloat16'],
                  'dtype of the all-reduces after wo and w_down with tp > 1 (float32: tokens '
                  'equal one device\'s; bfloat16: half the bytes)')
flags.DEFINE_integer('tp_micro_batches', 1, 'with tp > 1: the rows of the output projection and the '
                     'MLP in this many blocks whose all-reduces follow each other, so one can run '
                     'beside the next block\'s matmuls (models.llama.Llama)')
flags.DEFINE_bool('fuse_qkv', True, 'one q/k/v weight per layer (models.llama.Llama.fuse_qkv) '
                  'where tp divides the kv heads, as a loaded checkpoint has by default: no '
                  'per-step concatenation of wq and wkv; false: apart (as older records ran)')
flags.DEFINE_list('mosaic_gpu_knobs', [], 'MosaicGpuConfig fields for the model\'s Mosaic GPU '
                  'attention, e.g. private_lane_table=true,max_splits=4 (default: its defaults)')
flags.DEFINE_string('compiler_options', '', 'XLA compile options of the decode programs over the '
                    "library's, as JSON, e.g. '{\"xla_disable_hlo_passes\": \"\"}' (XLA's "
                    'rematerialization pass on again: models.kv_cache.CACHE_PROGRAM_OPTIONS)')
flags.DEFINE_string('distributed', '', "multi-host start-up: 'auto' (TPU pod slice, SLURM) or "
                    "'HOST:PORT,NUM_PROCESSES,PROCESS_ID' (see hydrajax/PARALLELISM.md)")
cli.int_list('batches')
cli.int_list('prefixes')
cli.choices('modes', db.MODES)
cli.choices('impls', [i.value for i in AttentionImpl])
cli.at_least(1, 'new_tokens', 'page_size', 'prefill_chunk', 'summary_kernels', 'tp_micro_batches')
cli.at_least(0, 'num_layers', 'deadline_s', 'memory_limit_gb', 'profile_kernels')
cli.at_least(0.001, 'max_decode_s')


def _prefixes_fit(f: dict) -> str | None:
  """What is wrong with --preset (or --checkpoint) or the longest --prefixes (past the model's
  maximum position)."""
  if f['rebuild'] or f['summary']:
    return None
  try:
    config = checkpoint_config(f['checkpoint']) if f['checkpoint'] else get_config(f['preset'])
    config.check_prompt_length(max(int(p) for p in f['prefixes']), '--prefixes')
  except ValueError as e:
    return str(e)
  return None


cli.check_flags(['preset', 'checkpoint', 'prefixes', 'rebuild', 'summary'], _prefixes_fit)


def _mosaic_gpu_config():
  if not FLAGS.mosaic_gpu_knobs:
    return None
  from pallas_kernels.mosaic_gpu.tree_attention import MosaicGpuConfig
  return MosaicGpuConfig.from_knobs(FLAGS.mosaic_gpu_knobs)


def _memory_limit() -> int:
  if FLAGS.memory_limit_gb:
    return int(FLAGS.memory_limit_gb * 2**30)
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get('bytes_limit', 8 * 2**30))


def _cases():
  """Every point, in run order: batch, prefix, mode, implementation (as the flags list them)."""
  for batch in (int(b) for b in FLAGS.batches):
    for prefix in (int(p) for p in FLAGS.prefixes):
      for mode in FLAGS.modes:
        for impl in [''] if mode == 'no_attention' else FLAGS.impls:
          yield db.Case(mode, impl, batch, prefix, FLAGS.new_tokens)


def _compiler_options() -> dict | None:
  if not FLAGS.compiler_options:
    return None
  try:
    options = json.loads(FLAGS.compiler_options)
  except json.JSONDecodeError as e:
    raise ValueError(f'--compiler_options must be a JSON object, got {FLAGS.compiler_options!r}: '
                     f'{e}') from e
  if not isinstance(options, dict):
    raise ValueError(f'--compiler_options must be a JSON object, got {FLAGS.compiler_options!r}')
  return options


def _recorded_config(records, flag_config):
  """The model shape a raw.jsonl was measured with: its records' preset and layer count (the
  floors depend on them), whatever --preset says. Records without them keep flag_config. A
  mismatch is the command line's mistake (absl prints it without a traceback)."""
  presets = {r['preset'] for r in records if 'preset' in r}
  layers = {r['num_layers'] for r in records if 'num_layers' in r}
  if len(presets) > 1 or len(layers) > 1:
    raise app.UsageError(f'--rebuild={FLAGS.rebuild}: records of several models (presets '
                         f'{sorted(presets)}, layer counts {sorted(layers)}); rebuild one at a time')
  if not presets:
    return flag_config
  if any(r.get('checkpoint') for r in records) or next(iter(presets)) not in PRESETS:
    # A checkpoint's shape is in its file, not in a preset: the records name its model.
    if not FLAGS.checkpoint or flag_config.name not in presets:
      raise app.UsageError(f'--rebuild={FLAGS.rebuild} was measured with the checkpoint '
                           f'model {presets.pop()!r}: pass that checkpoint as --checkpoint')
    return flag_config
  if FLAGS['preset'].present and FLAGS.preset not in presets:
    raise app.UsageError(f'--preset={FLAGS.preset}, but --rebuild={FLAGS.rebuild} was measured '
                         f'with {presets.pop()}; leave --preset out when rebuilding')
  overrides = {'num_layers': layers.pop()} if layers else {}
  return get_config(presets.pop(), **overrides)


def main(argv):
  del argv
  if FLAGS.summary:
    print('\n'.join(db.summary_lines(read_jsonl(FLAGS.summary), FLAGS.summary_kernels)))
    return
  started = time.perf_counter()
  os.makedirs(FLAGS.workdir, exist_ok=True)
  overrides = {'num_layers': FLAGS.num_layers} if FLAGS.num_layers else {}
  config = (checkpoint_config(FLAGS.checkpoint) if FLAGS.checkpoint else
            get_config(FLAGS.preset, **overrides))
  initialize_distributed(FLAGS.distributed)
  mesh = parse_mesh(FLAGS.mesh)  # errors before any work: unknown axes, too many devices
  if mesh is not None and mesh.shape.get('dp', 1) > 1:
    raise ValueError(f'--mesh={FLAGS.mesh}: this benchmark is tensor parallel (one sharing '
                     'group); use tp only')
  sr.check_mesh(config, mesh)
  compiler_options = _compiler_options()  # errors before any work too
  if FLAGS.rebuild:
    records = read_jsonl(FLAGS.rebuild)
    config = _recorded_config(records, config)
    meta, ceil = records[0]['meta'], records[0]['ceilings']
    ceilings = Ceilings(ceil['copy_bandwidth'], ceil['matmul_rate'])
    prefill = {r['prefix']: r['prefill_s'] for r in records if 'prefill_s' in r}
    return _finish(records, config, ceilings, prefill, meta, records[0].get('run_s', 0.0))
  if jax.default_backend() == 'gpu':
    ceilings = measure_ceilings(repeats=3)
  else:
    ceilings = measure_ceilings(copy_bytes=2**22, matmul_size=256, repeats=1)
  logging.info('ceilings: %.0f GB/s copy, %.1f TFLOP/s bf16 matmul',
               ceilings.copy_bandwidth / 1e9, ceilings.matmul_rate / 1e12)
  start = time.perf_counter()
  if FLAGS.checkpoint:  # trained weights, each tensor read straight into its shards
    model, tokenizer = load_checkpoint(FLAGS.checkpoint, dtype=jnp.bfloat16, mesh=mesh,
                                       fuse_qkv=False)
    model.tp_reduce_dtype = jnp.dtype(FLAGS.tp_reduce_dtype)
    model.tp_micro_batches = FLAGS.tp_micro_batches
    model.attention_config = _mosaic_gpu_config()
  else:
    tokenizer = None
    model = init_model(config, mesh=mesh, seed=0, dtype=jnp.bfloat16,  # made in its shards
                       tp_reduce_dtype=FLAGS.tp_reduce_dtype,
                       tp_micro_batches=FLAGS.tp_micro_batches,
                       attention_config=_mosaic_gpu_config())
  if FLAGS.fuse_qkv:
    model.fuse_qkv(required=False)
  jax.block_until_ready(nnx.state(model))
  logging.info('model %s on mesh %s: initialised in %.1f s', config.name, FLAGS.mesh or 'none',
               time.perf_counter() - start)
  path = os.path.join(FLAGS.workdir, 'raw.jsonl')
  records = resume_records(path, _kept(config, model.qkv_fused) if FLAGS.resume else None)
  writer = JsonlWriter(path)
  done = {(r['name'], r['batch'], r['prefix']) for r in records}
  cases = [c for c in _cases() if (c.name, c.batch, c.prefix) not in done]
  if done:
    logging.info('resuming: %d points kept, %d to run', len(done), len(cases))
  memory_limit = _memory_limit()
  prefixes, prefill = {}, {r['prefix']: r['prefill_s'] for r in records}
  for prefix in sorted({c.prefix for c in cases}, key=[int(p) for p in FLAGS.prefixes].index):
    k, v, first, seconds = db.prefill_prefix(model, _prompt(tokenizer, config, prefix),
                                             chunk=FLAGS.prefill_chunk)
    prefixes[prefix], prefill[prefix] = (k, v, first), seconds
    logging.info('prefill P=%d: %.3f s (%.0f tokens/s)', prefix, seconds, prefix / seconds)
  ceil = dict(copy_bandwidth=ceilings.copy_bandwidth, matmul_rate=ceilings.matmul_rate)
  for case in progress(cases, total=len(cases), desc='throughput'):
    base = dict(name=case.name, mode=case.mode, impl=case.impl or 'none', batch=case.batch,
                prefix=case.prefix, new_tokens=case.new_tokens)
    if FLAGS.deadline_s and time.perf_counter() - started > FLAGS.deadline_s:
      r = dict(base, status='skipped_deadline', reason=f'past --deadline_s={FLAGS.deadline_s}')
    else:
      k, v, first = prefixes[case.prefix]
      try:
        r = db.run_case(model, case, (k, v), first, page_size=FLAGS.page_size,
                        memory_limit=memory_limit, max_decode_s=FLAGS.max_decode_s,
                        profile_kernels=FLAGS.profile_kernels,
                        compiler_options=compiler_options)
      except Exception as e:  # a failing point is recorded; the sweep goes on
        logging.exception('%s failed', case)
        r = dict(base, status='error', reason=f'{type(e).__name__}: {e}'[:2000])
      if tokenizer is not None and 'row0_tokens' in r:
        r['row0_text'] = tokenizer.decode(r['row0_tokens'])
    seconds = prefill[case.prefix]
    r.update(prefill_s=seconds, prefill_tokens_per_s=case.prefix / seconds,
             ceilings=ceil, preset=config.name, num_layers=config.num_layers,
             run_s=time.perf_counter() - started,
             mesh=FLAGS.mesh or 'none', tp_reduce_dtype=FLAGS.tp_reduce_dtype,
             tp_micro_batches=FLAGS.tp_micro_batches, mosaic_gpu_knobs=FLAGS.mosaic_gpu_knobs,
             fuse_qkv=model.qkv_fused, page_size=FLAGS.page_size, checkpoint=FLAGS.checkpoint,
             compiler_options=FLAGS.compiler_options)
    records.append(r)
    writer.append(r)
    logging.info('%s B=%d P=%d: %s %s', case.name, case.batch, case.prefix, r.get('status'),
                 f"{r['tokens_per_s']:.0f} tok/s" if 'tokens_per_s' in r else r.get('reason', ''))
  _finish(records, config, ceilings, prefill, writer.meta, time.perf_counter() - started)


def _prompt(tokenizer, config, length: int) -> list[int]:
  """The shared prompt of `length` tokens: real text with a checkpoint's tokenizer, else random
  ids (random weights read any ids alike)."""
  if tokenizer is None:
    return db.random_prompt(config.vocab_size, length).tolist()
  return db.text_prompt(tokenizer, length)


def _kept(config, fused: bool):
  """Which records of an earlier run a resumed one keeps: points of this preset, mesh, --new_tokens,
  --page_size, --tp_reduce_dtype, --tp_micro_batches, --mosaic_gpu_knobs, q/k/v weights (fused or
  not, as this run's model) and --compiler_options that ran, did not fit or are not supported."""
  def keep(r) -> bool:
    return ((r.get('preset'), r.get('mesh'), r.get('new_tokens'), r.get('page_size'),
             r.get('tp_reduce_dtype'), r.get('tp_micro_batches', 1), r.get('mosaic_gpu_knobs', []),
             r.get('fuse_qkv', False), r.get('compiler_options', ''))
            == (config.name, FLAGS.mesh or 'none', FLAGS.new_tokens, FLAGS.page_size,
                FLAGS.tp_reduce_dtype, FLAGS.tp_micro_batches, FLAGS.mosaic_gpu_knobs,
                fused, FLAGS.compiler_options)
            and r.get('status') in ('ok', 'does_not_fit', 'unsupported'))
  return keep


def _finish(records, config, ceilings, prefill, meta, total_s):
  db.add_derived(records, config, ceilings)
  final = JsonlWriter(os.path.join(FLAGS.workdir, 'throughput.jsonl'), meta=meta)
  with open(final.path, 'w'):
    pass
  for r in records:
    final.append({k: v for k, v in r.items() if k not in ('meta', 'timestamp')})
  text = _write_tables(records, config, ceilings, prefill, meta, total_s)
  ok = [r for r in records if r.get('status') == 'ok']
  for x, fixed, name in (('batch', ('prefix',), 'throughput_vs_batch.png'),
                         ('prefix', ('batch',), 'throughput_vs_prefix.png')):
    plot_sweeps(ok, x=x, y='tokens_per_s', series='name', fixed=fixed,
                path=os.path.join(FLAGS.workdir, name),
                title=f'{config.name} decode throughput', ylabel='decode tokens/s')
  points = sorted({(r['batch'], r['prefix']) for r in ok})
  names = sorted({r['name'] for r in ok})
  if points:  # every point's modes side by side (a grid of one B and one P has no sweep to draw)
    tok = {(r['name'], r['batch'], r['prefix']): r['tokens_per_s'] for r in ok}
    plot_bars([f'B={b} P={p}' for b, p in points],
              {name: [tok.get((name, b, p)) for b, p in points] for name in names},
              path=os.path.join(FLAGS.workdir, 'throughput_by_mode.png'), ylabel='decode tokens/s',
              title=f'{config.name} decode throughput by mode')
  write_workdir_readme(FLAGS.workdir, f'Decode throughput: {config.name}', text, meta)


def _ms(key):
  return lambda r: None if r.get(key) is None else 1e3 * r[key]


def _gb(key):
  return lambda r: None if r.get(key) is None else r[key] / 2**30


def _write_tables(records, config, ceilings, prefill, meta, total_s):
  columns = [
      ('mode', 'name'), ('B', 'batch'), ('P', 'prefix'), ('status', 'status'),
      ('decode tok/s', 'tokens_per_s'), ('step ms', _ms('step_s')),
      ('of no-attn', 'fraction_of_ceiling'), ('attn ms', _ms('attention_s')),
      ('attn floor ms', _ms('attention_floor_s')), ('attn/floor', 'attention_over_floor'),
      ('attn kernels ms', _ms('attention_kernel_s')),
      ('attn kernels/floor', 'attention_kernel_over_floor'),
      ('matched ms', _ms('attention_kernel_matched_s')),
      ('matched/floor', 'attention_kernel_matched_over_floor'),
      ('impl kernels ms', _ms('impl_kernels_s')), ('impl kernels/floor', 'impl_kernels_over_floor'),
      ('x paged xla', 'speedup_vs_paged_xla'), ('x paged mosaic', 'speedup_vs_paged_mosaic_gpu'),
      ('x no-sharing xla', 'speedup_vs_no_sharing_xla'),
      ('predicted tok/s', 'predicted_tokens_per_s'), ('matmul eff', 'matmul_efficiency'),
      ('program GiB', _gb('program_bytes')), ('cache GiB', _gb('cache_bytes')),
      ('steps timed', 'steps_timed'), ('compile s', 'compile_s'), ('ran as', 'resolved_impl'),
      ('SM MHz min', 'sm_mhz_min'), ('SM MHz median', 'sm_mhz_median'),
      ('power cap', 'power_cap_fraction'),
  ]
  rows = sorted(records, key=lambda r: (r['prefix'], r['batch'], r['name']))
  head = [
      f'# Decode throughput: {config.name}, '
      f'{"its own bf16 weights, a real-text prompt" if FLAGS.checkpoint else "random bf16 weights"}'
      '\n',
      f'device: {meta.get("device")}, jax {meta.get("jax_version")}, '
      f'command: `{meta.get("command")}`\n',
      f'ceilings measured in this run: copy {ceilings.copy_bandwidth / 1e9:.0f} GB/s, '
      f'bf16 matmul {ceilings.matmul_rate / 1e12:.0f} TFLOP/s; total run {total_s:.0f} s\n',
      'prefill (shared prefix once, separate from decode): '
      + ', '.join(f'P={p}: {s:.3f} s ({p / s:.0f} tok/s)' for p, s in prefill.items()) + '\n',
      'attn = step time minus the no-attention step time (same B, P); attn floor = '
      'layers x max(bytes / copy rate, FLOPs / matmul rate) of this mode\'s attention '
      '(tree: prefix read once), for one device\'s share on a mesh (heads / tp, rows / dp); '
      'matmul eff likewise; predicted tok/s = B / (no-attention step + tree attention floor); '
      'attn kernels = the same difference in device time (CUPTI, every kernel of one step each; '
      'with --profile_kernels); matched = the same without the kernels both steps launch alike '
      '(same name and launches: the projections\' GEMMs, whose run-to-run drift was -1.1 to '
      '+0.9 ms a step at B=1024); impl kernels = the attention implementation\'s own kernels in that '
      'step (Mosaic GPU); all three over the floor at the profiled step\'s private tokens (one '
      'step after the timed ones). SM MHz and power cap: the SM clock and the fraction of NVML '
      'samples with the software power cap set while the timed steps ran (NVIDIA GPUs; the '
      'ceilings are measured in short bursts, at the full clock).\n',
  ]
  reasons = [f'- {r["name"]} B={r["batch"]} P={r["prefix"]}: {r["status"]}: {r.get("reason", "")}'
             for r in rows if r.get('status') not in ('ok',)]
  text = '\n'.join(head) + '\n' + markdown_table(rows, columns)
  if reasons:
    text += '\nNot measured:\n\n' + '\n'.join(reasons) + '\n'
  text += _generated_text(rows)
  with open(os.path.join(FLAGS.workdir, 'table.md'), 'w') as f:
    f.write(text)
  estimates = db.max_batch_estimates(records, config)
  with open(os.path.join(FLAGS.workdir, 'max_batch.md'), 'w') as f:
    f.write('# Largest batch that fits (estimated from the compiled decode programs)\n\n')
    f.write(markdown_table(estimates, [('mode', 'name'), ('P', 'prefix'),
                                       ('measured at B', 'from_batch'),
                                       ('MiB per row', lambda r: r['bytes_per_row'] / 2**20),
                                       ('max batch', 'max_batch')]))
  print(text)
  return text


def _generated_text(rows) -> str:
  """Per (B, P): whether each mode's row-0 tokens equal the tree's (same impl, else any tree), and
  the text where a tokenizer gave one. Rows time different step counts: the common length
  is compared."""
  lines = []
  for (b, p) in sorted({(r['batch'], r['prefix']) for r in rows if 'row0_tokens' in r}):
    point = {r['name']: r for r in rows if (r['batch'], r['prefix']) == (b, p)
             and 'row0_tokens' in r}
    trees = [r for name, r in point.items() if name.startswith('tree')]
    if not trees:
      continue
    lines.append(f'\n- B={b}, P={p}:')
    for name, r in sorted(point.items()):
      if r['mode'] == 'no_attention':  # no attention product: not the model's text
        continue
      ref = point.get(f'tree_{r["impl"]}', trees[0])
      n = min(len(r['row0_tokens']), len(ref['row0_tokens']))
      same = r['row0_tokens'][:n] == ref['row0_tokens'][:n]
      shown = repr(r['row0_text']) if 'row0_text' in r else f'{n} tokens'
      lines.append(f'  - {name}: {"equal to" if same else "differs from"} {ref["name"]} over '
                   f'{n} tokens; {shown}')
  if not lines:
    return ''
  return ('\nRow 0\'s greedy tokens (every row continues the same prompt):\n'
          + '\n'.join(lines) + '\n')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
