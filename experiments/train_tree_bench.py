r"""Rollout-tree training benchmark: attention forward + backward over a token tree.

Per point P:B:L:G:T: one prompt of P tokens, B branches of L tokens under it, and G leaves of
T tokens (G / B under each branch), every token a query (training). Variants, all computing the
same attention (checked against the first to run, at every leaf token):

* `tree_mosaic_gpu` / `tree_xla`: `hydrajax.attention.training.tree_prefill_attention`, the prompt and
  each branch attended once by every query below them (`impl` MOSAIC_GPU: the Hopper kernels,
  on slices of the buffer, since these trees are uniform; XLA: the XLA path);
* `tree_walked_mosaic_gpu`: the same on the kernels through each level's walked tree
  (`tree_attention_vjp`), the path a tree that is not uniform takes;
* `prefill_mosaic_gpu` / `prefill_xla`: the two-level prefill layout (`prefill_attention`), what
  sharing one level gives: each branch with its own copy of the prompt as a prompt of P + L
  tokens, its G / B leaves as completions;
* `per_seq_cudnn` / `per_seq_xla`: every leaf's own sequence of P + L + T tokens, causal
  (`jax.nn.dot_product_attention`), the prompt and branch recomputed per leaf.

floor_s: the roofline of each variant's own computation (`experiments.benchmarking.training_costs`, measured
ceilings); `speedup_vs_*` (in the point's `speedups` record, and the table): the baseline's time
over the tree's.

CPU smoke (the default, a minute):

  PYTHONPATH=. python -m experiments.train_tree_bench --workdir=workdir/train_tree_bench

The H200 command (32/8 heads, d=128, bf16):

  PYTHONPATH=. python -m experiments.train_tree_bench --nosmoke \
      --workdir=experiments/results/train_tree_bench

Writes, into --workdir: results.jsonl (the ceilings, then each variant's record as it ends and
each point's `speedups`), table.md, time.png and README.md.
"""

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments import rollout_report
from hydrajax.shapes import AttentionShapes
from experiments.benchmarking import timing
from experiments.benchmarking import training_costs as costs
from hydrajax.attention.training import prefill_layout as pl
from hydrajax.attention.training import tree_prefill as tp

_SMOKE = flags.DEFINE_bool('smoke', True, 'tiny float32 CPU settings; --nosmoke: the H200 points')
_POINTS = flags.DEFINE_list('points', None, 'points P:B:L:G:T (default by --smoke)')
_HEADS = flags.DEFINE_string('heads', None, 'query heads : kv heads (default 32:8; smoke 4:2)')
_HEAD_DIM = flags.DEFINE_integer('head_dim', None, 'head dim (default 128; smoke 16)')
_IMPLS = flags.DEFINE_list('impls', None, 'variants, baselines first (default by --smoke)')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'timed repeats (median reported)')
_TARGET_MS = flags.DEFINE_float('target_ms', 50.0, 'length of one timed loop, ms')
_SEED = flags.DEFINE_integer('seed', 0, 'input seed')
_WORKDIR = cli.workdir_flag('train_tree_bench')
cli.at_least(1, 'repeats')
cli.at_least(0.001, 'target_ms')

SMOKE = dict(points=['24:2:8:4:8', '40:2:12:6:16'], heads='4:2', head_dim=16,
             impls=['per_seq_xla', 'prefill_xla', 'tree_xla'], dtype=jnp.float32)
H200 = dict(points=['1024:4:256:16:256', '4096:4:1024:16:1024', '4096:8:1024:64:512',
                    '8192:8:1024:64:1024'],
            heads='32:8', head_dim=128,
            impls=['per_seq_cudnn', 'prefill_mosaic_gpu', 'tree_mosaic_gpu',
                   'tree_walked_mosaic_gpu'],
            dtype=jnp.bfloat16)
TREES = ('tree_mosaic_gpu', 'tree_xla', 'tree_walked_mosaic_gpu')


def _settings():
  base = SMOKE if _SMOKE.value else H200
  pick = lambda flag, key: base[key] if flag.value is None else flag.value
  points = rollout_report.parse_points(pick(_POINTS, 'points'))
  n, k = (int(x) for x in pick(_HEADS, 'heads').split(':'))
  return dict(points=points, heads=(n, k), head_dim=pick(_HEAD_DIM, 'head_dim'),
              impls=pick(_IMPLS, 'impls'), dtype=base['dtype'])


def _variant(name, point, heads, head_dim, dtype, seed):
  """(fn, args, leaves_of): the attention to time, its arguments, and fn's leaf outputs
  [G, T, N, H] from its outputs."""
  p, b, l, g, t = point
  n, kh = heads
  plan = tp.plan_rollout_tree(*point)
  layout = plan.to_device()
  keys = iter(jax.random.split(jax.random.key(seed), 9))
  draw = lambda heads: [jax.random.normal(next(keys), (rows, c, heads, head_dim),
                                          jnp.float32).astype(dtype)
                        for rows, c in layout.level_shapes]
  q, k, v = draw(n), draw(kh), draw(kh)  # a level each: [1, P], [B, L], [G, T]
  if name in TREES:
    def fn(q, k, v):
      kb, vb = tp.write_tree_kv(layout, k), tp.write_tree_kv(layout, v)
      plan = tp.prepare_tree_prefill(layout, q, kb, impl=rollout_report.impl_of(name),
                                     slices=name != 'tree_walked_mosaic_gpu')
      return tuple(s.out for s in tp.attend_tree_prefill(q, kb, vb, plan))
    return fn, (q, k, v), lambda outs: outs[-1]
  if name.startswith('prefill'):
    prefill = pl.plan_prefill([p + l] * b, g // b, t).to_device()
    prompts = lambda x: jnp.concatenate([jnp.repeat(x[0], b, axis=0), x[1]], axis=1)

    def fn(q_p, q_c, k_p, k_c, v_p, v_c):
      kb, vb = pl.write_kv(prefill, k_p, k_c), pl.write_kv(prefill, v_p, v_c)
      prompt, completion = pl.prefill_attention(q_p, q_c, kb, vb, prefill,
                                                impl=rollout_report.impl_of(name))
      return prompt.out, completion.out
    args = tuple(x for a in (q, k, v) for x in (prompts(a), a[2]))
    return fn, args, lambda outs: outs[1]
  seq = lambda x: tp.path_sequences(layout, tp.write_tree_kv(layout, x))  # [G, P + L + T, ..]
  implementation = name.removeprefix('per_seq_')
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                         implementation=implementation)
  return fn, (seq(q), seq(k), seq(v)), lambda out: out[:, p + l:]


def _cost(name, point, heads, head_dim, dtype):
  p, b, l, g, t = point
  n, kh = heads
  size = jnp.dtype(dtype).itemsize
  if name.startswith('prefill'):
    return costs.training_attention_cost(b, g // b, p + l, t, n, kh, head_dim, shared=True,
                                         dtype_bytes=size)
  return costs.tree_prefill_cost(tp.plan_rollout_tree(*point), n, kh, head_dim,
                                 shared=name in TREES, dtype_bytes=size)


def run_point(point, impls, heads, head_dim, dtype, ceilings, seed, emit):
  """Emits every variant's record at one point as it ends (checked against the first variant
  that ran)."""
  p, b, l, g, t = point
  n, kh = heads
  reference = None
  kv_tokens = tp.plan_rollout_tree(*point).kv_tokens
  leaf_shapes = AttentionShapes(g, t, n, kh, head_dim, kv_tokens, dtype)
  for name in impls:
    cost = _cost(name, point, heads, head_dim, dtype)
    rec = dict(kind='attention', impl=name, P=p, B=b, L=l, G=g, T=t, N=n, K=kh, H=head_dim,
               dtype=jnp.dtype(dtype).name, floor_s=cost.floor_s(ceilings), flops=cost.flops)
    reason = rollout_report.unsupported(name, leaf_shapes)
    if reason:
      emit(dict(rec, status='unsupported', reason=reason))
      continue
    with rollout_report.variant(rec, emit):
      fn, args, leaves_of = _variant(name, point, heads, head_dim, dtype, seed)
      leaves = np.asarray(leaves_of(jax.jit(fn)(*args)), np.float32)
      if reference is None:
        reference = leaves
      else:
        diff = np.abs(leaves - reference).max()
        rec['rel_err'] = float(diff / max(np.abs(reference).max(), 1e-30))
      del leaves
      program, program_args = timing.vjp_program(fn, args, seed)
      rollout_report.record_time(rec, program, program_args, repeats=_REPEATS.value,
                                 target_s=_TARGET_MS.value / 1e3)


def main(argv):
  del argv
  s = _settings()
  rollout_report.run(
      _WORKDIR.value, s['points'], s['impls'],
      lambda point, ceilings, emit: run_point(point, s['impls'], s['heads'], s['head_dim'],
                                              s['dtype'], ceilings, _SEED.value, emit),
      is_tree=lambda impl: impl in TREES, columns=[('rel err', 'rel_err')],
      header='P:B:L:G:T = a P-token prompt, B branches of L tokens, G leaves of T tokens.',
      title='Rollout-tree training attention', ylabel='forward + backward, s')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
