r"""Parallel GRPO training step: one device against a `dp` mesh and a `tp` mesh.

Per point G:P:T (each prompt P tokens with G completions of T tokens), one Adam step of
`models.training.grpo.make_train_step` (the shared forward: each prompt once; its attention on
--impl) over one batch of n * k prompts (n = --devices, k = --prompts_per_device), timed as a
training loop sees it (wall clock of consecutive steps, the state threaded through). Variants:

* `one_device`: the whole batch on one device;
* `dp<n>`: `make_train_step(mesh=)` over n devices, each its k prompts (`grpo.data_parallel`:
  its own layout, gradients averaged by one all-reduce, parameters replicated);
* `tp<n>`: the model on a tp mesh (`Llama(..., mesh=)`, parameters split by the rules table),
  each device its heads of every attention call (one shard_map a layer) and GSPMD's share of
  the projections.

Reported: ms a step, samples a second, the speedup over one device and the loss against one
device's (the same batch and parameters).

CPU smoke (the default; the meshes need two devices, e.g. XLA's fake CPU devices):

  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. \
      python -m experiments.train_parallel_step --workdir=workdir/train_parallel_step

The H200 command (two H200s of one host; llama3_8b's shapes at 2 layers, a 32K vocabulary, bf16,
the Mosaic GPU kernels; step point, G = 32 samples of an 8K prompt, 1K tokens each):

  PYTHONPATH=. python -m experiments.train_parallel_step --nosmoke \
      --workdir=experiments/results/train_parallel_step

Writes, into --workdir: results.jsonl (one record per variant and point), table.md,
samples.png and README.md.
"""

import os
import statistics
import time

from absl import app, flags, logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import cli
from experiments.benchmarking import report
from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.attention.training import plan_prefill
from models import sharding_rules as sr
from models.config import get_config
from models.llama import Llama
from models.training import grpo

_SMOKE = flags.DEFINE_bool('smoke', True, 'tiny float32 CPU settings; --nosmoke: the H200 point')
_POINTS = flags.DEFINE_list('points', None, 'points G:P:T (default by --smoke)')
_DEVICES = flags.DEFINE_integer('devices', 2, 'devices of the dp and tp meshes (>= 2)')
_PROMPTS = flags.DEFINE_integer('prompts_per_device', 1, 'prompts a device trains on (dp)')
_VARIANTS = flags.DEFINE_list('variants', ['one_device', 'dp', 'tp'],
                              'one_device first, then any of dp, tp')
_PRESET = flags.DEFINE_string('preset', None, 'model (default llama3_8b; smoke tiny_gqa)')
_LAYERS = flags.DEFINE_integer('layers', 2, 'layers of the model (reduced to fit)')
_VOCAB = flags.DEFINE_integer('vocab', None, 'vocabulary (default 32000; smoke the preset\'s)')
_IMPL = flags.DEFINE_enum('impl', None, ['xla', 'mosaic_gpu'],
                          'attention kernels (default mosaic_gpu; smoke xla)')
_STEPS = flags.DEFINE_integer('steps', 5, 'steps a timed loop')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'timed loops (median reported)')
_SEED = flags.DEFINE_integer('seed', 0, 'input and parameter seed')
_WORKDIR = cli.workdir_flag('train_parallel_step')
cli.at_least(1, 'prompts_per_device', 'layers', 'steps', 'repeats')
cli.at_least(2, 'devices')

SMOKE = dict(points=['4:32:16'], preset='tiny_gqa', vocab=None, impl='xla', dtype=jnp.float32)
H200 = dict(points=['32:8192:1024'], preset='llama3_8b', vocab=32_000, impl='mosaic_gpu',
            dtype=jnp.bfloat16)


def _settings():
  base = SMOKE if _SMOKE.value else H200
  pick = lambda flag, key: base[key] if flag.value is None else flag.value
  points = []
  for text in pick(_POINTS, 'points'):
    point = tuple(int(x) for x in text.split(':'))
    if len(point) != 3 or min(point) < 1:
      raise app.UsageError(f'--points: G:P:T, three ints >= 1, got {text!r}')
    points.append(point)
  for flag, low in ((_DEVICES, 2), (_PROMPTS, 1), (_STEPS, 1), (_REPEATS, 1)):
    if flag.value < low:
      raise app.UsageError(f'--{flag.name} must be >= {low}, got {flag.value}')
  variants = _VARIANTS.value
  if not variants or variants[0] != 'one_device' or not set(variants[1:]) <= {'dp', 'tp'}:
    raise app.UsageError(f'--variants: one_device, then any of dp, tp; got {variants}')
  return dict(points=points, preset=pick(_PRESET, 'preset'), vocab=pick(_VOCAB, 'vocab'),
              impl=AttentionImpl(pick(_IMPL, 'impl')), dtype=base['dtype'])


def grpo_batch(prompts, g, p, t, vocab, seed):
  """`prompts` prompts of P tokens (lengths P - 7 * i: the real lengths are data) with G
  completions of T tokens each: random tokens and advantages, uniform sampling log-probs."""
  rng = np.random.default_rng(seed)
  lengths = [max(1, p - 7 * i) for i in range(prompts)]
  b = prompts * g
  full = jnp.full((b, t), -float(np.log(vocab)), jnp.float32)
  batch = grpo.GrpoBatch(
      prompts=jnp.asarray(rng.integers(0, vocab, (prompts, p)), jnp.int32),
      completions=jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
      mask=jnp.ones((b, t), jnp.float32),
      advantages=jnp.asarray(rng.standard_normal(b), jnp.float32), old_logp=full, ref_logp=full)
  return batch, plan_prefill(lengths, g, t, prompt_capacity=p)


def _timed_loop(step, state, batch, layout, steps):
  """(state, seconds a step): `steps` consecutive steps, wall clock, the state threaded."""
  start = time.perf_counter()
  for _ in range(steps):
    *state, metrics = step(*state, batch, layout)
  jax.block_until_ready(metrics)
  return state, (time.perf_counter() - start) / steps


def run_variant(rec, graphdef, params, batch, layout, mesh, impl):
  """Fills rec: the first step's time (compile included) and loss, then the loops' median."""
  optimizer = optax.adam(1e-6)
  step = grpo.make_train_step(graphdef, optimizer, grpo.GrpoConfig(), impl=impl, mesh=mesh)
  state = [jax.tree.map(jnp.copy, params), optimizer.init(params)]
  start = time.perf_counter()
  *state, metrics = step(*state, batch, layout)
  rec['loss'] = float(metrics['loss'])
  rec['first_call_s'] = time.perf_counter() - start
  logging.info('%s: first step %.1f s', rec['variant'], rec['first_call_s'])
  samples = []
  for _ in range(_REPEATS.value):
    state, seconds = _timed_loop(step, state, batch, layout, _STEPS.value)
    samples.append(seconds)
  rec.update(status='ok', time_s=statistics.median(samples),
             samples_per_s=rec['samples'] / statistics.median(samples))


def _variant_args(name, n, graphdef, params, config, settings, plan):
  """(graphdef, params, layout, mesh) of a variant (see the module docstring)."""
  if name == 'one_device':
    return graphdef, params, plan.to_device(), None
  mesh = jax.make_mesh((n,), (name,), devices=jax.devices()[:n])
  if name == 'dp':
    return graphdef, params, plan.to_device_sharded(n), mesh
  graphdef_tp, _ = nnx.split(nnx.eval_shape(lambda: Llama(
      config, rngs=nnx.Rngs(0), dtype=settings['dtype'], mesh=mesh)))
  placed = jax.device_put(params, sr.param_shardings(params, sr.auto_mesh(mesh)))
  return graphdef_tp, placed, plan.to_device(), None


def run_point(point, settings, writer):
  """Every variant's record at one point, each written as it ends."""
  g, p, t = point
  n, k = _DEVICES.value, _PROMPTS.value
  config = get_config(settings['preset'], num_layers=_LAYERS.value,
                      **({'vocab_size': settings['vocab']} if settings['vocab'] else {}))
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(_SEED.value), dtype=settings['dtype']))
  batch, plan = grpo_batch(n * k, g, p, t, config.vocab_size, _SEED.value)
  records = []
  for name in _VARIANTS.value:
    devices = 1 if name == 'one_device' else n
    rec = dict(variant=name if devices == 1 else f'{name}{n}', devices=devices, prompts=n * k,
               G=g, P=p, T=t, samples=n * k * g, preset=settings['preset'],
               layers=_LAYERS.value, vocab=config.vocab_size, impl=settings['impl'].value)
    try:
      if rec['devices'] > jax.device_count():
        rec.update(status='unsupported', reason=f'needs {n} devices, {jax.device_count()} here')
      else:
        graphdef_v, params_v, layout, mesh = _variant_args(name, n, graphdef, params, config,
                                                           settings, plan)
        run_variant(rec, graphdef_v, params_v, batch, layout, mesh, settings['impl'])
    except Exception as e:  # one failing variant must not end the run
      logging.exception('%s', rec['variant'])
      rec.update(status='error', reason=f'{type(e).__name__}: {str(e)[:300]}')
    one = records[0] if records else rec
    if rec is not one and rec.get('time_s') and one.get('time_s'):
      rec['speedup'] = one['time_s'] / rec['time_s']
      rec['loss_rel_diff'] = abs(rec['loss'] - one['loss']) / max(abs(one['loss']), 1e-30)
    writer.append(rec)
    records.append(rec)
  return records


def main(argv):
  del argv
  settings = _settings()
  os.makedirs(_WORKDIR.value, exist_ok=True)
  writer = report.fresh_jsonl(os.path.join(_WORKDIR.value, 'results.jsonl'))
  start = time.perf_counter()
  records = []
  for point in report.progress(settings['points'], desc='train_parallel_step points'):
    logging.info('point G:P:T=%s (%.0f s)', point, time.perf_counter() - start)
    records += run_point(point, settings, writer)
  table = report.markdown_table(records, [
      ('variant', 'variant'), ('G', 'G'), ('P', 'P'), ('T', 'T'), ('prompts', 'prompts'),
      ('ms a step', lambda r: r.get('time_s') and 1e3 * r['time_s']),
      ('samples / s', 'samples_per_s'), ('x one device', 'speedup'),
      ('loss', 'loss'), ('loss rel diff', 'loss_rel_diff'), ('first step s', 'first_call_s'),
      ('status', lambda r: r['status'] if r['status'] == 'ok'
       else f"{r['status']}: {r.get('reason', '')}"),
  ])
  text = (f'Backend {jax.default_backend()}, {jax.device_count()} devices, attention '
          f'{settings["impl"].value}, {settings["preset"]} at {_LAYERS.value} layers. One Adam '
          f'step of the GRPO loss over one batch, wall clock over {_STEPS.value} steps, median '
          f'of {_REPEATS.value}.\n\n' + table)
  with open(os.path.join(_WORKDIR.value, 'table.md'), 'w') as f:
    f.write(text)
  labels = [':'.join(map(str, point)) for point in settings['points']]
  variants = list(dict.fromkeys(r['variant'] for r in records))
  values = {v: [r.get('samples_per_s') for r in records if r['variant'] == v] for v in variants}
  report.plot_bars(labels, values, path=os.path.join(_WORKDIR.value, 'samples.png'),
                   ylabel='samples / s', title='GRPO step: one device, dp and tp')
  report.write_workdir_readme(_WORKDIR.value, 'Parallel GRPO step', text, writer.meta)
  print(table)
  logging.info('done in %.0f s', time.perf_counter() - start)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
