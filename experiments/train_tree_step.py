r"""Rollout-tree GRPO step benchmark: value and gradient of the GRPO loss of a Llama over a tree.

Per point P:B:L:G:T (as in `experiments.train_tree_bench`: a P-token prompt, B branches of L
tokens, G leaves of T tokens, G / B a branch), every leaf is one GRPO sample whose completion is
its path below the prompt: its branch's L tokens, then its own T. Variants, the same loss:

* `tree_<impl>`: `models.training.grpo.tree_grpo_loss` over `tree_forward`: every node through
  the layers once (the prompt, each branch, each leaf), its attention `tree_prefill` on `impl`
  (`mosaic_gpu`: the Hopper kernels; `xla`);
* `prompt_shared_<impl>`: `grpo_loss` over `shared_forward`: the prompt once, each leaf's L + T
  tokens its completion (one sharing level, the branch recomputed for each of its leaves);
* `per_seq_<cudnn|xla>`: `grpo_loss` over `per_sequence_forward`: every leaf's own P + L + T
  tokens, attention by `jax.nn.dot_product_attention`.

The loss is checked against the first variant's. floor_s: the variant's own matmul FLOPs (the
layers over its tokens, the output head over its scored tokens, attention:
`experiments.benchmarking.training_costs`) over the measured matmul rate.

CPU smoke (the default, about a minute):

  PYTHONPATH=. python -m experiments.train_tree_step --workdir=workdir/train_tree_step

The H200 command (llama3_8b's shapes at 2 layers, a 32K vocabulary, bf16; step point,
G = 32 samples of an 8K prompt with 1K completion tokens, branching 4 ways after 512):

  PYTHONPATH=. python -m experiments.train_tree_step --nosmoke \
      --workdir=experiments/results/train_tree_step

On the H200 each variant takes about 100 s (its first call, compile and one run, 40-90 s; the
timing compiles the step again inside its loop): about 6 minutes for this point. Each variant
is logged as it ends. Results: experiments/results/train_tree_s41/ (at 8192:4:512:32:512 the tree
step is 1.63x one-level sharing and 7.71x per-sequence cuDNN).

Writes, into --workdir: results.jsonl (the ceilings, then each variant's record as it ends and
each point's `speedups`), table.md, time.png and README.md.
"""

import os
import time

# The per-sequence baseline needs most of the H200's memory (JAX takes 75% by default).
os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.92')

from absl import app, flags, logging  # noqa: E402
from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import cli  # noqa: E402
from experiments import rollout_report  # noqa: E402
from hydrajax.shapes import AttentionShapes  # noqa: E402
from experiments.benchmarking import training_costs as costs  # noqa: E402
from hydrajax.attention.training import prefill_layout as pl  # noqa: E402
from hydrajax.attention.training import tree_prefill as tp  # noqa: E402
from models.config import get_config  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.training import grpo  # noqa: E402
from models.training.forward import (  # noqa: E402
    per_sequence_forward, shared_forward, tree_forward,
)

_SMOKE = flags.DEFINE_bool('smoke', True, 'tiny float32 CPU settings; --nosmoke: the H200 point')
_POINTS = flags.DEFINE_list('points', None, 'points P:B:L:G:T (default by --smoke)')
_PRESET = flags.DEFINE_string('preset', None, 'model (default llama3_8b; smoke tiny_gqa)')
_LAYERS = flags.DEFINE_integer('layers', 2, 'layers of the model (reduced to fit)')
_VOCAB = flags.DEFINE_integer('vocab', None, 'vocabulary (default 32000; smoke the preset\'s)')
_IMPLS = flags.DEFINE_list('impls', None, 'variants, baselines first (default by --smoke)')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'timed repeats (median reported)')
_TARGET_MS = flags.DEFINE_float('target_ms', 200.0, 'length of one timed loop, ms')
_SEED = flags.DEFINE_integer('seed', 0, 'input and parameter seed')
_WORKDIR = cli.workdir_flag('train_tree_step')
cli.at_least(1, 'layers', 'repeats')
cli.at_least(0.001, 'target_ms')

SMOKE = dict(points=['24:2:8:4:8'], preset='tiny_gqa', vocab=None,
             impls=['per_seq_xla', 'prompt_shared_xla', 'tree_xla'], dtype=jnp.float32)
H200 = dict(points=['8192:4:512:32:512'], preset='llama3_8b', vocab=32_000,
            impls=['tree_mosaic_gpu', 'prompt_shared_mosaic_gpu', 'per_seq_cudnn'],
            dtype=jnp.bfloat16)


def _settings():
  base = SMOKE if _SMOKE.value else H200
  pick = lambda flag, key: base[key] if flag.value is None else flag.value
  points = rollout_report.parse_points(pick(_POINTS, 'points'))
  for name in pick(_IMPLS, 'impls'):
    if not name.startswith(('tree_', 'prompt_shared_', 'per_seq_')):
      raise app.UsageError(f'--impls: tree_*, prompt_shared_* or per_seq_*, got {name}')
  return dict(points=points, preset=pick(_PRESET, 'preset'), vocab=pick(_VOCAB, 'vocab'),
              impls=pick(_IMPLS, 'impls'), dtype=base['dtype'])


def batches(point, vocab, seed):
  """(TreeGrpoBatch, GrpoBatch of every leaf's path, tree layout, prefill layout): the same
  samples, random tokens and advantages, the sampling and reference log-probs uniform."""
  p, b, l, g, t = point
  layout = tp.plan_rollout_tree(*point).to_device()
  rng = np.random.default_rng(seed)
  tokens = [jnp.asarray(rng.integers(0, vocab, shape), jnp.int32) for shape in layout.level_shapes]
  advantages = jnp.asarray(rng.standard_normal(g), jnp.float32)  # the leaves, in row order
  full = lambda shape: jnp.full(shape, -float(np.log(vocab)), jnp.float32)
  below = layout.level_shapes[1:]
  tree = grpo.TreeGrpoBatch(
      level_tokens=tokens, mask=[jnp.ones(s, jnp.float32) for s in below],
      advantages=advantages, old_logp=[full(s) for s in below], ref_logp=[full(s) for s in below])
  completions = jnp.concatenate([tokens[1][layout.parent_rows[1]], tokens[2]], axis=1)
  paths = grpo.GrpoBatch(
      prompts=tokens[0], completions=completions, mask=jnp.ones(completions.shape, jnp.float32),
      advantages=advantages, old_logp=full(completions.shape), ref_logp=full(completions.shape))
  return tree, paths, layout, pl.plan_prefill([p], g, l + t).to_device()


def _loss(name, graphdef, config: grpo.GrpoConfig, group_size):
  """loss(params, batch, layout) of a variant (see the module docstring)."""
  if name.startswith('tree_'):
    def loss(params, batch, layout):
      logp = tree_forward(nnx.merge(graphdef, params), batch.level_tokens, layout,
                          impl=rollout_report.impl_of(name))
      return grpo.tree_grpo_loss(logp, batch, layout, config)[0]
  elif name.startswith('prompt_shared_'):
    def loss(params, batch, layout):
      logp = shared_forward(nnx.merge(graphdef, params), batch.prompts, batch.completions,
                            layout, impl=rollout_report.impl_of(name))
      return grpo.grpo_loss(logp, batch, config)[0]
  else:
    implementation = name.removeprefix('per_seq_')
    attention = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                             implementation=implementation)

    def loss(params, batch, layout):
      logp = per_sequence_forward(nnx.merge(graphdef, params), batch.prompts,
                                  batch.completions, layout.prompt_lengths, group_size,
                                  attention)
      return grpo.grpo_loss(logp, batch, config)[0]
  return loss


def _flops(name, point, model_config, layers):
  """Matmul FLOPs of one value-and-gradient: 6 a parameter and token (forward + backward)."""
  p, b, l, g, t = point
  c = model_config
  per_layer = c.num_params() - c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
  heads = (c.num_heads, c.num_kv_heads, c.head_dim)
  if name.startswith('tree_'):
    tokens, scored = p + b * l + g * t, b * l + g * t
    attention = costs.tree_prefill_cost(tp.plan_rollout_tree(*point), *heads, shared=True)
  else:
    shared = name.startswith('prompt_shared_')
    tokens, scored = (p + g * (l + t) if shared else g * (p + l + t)), g * (l + t)
    attention = costs.training_attention_cost(1, g, p, l + t, *heads, shared=shared)
  return 6 * tokens * per_layer + 6 * scored * c.dim * c.vocab_size + layers * attention.flops


def run_point(point, settings, ceilings, seed, emit):
  """Emits every variant's record at one point as it ends (losses checked against the first
  that ran)."""
  p, b, l, g, t = point
  layers = _LAYERS.value
  overrides = dict(vocab_size=settings['vocab']) if settings['vocab'] else {}
  model_config = get_config(settings['preset'], num_layers=layers, **overrides)
  graphdef, params = nnx.split(Llama(model_config, rngs=nnx.Rngs(seed), dtype=settings['dtype']))
  tree, paths, layout, prefill = batches(point, model_config.vocab_size, seed)
  shapes = AttentionShapes(g, t, model_config.num_heads, model_config.num_kv_heads,
                           model_config.head_dim, layout.kv_tokens, settings['dtype'])
  reference = None
  for name in settings['impls']:
    flops = _flops(name, point, model_config, layers)
    rec = dict(kind='step', impl=name, P=p, B=b, L=l, G=g, T=t, preset=settings['preset'],
               layers=layers, vocab=model_config.vocab_size,
               dtype=jnp.dtype(settings['dtype']).name, flops=float(flops),
               floor_s=flops / ceilings.matmul_rate)
    reason = rollout_report.unsupported(name, shapes)
    if reason:
      emit(dict(rec, status='unsupported', reason=reason))
      continue
    args = (params, tree, layout) if name.startswith('tree_') else (params, paths, prefill)
    with rollout_report.variant(rec, emit):
      start = time.perf_counter()
      fn = jax.jit(jax.value_and_grad(_loss(name, graphdef, grpo.GrpoConfig(), g)))
      rec['loss'] = float(fn(*args)[0])
      rec['first_call_s'] = time.perf_counter() - start  # compile and one run
      logging.info('%s: first call (compile, run) %.0f s', name, rec['first_call_s'])
      if reference is None:
        reference = rec['loss']
      else:
        rec['loss_rel_err'] = abs(rec['loss'] - reference) / max(abs(reference), 1e-30)
      rollout_report.record_time(rec, fn, args, repeats=_REPEATS.value,
                                 target_s=_TARGET_MS.value / 1e3)


def main(argv):
  del argv
  s = _settings()
  rollout_report.run(
      _WORKDIR.value, s['points'], s['impls'],
      lambda point, ceilings, emit: run_point(point, s, ceilings, _SEED.value, emit),
      is_tree=lambda impl: impl.startswith('tree_'),
      columns=[('loss', 'loss'), ('loss rel err', 'loss_rel_err')],
      header=(f'Model {s["preset"]} at {_LAYERS.value} layers. P:B:L:G:T = a P-token prompt, '
              'B branches of L tokens, G leaves of T tokens; value and gradient of the GRPO '
              'loss over every leaf\'s path.'),
      title='Rollout-tree GRPO step', ylabel='value and gradient, s')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
