"""A GRPO-style policy-gradient step (group-relative advantages, clipped ratio, KL to a reference).

For each prompt, G completions are sampled and scored; the advantage of a
completion is its reward standardised within its group. The loss per token is
(DeepSeekMath, GRPO):

    ratio = exp(logp - old_logp)
    pg    = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1        (the k3 estimator)
    loss  = mean over samples of (sum over valid tokens of pg + beta * kl) / valid tokens

`old_logp` and `ref_logp` come from the rollout (constants here). The forward
is either `shared_forward` (each prompt once; hydrajax tree attention) or
`unshared_forward` (the per-sample ground truth): same loss, same gradients.

Over a rollout tree (`tree_grpo_loss`, with `models.training.forward.tree_forward`) every
leaf is a sample whose completion is its path below the root; each shared token is computed
once and weighted by the leaves below it.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.attention.training import PrefillLayout
from hydrajax.attention.training import tree_prefill as tp
from models.training.forward import shared_forward, tree_forward, unshared_forward
from models.training.parallel import data_parallel, on_one_mesh


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """clip_eps: ratio clip range; kl_coef: beta; adv_eps: added to the group std."""

  clip_eps: float = 0.2
  kl_coef: float = 0.04
  adv_eps: float = 1e-4

  def __post_init__(self):
    if not 0 < self.clip_eps < 1:
      raise ValueError(f'GrpoConfig.clip_eps must be in (0, 1), got {self.clip_eps}')
    if self.kl_coef < 0:
      raise ValueError(f'GrpoConfig.kl_coef must be >= 0, got {self.kl_coef}')
    if self.adv_eps <= 0:
      raise ValueError(f'GrpoConfig.adv_eps must be > 0, got {self.adv_eps}')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrpoBatch:
  """One step's data; B = Bp * G rows, row r continues prompt r // G."""

  prompts: jax.Array  # [Bp, P] int32, right-padded
  completions: jax.Array  # [B, T] int32, right-padded
  mask: jax.Array  # [B, T] float32: 1 on the tokens that count
  advantages: jax.Array  # [B] float32
  old_logp: jax.Array  # [B, T] float32: the sampling policy's log-probs
  ref_logp: jax.Array  # [B, T] float32: the reference policy's log-probs


def group_advantages(rewards: jax.Array, config: GrpoConfig = GrpoConfig()) -> jax.Array:
  """rewards [Bp, G] -> advantages [Bp * G]: standardised within each group."""
  if rewards.ndim != 2:
    raise ValueError(f'rewards must be [Bp, G], got shape {rewards.shape}')
  mean = jnp.mean(rewards, axis=1, keepdims=True)
  std = jnp.std(rewards, axis=1, keepdims=True)
  return ((rewards - mean) / (std + config.adv_eps)).reshape(-1)


def grpo_loss(logp, batch: GrpoBatch, config: GrpoConfig) -> tuple[jax.Array, dict[str, Any]]:
  """logp [B, T] of the trained policy -> (scalar loss, metrics)."""
  ratio = jnp.exp(logp - batch.old_logp)
  adv = batch.advantages[:, None]
  pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv)
  log_ref_ratio = batch.ref_logp - logp
  kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1
  tokens = jnp.maximum(jnp.sum(batch.mask, axis=1), 1.0)
  per_sample = lambda x: jnp.sum(x * batch.mask, axis=1) / tokens
  loss = jnp.mean(per_sample(pg + config.kl_coef * kl))
  clipped = (jnp.abs(ratio - 1) > config.clip_eps).astype(jnp.float32)
  metrics = dict(loss=loss, kl=jnp.mean(per_sample(kl)),
                 clip_fraction=jnp.mean(per_sample(clipped)))
  return loss, metrics


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeGrpoBatch:
  """One step's data over a rollout tree (`hydrajax.attention.training.tree_prefill`).

  Each leaf is a sample: its completion is every scored token on its root-to-leaf path below
  the root (levels d >= 1; the root is the prompt). Lists hold one [B_d, C_d] array a level
  from level 1 on, the plan's rows.
  """

  level_tokens: list[jax.Array]  # [B_d, C_d] int32 for every level, the root's included
  mask: list[jax.Array]  # [B_d, C_d] float32 a level >= 1: 1 on the tokens that count
  advantages: jax.Array  # [paths] float32, one a leaf in `TreePrefillLayout` path order
  old_logp: list[jax.Array]  # [B_d, C_d] float32 a level >= 1
  ref_logp: list[jax.Array]  # [B_d, C_d] float32 a level >= 1


def _leaf_weights(layout, batch: TreeGrpoBatch):
  """Per token (levels >= 1), the sums over the leaves below it of A / n, split by A's sign,
  and of 1 / n (n: the leaf's counted tokens), each over the number of leaves: a token shared
  by several samples counts once with their summed weights."""
  root = jnp.zeros(layout.level_shapes[0], jnp.float32)  # the prompt: never counted
  counted = tp.write_tree_kv(layout, [root] + list(batch.mask))  # [L] in the buffer's order
  valid = jnp.arange(layout.path_tokens.shape[1])[None, :] < layout.path_lengths[:, None]
  mask = jnp.where(valid, counted[layout.path_tokens], 0.0)  # [paths, S]
  tokens = jnp.maximum(jnp.sum(mask, axis=1), 1.0)
  paths = batch.advantages.shape[0]
  per_leaf = lambda w: tp.tree_levels(layout, jnp.zeros(layout.kv_tokens).at[
      layout.path_tokens].add(jnp.where(valid, (w / tokens / paths)[:, None], 0.0)))[1:]
  adv = batch.advantages
  return (per_leaf(jnp.where(adv >= 0, adv, 0.0)), per_leaf(jnp.where(adv < 0, adv, 0.0)),
          per_leaf(jnp.ones_like(adv)))


def tree_grpo_loss(level_logp, batch: TreeGrpoBatch, layout,
                   config: GrpoConfig) -> tuple[jax.Array, dict[str, Any]]:
  """`grpo_loss` over a rollout tree, each shared token computed once.

  level_logp: [B_d, C_d] a level >= 1 (`tree_forward`). The same loss as `grpo_loss` over every
  leaf's path as its own sample: per token, min(r A, clip(r) A) summed over the leaves below it
  is W+ min(r, clip(r)) + W- max(r, clip(r)), W+ and W- its leaves' positive and negative
  A / n summed, so the sum needs no per-leaf copy of the token.
  """
  if batch.advantages.shape != layout.path_lengths.shape:
    raise ValueError(f'advantages must be [paths] = {layout.path_lengths.shape}, got '
                     f'{batch.advantages.shape}')
  w_pos, w_neg, w_kl = _leaf_weights(layout, batch)
  loss = kl_total = clipped_total = 0.0
  for logp, old, ref, mask, pos, neg, kl_w in zip(level_logp, batch.old_logp, batch.ref_logp,
                                                   batch.mask, w_pos, w_neg, w_kl):
    ratio = jnp.exp(logp - old)
    clipped = jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps)
    pg = -(pos * jnp.minimum(ratio, clipped) + neg * jnp.maximum(ratio, clipped))
    log_ref_ratio = ref - logp
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1
    loss += jnp.sum(mask * (pg + config.kl_coef * kl_w * kl))
    kl_total += jnp.sum(mask * kl_w * kl)
    clipped_total += jnp.sum(mask * kl_w * (jnp.abs(ratio - 1) > config.clip_eps))
  return loss, dict(loss=loss, kl=kl_total, clip_fraction=clipped_total)


def policy_logprobs(model, batch: GrpoBatch, layout: PrefillLayout, *, shared: bool = True,
                    kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                    interpret: bool = False) -> jax.Array:
  """log p(batch.completions) [B, T] under `model`, shared or per-sample forward.

  impl, interpret: the shared forward's attention kernels (`prepare_prefill_attention`).
  """
  if shared:
    return shared_forward(model, batch.prompts, batch.completions, layout, kv_block=kv_block,
                          impl=impl, interpret=interpret)
  return unshared_forward(model, batch.prompts, batch.completions, layout.prompt_lengths,
                          layout.group_size)


def loss_and_grads(graphdef, params, batch: GrpoBatch, layout: PrefillLayout,
                   config: GrpoConfig, *, shared: bool = True, kv_block: int = 1024,
                   impl: AttentionImpl | str = AttentionImpl.XLA, interpret: bool = False):
  """((loss, metrics), grads) with respect to the parameter state `params`."""

  def loss(params):
    model = nnx.merge(graphdef, params)
    logp = policy_logprobs(model, batch, layout, shared=shared, kv_block=kv_block, impl=impl,
                           interpret=interpret)
    return grpo_loss(logp, batch, config)

  return jax.value_and_grad(loss, has_aux=True)(params)


def tree_loss_and_grads(graphdef, params, batch: TreeGrpoBatch, layout, config: GrpoConfig, *,
                        kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                        interpret: bool = False):
  """((loss, metrics), grads) of `tree_grpo_loss` over `tree_forward`, each node computed once.

  layout: `plan_tree_prefill(...).to_device()`; impl, interpret: the attention's kernels
  (`prepare_tree_prefill`).
  """

  def loss(params):
    logp = tree_forward(nnx.merge(graphdef, params), batch.level_tokens, layout,
                        kv_block=kv_block, impl=impl, interpret=interpret)
    return tree_grpo_loss(logp, batch, layout, config)

  return jax.value_and_grad(loss, has_aux=True)(params)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, config: GrpoConfig, *,
                    shared: bool = True, kv_block: int = 1024,
                    impl: AttentionImpl | str = AttentionImpl.XLA, interpret: bool = False,
                    mesh: Mesh | None = None):
  """A step (params, opt_state, batch, layout) -> (params, opt_state, metrics): one jitted
  program (`step.jitted`) that takes the state donated, after `on_one_mesh` puts the state
  where its outputs will be (so a loop compiles it once).

  impl, interpret: the shared forward's attention kernels (`prepare_prefill_attention`).
  mesh: data parallel over its `dp` axis (`data_parallel`): layout is then
  `plan.to_device_sharded(dp)`, and each shard trains on its block of the batch's prompts. A
  model made on a mesh with `tp` trains tensor parallel (`models.training.forward`); with
  both, pass that mesh here too.
  """
  return _optimizer_step(lambda params, batch, layout: loss_and_grads(
      graphdef, params, batch, layout, config, shared=shared, kv_block=kv_block, impl=impl,
      interpret=interpret), optimizer, mesh)


def make_tree_train_step(graphdef, optimizer: optax.GradientTransformation, config: GrpoConfig,
                         *, kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                         interpret: bool = False, mesh: Mesh | None = None):
  """`make_train_step` over a rollout tree: a step (params, opt_state, batch:
  TreeGrpoBatch, layout: TreePrefillLayout) -> (params, opt_state, metrics), its gradients from
  `tree_loss_and_grads` (each node computed once). mesh: data parallel over `dp`, layout
  `plan.to_device_sharded(dp)` (shard d: block d of the roots and of every level's rows)."""
  return _optimizer_step(lambda params, batch, layout: tree_loss_and_grads(
      graphdef, params, batch, layout, config, kv_block=kv_block, impl=impl,
      interpret=interpret), optimizer, mesh)


def _optimizer_step(grads, optimizer: optax.GradientTransformation, mesh: Mesh | None):
  """The step of `grads(params, batch, layout) -> ((loss, metrics), grads)` (see
  `make_train_step`)."""
  if mesh is not None:
    grads = data_parallel(grads, mesh)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def jitted(params, opt_state, batch, layout):
    (_, metrics), g = grads(params, batch, layout)
    updates, opt_state = optimizer.update(g, opt_state, params)
    metrics['grad_norm'] = optax.tree.norm(g)
    return optax.apply_updates(params, updates), opt_state, metrics

  def step(params, opt_state, batch, layout):
    return jitted(*on_one_mesh((params, opt_state), mesh), batch, layout)

  step.jitted = jitted  # e.g. step.jitted._cache_size(): the programs compiled so far
  return step
