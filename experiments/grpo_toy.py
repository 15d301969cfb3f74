"""The GRPO toy's rollouts and training steps (`experiments.train_grpo_toy` is its command).

Kept apart from the command, which defines absl flags: tests import this in-process, and two
modules that define one flag name in one process fail (`DuplicateFlagError`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from flax import nnx

from hydrajax.attention.training import plan_prefill, plan_tree_prefill
from models.training import grpo, rollout
from models.training.forward import shared_forward, tree_forward


def dp_mesh(dp: int, prompts: int):
  """The step's dp mesh (None for one device); a usage error naming --dp if it cannot be."""
  if dp < 1 or prompts % dp or dp > jax.device_count():
    raise app.UsageError(f'--dp must be >= 1, divide --prompts ({prompts}) and be at most the '
                         f'{jax.device_count()} devices here, got {dp}')
  return jax.make_mesh((dp,), ('dp',), devices=jax.devices()[:dp]) if dp > 1 else None


def _step_layout(plan, mesh):
  """The step's layout: the plan's, or its dp shards' (`to_device_sharded`) with a mesh."""
  return plan.to_device() if mesh is None else plan.to_device_sharded(mesh.shape['dp'])


def group_rollouts(task, graphdef, optimizer, cfg, bp: int, g: int, mesh=None):
  """G independent completions of each of bp prompts a step: (rollout_fn, step_fn,
  make_batch). rollout_fn(params, ref_params, prompts, key) samples and scores;
  make_batch(prompts, rollouts) -> (batch without advantages, each sample's completion
  [bp * G, T], the step's layout); step_fn(params, opt_state, batch, layout) updates, data
  parallel over `mesh`'s dp if given."""
  t = task.completion_length
  plan = plan_prefill([5] * bp, g, t)
  layout = plan.to_device()  # one layout: a fixed shape
  step_layout = _step_layout(plan, mesh)

  @jax.jit
  def rollout_fn(params, ref_params, prompts, key):
    model = nnx.merge(graphdef, params)
    completions = rollout.sample_completions(model, prompts, layout.prompt_lengths, g, t, key)
    old = shared_forward(model, prompts, completions, layout)
    ref = shared_forward(nnx.merge(graphdef, ref_params), prompts, completions, layout)
    return completions, old, ref

  def make_batch(prompts, rollouts):
    """(GrpoBatch without advantages, every sample's completion [Bp * G, T], layout)."""
    completions, old, ref = rollouts
    completions = np.asarray(completions)
    batch = grpo.GrpoBatch(
        prompts=jnp.asarray(prompts), completions=jnp.asarray(completions),
        mask=jnp.asarray(rollout.completion_mask(completions)), advantages=None,
        old_logp=old, ref_logp=ref)
    return batch, completions, step_layout

  return rollout_fn, grpo.make_train_step(graphdef, optimizer, cfg, mesh=mesh), make_batch


def tree_rollouts(task, graphdef, optimizer, cfg, bp: int, g: int, b: int, l: int, mesh=None):
  """Rollout trees, each of bp prompts with b branches of l tokens and g / b continuations
  of each: (rollout_fn, step_fn, make_batch) as `group_rollouts`'."""
  t = task.completion_length
  if b < 1 or g % b:
    raise app.UsageError(f'--branches must be >= 1 and divide --group_size ({g}), got {b}')
  if not 1 <= l < t:
    raise app.UsageError(f'--branch_length must be in [1, {t - 1}], got {l}')
  # Nodes: the Bp prompts, then their branches, then each branch's G / B leaves, in row order
  # (so leaf r is prompt r // G's sample r % G, as the rewards and advantages are laid out).
  parents = ([-1] * bp + [i // b for i in range(bp * b)]
             + [bp + j // (g // b) for j in range(bp * g)])
  lengths = [5] * bp + [l] * (bp * b) + [t - l] * (bp * g)
  plan = plan_tree_prefill(parents, lengths)
  layout, step_layout = plan.to_device(), _step_layout(plan, mesh)
  prompt_lengths = jnp.full((bp,), 5, jnp.int32)

  @jax.jit
  def rollout_fn(params, ref_params, prompts, key):
    model = nnx.merge(graphdef, params)
    branch_key, leaf_key = jax.random.split(key)
    branches = rollout.sample_completions(model, prompts, prompt_lengths, b, l, branch_key)
    stems = jnp.concatenate([jnp.repeat(prompts, b, axis=0), branches], axis=1)
    leaves = rollout.sample_completions(model, stems, jnp.full((bp * b,), 5 + l, jnp.int32),
                                        g // b, t - l, leaf_key)
    levels = [prompts, branches, leaves]
    old = tree_forward(model, levels, layout)
    ref = tree_forward(nnx.merge(graphdef, ref_params), levels, layout)
    return levels, old, ref

  def make_batch(prompts, rollouts):
    """(TreeGrpoBatch without advantages, every sample's completion [Bp * G, T], layout)."""
    levels, old, ref = rollouts
    branches, leaves = np.asarray(levels[1]), np.asarray(levels[2])
    completions = np.concatenate([np.repeat(branches, g // b, axis=0), leaves], axis=1)
    mask = rollout.completion_mask(completions)  # a branch's tokens: the same in its leaves
    batch = grpo.TreeGrpoBatch(
        level_tokens=[jnp.asarray(x) for x in (prompts, branches, leaves)],
        mask=[jnp.asarray(mask[::g // b, :l]), jnp.asarray(mask[:, l:])], advantages=None,
        old_logp=old, ref_logp=ref)
    return batch, completions, step_layout

  return rollout_fn, grpo.make_tree_train_step(graphdef, optimizer, cfg, mesh=mesh), make_batch
