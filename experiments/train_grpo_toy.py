r"""GRPO on a toy reward (sums of two digits) with shared-prompt training attention, on CPU.

A tiny Llama (random init, 15-token vocabulary) samples G completions per
prompt `<bos> a + b =`; the reward is the fraction of the answer's tokens
(digits, then <eos>) it got right, plus 1 for an exact answer. Each step is a
GRPO update (group-relative advantages, clipped ratio, KL to the initial
policy) whose forward runs every prompt once for its G completions
(`models.training.forward.shared_forward`, hydrajax tree attention with a
custom VJP).

With --branches=B the rollouts are trees: each prompt samples B branches of --branch_length
tokens, each branch G / B continuations of the rest, and the step is a GRPO update over the
tree (`models.training.grpo.make_tree_train_step`: the prompt and every branch through the
layers once, each branch token weighted by the samples below it).

  PYTHONPATH=. python -m experiments.train_grpo_toy --workdir=experiments/results/train_grpo_toy
  PYTHONPATH=. python -m experiments.train_grpo_toy --branches=2 \
      --workdir=experiments/results/train_grpo_toy_tree

--dp=N trains data parallel over N devices (`make_train_step(mesh=)`: each its block of the
prompts; the rollouts stay on one device), e.g. on XLA's fake CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. \
      python -m experiments.train_grpo_toy --dp=2 --workdir=workdir/train_grpo_toy_dp

Writes, into --workdir: metrics.jsonl (one record per step), reward.png, README.md.
"""

import dataclasses
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments import cli
from experiments.grpo_toy import dp_mesh, group_rollouts, tree_rollouts
from experiments.benchmarking import report
from models.config import get_config
from models.llama import Llama
from models.training import grpo, rollout

_STEPS = flags.DEFINE_integer('steps', 800, 'GRPO steps')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'prompts per step (Bp)')
_GROUP = flags.DEFINE_integer('group_size', 8, 'completions per prompt (G)')
_MAX_OPERAND = flags.DEFINE_integer('max_operand', 9, 'operands are digits in [0, max_operand]')
_LR = flags.DEFINE_float('learning_rate', 1e-3, 'Adam learning rate')
_KL = flags.DEFINE_float('kl_coef', 0.01, 'KL coefficient beta')
_CLIP = flags.DEFINE_float('clip_eps', 0.2, 'ratio clip range')
_PRESET = flags.DEFINE_string('preset', 'tiny_gqa', 'model shape (vocab replaced by the task\'s)')
_BRANCHES = flags.DEFINE_integer(
    'branches', 0, 'tree rollouts: branches a prompt (0: G independent completions)')
_BRANCH_LENGTH = flags.DEFINE_integer('branch_length', 1, 'tokens a branch (with --branches)')
_DP = flags.DEFINE_integer('dp', 1, 'devices the step is data parallel over (divides --prompts)')
_SEED = flags.DEFINE_integer('seed', 0, 'seed of the model, prompts and sampling')
_WORKDIR = cli.workdir_flag('train_grpo_toy')
cli.at_least(1, 'steps', 'prompts', 'group_size', 'max_operand', 'branch_length', 'dp')
cli.at_least(0, 'branches', 'kl_coef', 'clip_eps')
cli.at_least(1e-12, 'learning_rate')


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  task = rollout.ArithmeticTask(max_operand=_MAX_OPERAND.value)
  config = get_config(_PRESET.value, vocab_size=rollout.VOCAB_SIZE)
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(_SEED.value)))
  ref_params = jax.tree.map(jnp.copy, params)
  optimizer = optax.adam(_LR.value)
  opt_state = optimizer.init(params)
  cfg = grpo.GrpoConfig(clip_eps=_CLIP.value, kl_coef=_KL.value)
  if _BRANCHES.value < 0:
    raise app.UsageError(f'--branches must be >= 0 (0: independent samples), got '
                         f'{_BRANCHES.value}')
  mesh = dp_mesh(_DP.value, _PROMPTS.value)
  if _BRANCHES.value:
    rollout_fn, step_fn, make_batch = tree_rollouts(
        task, graphdef, optimizer, cfg, _PROMPTS.value, _GROUP.value, _BRANCHES.value,
        _BRANCH_LENGTH.value, mesh=mesh)
  else:
    rollout_fn, step_fn, make_batch = group_rollouts(task, graphdef, optimizer, cfg,
                                                     _PROMPTS.value, _GROUP.value, mesh=mesh)

  rng = np.random.default_rng(_SEED.value)
  key = jax.random.key(_SEED.value)
  path = os.path.join(_WORKDIR.value, 'metrics.jsonl')
  records = []
  start = time.perf_counter()
  writer = report.fresh_jsonl(path, meta={})  # the run metadata once, not on every step
  writer.append(dict(kind='meta', **report.run_metadata()))
  for step in range(_STEPS.value):
    prompts, ops = task.prompts(rng, _PROMPTS.value)
    rollouts = rollout_fn(params, ref_params, jnp.asarray(prompts),
                          jax.random.fold_in(key, step))
    batch, completions, layout = make_batch(prompts, rollouts)
    rewards = task.rewards(completions, ops, _GROUP.value)
    batch = dataclasses.replace(batch,
                                advantages=grpo.group_advantages(jnp.asarray(rewards), cfg))
    params, opt_state, metrics = step_fn(params, opt_state, batch, layout)
    record = dict(step=step, reward=float(rewards.mean()), exact=float((rewards >= 2).mean()),
                  elapsed_s=time.perf_counter() - start,
                  **{k: float(v) for k, v in metrics.items()})
    writer.append(record)
    records.append(record)
    if step % 10 == 0 or step == _STEPS.value - 1:
      logging.info('step %d reward %.3f exact %.3f kl %.4f (%.0f s)', step, record['reward'],
                   record['exact'], record['kl'], record['elapsed_s'])
  _plot(records, os.path.join(_WORKDIR.value, 'reward.png'))
  _readme(records, os.path.join(_WORKDIR.value, 'README.md'))


def _smooth(x, window=10):
  x = np.asarray(x, np.float64)
  return np.array([x[max(0, i - window + 1): i + 1].mean() for i in range(len(x))])


def _plot(records, path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  steps = [r['step'] for r in records]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for name in ('reward', 'exact'):
    values = [r[name] for r in records]
    ax.plot(steps, values, alpha=0.3)
    ax.plot(steps, _smooth(values), label=f'{name} (10-step mean)')
  ax.set_xlabel('GRPO step')
  ax.set_ylabel('mean over the batch')
  ax.set_title('toy GRPO: sums of two digits (max reward 2)')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _readme(records, path):
  first, last = records[:10], records[-10:]
  mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
  flags_used = ' '.join(f'--{f.name}={f.value}' for f in (
      _STEPS, _PROMPTS, _GROUP, _BRANCHES, _BRANCH_LENGTH, _MAX_OPERAND, _LR, _KL, _CLIP,
      _PRESET, _DP, _SEED))
  kind = (f'rollout trees, {_BRANCHES.value} branches a prompt' if _BRANCHES.value
          else 'shared-prompt training attention')
  text = f"""# Toy GRPO run ({kind})

`PYTHONPATH=. python -m experiments.train_grpo_toy {flags_used}`

| | first 10 steps | last 10 steps |
| --- | --- | --- |
| mean reward (max 2) | {mean(first, 'reward'):.3f} | {mean(last, 'reward'):.3f} |
| exact answers | {mean(first, 'exact'):.3f} | {mean(last, 'exact'):.3f} |
| KL to the initial policy | {mean(first, 'kl'):.4f} | {mean(last, 'kl'):.4f} |

{len(records)} steps in {records[-1]['elapsed_s']:.0f} s (CPU, compile included). Per step:
sampling, the policy's and the reference's log-probs, one GRPO update. Curve: reward.png;
every step: metrics.jsonl.
"""
  with open(path, 'w') as f:
    f.write(text)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
