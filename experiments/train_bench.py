r"""Training benchmark: forward + backward of shared-prompt attention and of a GRPO step.

Per point (G completions of T tokens sharing one P-token prompt):

* attention: forward + backward (the VJP of all outputs into q, k, v, from random cotangents
  passed in; before session 37 a `ones_like` inside the timed function) of
  `hydrajax.attention.training.prefill_attention` (`shared_xla`: the prompt causal once,
  completions over it through tree attention with its custom VJP) against
  per-sequence causal attention over every sample's own P + T tokens,
  `jax.nn.dot_product_attention` with implementation 'cudnn' (`per_seq_cudnn`,
  GPU only) and 'xla' (`per_seq_xla`, skipped where its score matrix passes
  --max_scores_gb). `shared_mosaic_gpu`: `shared_xla` with all of its attention (the
  shared prompts, each completion's and each prompt's causal self-attention), forward
  and backward, in the Hopper kernels of `pallas_kernels/mosaic_gpu/training_attention.py`
  (`impl=AttentionImpl.MOSAIC_GPU`; Hopper and bf16 / f16 only, recorded 'unsupported' elsewhere,
  e.g. in the CPU smoke).
  Outputs are checked against the first per-sequence baseline that ran before
  timing. floor_s: the roofline of the shared computation (`experiments.benchmarking.training_costs`,
  measured ceilings).
* step: value and gradient of the GRPO loss of a Llama (`--step_preset` with
  `--step_layers` layers) over the same shapes, with `shared_forward` (its attention on
  XLA or, `shared_mosaic_gpu`, the Hopper kernels) against `per_sequence_forward`
  (cuDNN / XLA attention). floor_s: dense matmul FLOPs
  + attention FLOPs over the measured matmul rate.

CPU smoke (the default, seconds to minutes on a laptop):

  PYTHONPATH=. python -m experiments.train_bench --workdir=workdir/train_bench

The H200 command (one GPU, sized to finish in under 5 minutes):

  PYTHONPATH=. python -m experiments.train_bench --nosmoke \
      --workdir=experiments/results/train_bench

With the Mosaic GPU kernels next to cuDNN at the issue's point (attention, and the
GRPO step at the default --step_points):

  PYTHONPATH=. python -m experiments.train_bench --nosmoke --points=64:8192:1024 \
      --impls=per_seq_cudnn,shared_xla,shared_mosaic_gpu \
      --workdir=experiments/results/train_bench_mgpu_causal

(--nosmoke: --points=8:1024:256,16:4096:512,64:8192:1024 at 32/8 heads, d=128, bf16;
--step_points=32:8192:1024 with llama3_8b at 2 layers and a 32K vocabulary. The whole
issue grid, G in {8, 16, 64} x prompt {1K, 4K, 8K} x completion {256, 1K, 2K}, against cuDNN
takes about 8 minutes: experiments/results/train_bench_grid_s35/call2.sh.) --training_kernel_knobs=block_kv_dq=128,... times the attention points of
`shared_mosaic_gpu` under other kernel block sizes (`TrainingKernelConfig`).
Writes, into --workdir: results.jsonl (one record per implementation and point,
plus the ceilings), table.md, time.png.
"""

import functools
import gc
import os
import time
import traceback

# The per-sequence step baseline needs most of the H200's memory (JAX takes 75% by default).
os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.92')

from absl import app, flags, logging  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments import cli
from hydrajax.shapes import AttentionShapes
from experiments.benchmarking import report, roofline, timing
from hydrajax.attention.dispatch import AttentionImpl
from experiments.benchmarking import training_costs as costs
from hydrajax.attention.dispatch import training_unsupported_reason
from hydrajax.attention.training import prefill_layout as pl
from pallas_kernels.knobs import config_from_knobs
from models.config import get_config
from models.llama import Llama
from models.training import grpo
from models.training.forward import per_sequence_forward, shared_forward

_SMOKE = flags.DEFINE_bool('smoke', True, 'tiny float32 CPU settings; --nosmoke: the H200 grid')
_POINTS = flags.DEFINE_list('points', None, 'attention points G:P:T (default by --smoke)')
_STEP_POINTS = flags.DEFINE_list('step_points', None, 'training-step points G:P:T')
_HEADS = flags.DEFINE_string('heads', None, 'query heads : kv heads (default 32:8; smoke 4:2)')
_HEAD_DIM = flags.DEFINE_integer('head_dim', None, 'head dim (default 128; smoke 16)')
_STEP_PRESET = flags.DEFINE_string('step_preset', None,
                                   'model of the step (llama3_8b; smoke tiny_gqa)')
_STEP_LAYERS = flags.DEFINE_integer('step_layers', 2, 'layers of the step model (reduced to fit)')
_STEP_VOCAB = flags.DEFINE_integer(
    'step_vocab', None, 'vocabulary of the step model (smoke: the preset\'s; H200: 32000)')
_IMPLS = flags.DEFINE_list(
    'impls', ['shared_xla', 'shared_mosaic_gpu', 'per_seq_cudnn', 'per_seq_xla'], 'variants')
_KV_BLOCK = flags.DEFINE_integer('kv_block', 1024, 'kv tokens per score block of shared_xla')
_KERNEL_KNOBS = flags.DEFINE_list(
    'training_kernel_knobs', [], "TrainingKernelConfig fields of shared_mosaic_gpu's attention "
    "points, name=value (e.g. block_kv_dq=128); the step points use the default")
_MAX_SCORES_GB = flags.DEFINE_float('max_scores_gb', 24.0,
                                    'skip per_seq_xla above this f32 score size, GB')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'timed repeats (median reported)')
_TARGET_MS = flags.DEFINE_float('target_ms', 50.0, 'length of one timed loop, ms')
_SEED = flags.DEFINE_integer('seed', 0, 'input seed')
_WORKDIR = cli.workdir_flag('train_bench')
cli.at_least(1, 'step_layers', 'kv_block', 'repeats')
cli.at_least(0.001, 'max_scores_gb', 'target_ms')

SMOKE = dict(points=['2:32:16', '4:64:32'], step_points=['4:32:16'], heads='4:2', head_dim=16,
             step_preset='tiny_gqa', step_vocab=None, dtype=jnp.float32)
H200 = dict(points=['8:1024:256', '16:4096:512', '64:8192:1024'],
            step_points=['32:8192:1024'], heads='32:8', head_dim=128, step_preset='llama3_8b',
            step_vocab=32_000, dtype=jnp.bfloat16)


def _settings():
  base = SMOKE if _SMOKE.value else H200
  pick = lambda flag, key: base[key] if flag.value is None else flag.value
  parse = lambda pts: [tuple(int(x) for x in p.split(':')) for p in pts]
  n, k = (int(x) for x in pick(_HEADS, 'heads').split(':'))
  return dict(points=parse(pick(_POINTS, 'points')),
              step_points=parse(pick(_STEP_POINTS, 'step_points')),
              heads=(n, k), head_dim=pick(_HEAD_DIM, 'head_dim'),
              step_preset=pick(_STEP_PRESET, 'step_preset'),
              step_vocab=pick(_STEP_VOCAB, 'step_vocab'), dtype=base['dtype'])


def _per_seq_attention(impl):
  name = impl.removeprefix('per_seq_')
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=name)


def _unsupported(impl, shapes: AttentionShapes):
  """Why a variant cannot run here, or None; shapes: the completions' attention."""
  if impl == 'per_seq_cudnn' and jax.default_backend() != 'gpu':
    return 'cuDNN needs a GPU'
  if impl == 'shared_mosaic_gpu':  # the reason the training attention's resolver would give
    return training_unsupported_reason(AttentionImpl.MOSAIC_GPU, shapes)
  return None


def _impl(name):
  """impl argument of prefill_attention for a shared_* variant."""
  return AttentionImpl.MOSAIC_GPU if name == 'shared_mosaic_gpu' else AttentionImpl.XLA


def _kernel_config():
  """--training_kernel_knobs as a TrainingKernelConfig (None: the kernels' default)."""
  if not _KERNEL_KNOBS.value:
    return None
  from pallas_kernels.mosaic_gpu.training_attention import TrainingKernelConfig  # GPU Pallas
  return config_from_knobs(TrainingKernelConfig, _KERNEL_KNOBS.value)


def _time(fn, *args):
  t = timing.device_time(fn, *args, repeats=_REPEATS.value, target_s=_TARGET_MS.value / 1e3,
                         min_iters=1)
  return t.median_s


def attention_point(g, p, t, heads, head_dim, dtype, ceilings, seed):
  """Records of every implementation at one point."""
  n, kh = heads
  layout = pl.plan_prefill([p], g, t).to_device()
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  draw = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)
  shared_args = (draw(1, p, n, head_dim), draw(g, t, n, head_dim), draw(1, p, kh, head_dim),
                 draw(g, t, kh, head_dim), draw(1, p, kh, head_dim), draw(g, t, kh, head_dim))
  lengths = layout.prompt_lengths
  seq = lambda a, b: pl.unshared_sequences(a, b, lengths, g)
  q_p, q_c, k_p, k_c, v_p, v_c = shared_args
  seq_args = (seq(q_p, q_c), seq(k_p, k_c), seq(v_p, v_c))  # [G, P + T, ...]

  kernel_config = _kernel_config()

  def shared(*a, impl=AttentionImpl.XLA):
    q_p, q_c, k_p, k_c, v_p, v_c = a
    kb, vb = pl.write_kv(layout, k_p, k_c), pl.write_kv(layout, v_p, v_c)
    config = kernel_config if impl is AttentionImpl.MOSAIC_GPU else None
    prompt, completion = pl.prefill_attention(q_p, q_c, kb, vb, layout, kv_block=_KV_BLOCK.value,
                                              impl=impl, kernel_config=config)
    return prompt.out, completion.out

  cost = dict(shared=costs.training_attention_cost(1, g, p, t, n, kh, head_dim, shared=True,
                                                   dtype_bytes=jnp.dtype(dtype).itemsize),
              per_seq=costs.training_attention_cost(1, g, p, t, n, kh, head_dim, shared=False,
                                                    dtype_bytes=jnp.dtype(dtype).itemsize))
  records, reference = [], None
  shapes = AttentionShapes(g, t, n, kh, head_dim, layout.kv_tokens, dtype)
  order = sorted(_IMPLS.value, key=lambda i: i.startswith('shared'))  # baselines first: the check
  for impl in order:
    rec = dict(kind='attention', impl=impl, G=g, P=p, T=t, N=n, K=kh, H=head_dim,
               dtype=jnp.dtype(dtype).name)
    if impl == 'shared_mosaic_gpu' and _KERNEL_KNOBS.value:
      rec['training_kernel_knobs'] = _KERNEL_KNOBS.value
    kind = 'shared' if impl.startswith('shared') else 'per_seq'
    rec['floor_s'] = cost[kind].floor_s(ceilings)
    rec['flops'] = cost[kind].flops
    reason = _unsupported(impl, shapes)
    scores_gb = g * n * (p + t) ** 2 * 4 / 1e9
    if impl == 'per_seq_xla' and scores_gb > _MAX_SCORES_GB.value:
      reason = f'score matrix of {scores_gb:.0f} GB > --max_scores_gb'
    if reason:
      records.append(dict(rec, status='unsupported', reason=reason))
      continue
    try:
      if kind == 'shared':
        fn, args = timing.vjp_program(functools.partial(shared, impl=_impl(impl)), shared_args,
                                       seed)
        prompt_out, completion_out = jax.jit(functools.partial(shared, impl=_impl(impl)))(
            *shared_args)
        out = jnp.concatenate([prompt_out[0], completion_out.reshape(-1, n, head_dim)])
      else:
        fn, args = timing.vjp_program(_per_seq_attention(impl), seq_args, seed)
        full = jax.jit(_per_seq_attention(impl))(*seq_args)  # [G, P + T, N, H]
        out = jnp.concatenate([full[0, :p], full[:, p:].reshape(-1, n, head_dim)])
      if reference is None:
        reference = np.asarray(out, np.float32)
      else:
        diff = np.abs(np.asarray(out, np.float32) - reference).max()
        rec['rel_err'] = float(diff / max(np.abs(reference).max(), 1e-30))
      del out
      rec['time_s'] = _time(fn, *args)
      rec['time_over_floor'] = rec['time_s'] / rec['floor_s']
      rec['status'] = 'ok'
    except Exception as e:  # one failing variant must not end the sweep
      logging.error('%s at G=%d P=%d T=%d: %s', impl, g, p, t, traceback.format_exc(limit=3))
      rec.update(status='error', reason=f'{type(e).__name__}: {str(e)[:300]}')
    records.append(rec)
    gc.collect()
  return records


def step_point(g, p, t, preset, layers, vocab, dtype, ceilings, seed):
  """Value and gradient of the GRPO loss: shared forward against the per-sequence model."""
  config = get_config(preset, num_layers=layers)
  if vocab:  # the logits of the completions are the same work in both forms
    config = get_config(preset, num_layers=layers, vocab_size=vocab)
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(seed), dtype=dtype))
  layout = pl.plan_prefill([p], g, t).to_device()
  rng = np.random.default_rng(seed)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  base = -float(np.log(config.vocab_size))
  batch = grpo.GrpoBatch(
      prompts=jnp.asarray(rng.integers(0, config.vocab_size, (1, p)), jnp.int32),
      completions=jnp.asarray(rng.integers(0, config.vocab_size, (g, t)), jnp.int32),
      mask=jnp.ones((g, t)), advantages=f32(rng.standard_normal(g)),
      old_logp=jnp.full((g, t), base), ref_logp=jnp.full((g, t), base))
  cfg = grpo.GrpoConfig()
  per_layer = config.num_params() - config.vocab_size * config.dim * (
      1 if config.tie_embeddings else 2)
  head_flops = 6 * g * t * config.dim * config.vocab_size
  records = []
  shapes = AttentionShapes(g, t, config.num_heads, config.num_kv_heads, config.head_dim,
                           layout.kv_tokens, dtype)
  for impl in _IMPLS.value:
    shared = impl.startswith('shared')
    tokens = p + g * t if shared else g * (p + t)
    attn = costs.training_attention_cost(1, g, p, t, config.num_heads, config.num_kv_heads,
                                         config.head_dim, shared=shared)
    flops = 6 * tokens * per_layer + head_flops + layers * attn.flops
    rec = dict(kind='step', impl=impl, G=g, P=p, T=t, preset=preset, layers=layers,
               vocab=config.vocab_size,
               dtype=jnp.dtype(dtype).name, flops=float(flops),
               floor_s=flops / ceilings.matmul_rate)
    reason = _unsupported(impl, shapes)
    scores_gb = g * config.num_heads * (p + t) ** 2 * 4 / 1e9
    if impl == 'per_seq_xla' and scores_gb > _MAX_SCORES_GB.value:
      reason = f'score matrix of {scores_gb:.0f} GB > --max_scores_gb'
    if reason:
      records.append(dict(rec, status='unsupported', reason=reason))
      continue

    def loss(params, batch, layout, shared=shared, impl=impl):
      model = nnx.merge(graphdef, params)
      if shared:
        logp = shared_forward(model, batch.prompts, batch.completions, layout,
                              kv_block=_KV_BLOCK.value, impl=_impl(impl))
      else:
        logp = per_sequence_forward(model, batch.prompts, batch.completions,
                                    layout.prompt_lengths, g, _per_seq_attention(impl))
      return grpo.grpo_loss(logp, batch, cfg)[0]

    try:
      fn = jax.jit(jax.value_and_grad(loss))
      rec['loss'] = float(fn(params, batch, layout)[0])  # equal across variants
      rec['time_s'] = _time(fn, params, batch, layout)
      rec['time_over_floor'] = rec['time_s'] / rec['floor_s']
      rec['status'] = 'ok'
    except Exception as e:
      logging.error('step %s: %s', impl, traceback.format_exc(limit=3))
      rec.update(status='error', reason=f'{type(e).__name__}: {str(e)[:300]}')
    records.append(rec)
    gc.collect()
  return records


def _speedups(records):
  by_point = {}
  for r in records:
    by_point.setdefault((r['kind'], r['G'], r['P'], r['T']), {})[r['impl']] = r
  for impls in by_point.values():
    for shared in ('shared_xla', 'shared_mosaic_gpu'):
      ours = impls.get(shared, {}).get('time_s')
      for name in ('per_seq_cudnn', 'per_seq_xla'):
        base = impls.get(name, {}).get('time_s')
        if ours and base:
          impls[shared][f'speedup_vs_{name}'] = base / ours


def main(argv):
  del argv
  s = _settings()
  try:  # a bad --training_kernel_knobs fails here, before anything runs
    _kernel_config()
  except ValueError as e:
    raise app.UsageError(f'--training_kernel_knobs: {e}') from None
  writer = report.fresh_jsonl(os.path.join(_WORKDIR.value, 'results.jsonl'))
  start = time.perf_counter()
  ceilings = roofline.measure_backend_ceilings()
  writer.append(ceilings.record())
  records = []

  def add(point):  # a point's records, written as soon as it is done (a cut run keeps them)
    _speedups(point)
    for r in point:
      writer.append(r)
    records.extend(point)

  total = len(s['points']) + len(s['step_points'])
  bar = report.progress_counter(total=total, desc='train_bench points')
  for g, p, t in s['points']:
    logging.info('attention G=%d P=%d T=%d (%.0f s)', g, p, t, time.perf_counter() - start)
    add(attention_point(g, p, t, s['heads'], s['head_dim'], s['dtype'], ceilings, _SEED.value))
    bar.update()
  for g, p, t in s['step_points']:
    logging.info('step G=%d P=%d T=%d (%.0f s)', g, p, t, time.perf_counter() - start)
    add(step_point(g, p, t, s['step_preset'], _STEP_LAYERS.value, s['step_vocab'], s['dtype'],
                   ceilings, _SEED.value))
    bar.update()
  bar.close()
  table = report.markdown_table(records, [
      ('kind', 'kind'), ('impl', 'impl'), ('G', 'G'), ('P', 'P'), ('T', 'T'),
      ('time ms', lambda r: r.get('time_s') and 1e3 * r['time_s']),
      ('floor ms', lambda r: 1e3 * r['floor_s']),
      ('time / floor', 'time_over_floor'),
      ('x vs cuDNN', 'speedup_vs_per_seq_cudnn'), ('x vs XLA', 'speedup_vs_per_seq_xla'),
      ('rel err', 'rel_err'), ('loss', 'loss'),
      ('status', lambda r: r['status'] if r['status'] == 'ok'
       else f"{r['status']}: {r.get('reason', '')}"),
  ])
  text = (f'Backend {jax.default_backend()}, ceilings: copy {ceilings.copy_bandwidth / 1e9:.0f} '
          f'GB/s, matmul {ceilings.matmul_rate / 1e12:.1f} TFLOP/s.\n\n' + table)
  with open(os.path.join(_WORKDIR.value, 'table.md'), 'w') as f:
    f.write(text)
  labels = [f"{r['kind']} G={r['G']} P={r['P']} T={r['T']}" for r in records
            if r['impl'] == _IMPLS.value[0]]
  values = {impl: [r.get('time_s') for r in records if r['impl'] == impl] for impl in _IMPLS.value}
  report.plot_bars(labels, values, path=os.path.join(_WORKDIR.value, 'time.png'),
                   ylabel='forward + backward, s', title='training attention and GRPO step')
  report.write_workdir_readme(_WORKDIR.value, 'Training attention and GRPO step', text,
                              writer.meta)
  print(table)
  logging.info('done in %.0f s', time.perf_counter() - start)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
