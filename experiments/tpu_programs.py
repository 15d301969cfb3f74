"""TPU programs built from abstract inputs for the TPU compiler (no weights, no TPU): the Mosaic
tree-attention and training kernels through their public entry points, a Llama step sharded over
a mesh of a named slice's devices, and a GRPO training step. Each function returns the compiled
program (`jax.stages.Compiled`); `pallas_kernels.tpu.aot.stats` reads its numbers.

Flag-free, so that tests import it (`experiments.tpu_aot` is the command).
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental.layout import Format, Layout

import hydrajax as hj
from hydrajax.attention import parallel
from hydrajax.attention.training import plan_prefill, prefill_attention
from models import sharding_rules as sr
from models.llama import init_model
from models.kv_cache import KVCache, cache_sharding
from models.training import grpo
from pallas_kernels.tpu import aot


def abstract_model(config, mesh, dtype=jnp.bfloat16):
  """(graphdef, params): the model's parameters as structs placed by the rules table (none made)."""
  model = nnx.eval_shape(lambda: init_model(config, mesh=mesh, dtype=dtype))
  graphdef, params = nnx.split(model, nnx.Param)
  shardings = sr.param_shardings(params, mesh)
  params = jax.tree.map(
      lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), params,
      shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, params


def model_step(config, mesh, *, rows: int, query_tokens: int, plan: hj.SharingPlan,
               impl='mosaic_tpu', compiler_lays_out_cache: bool = False):
  """The compiled tree-attention model call (rows x query_tokens tokens over `plan`'s cache).

  `compiler_lays_out_cache`: the cache argument and result in the layout the compiler chooses
  (`Layout.AUTO`) instead of the default one (`experiments.tpu_cache_layout`)."""
  graphdef, params = abstract_model(config, mesh)
  dp = sr.axis_size(mesh, sr.DP)
  heads = config.num_kv_heads * sr.kv_replication(config.num_heads, config.num_kv_heads, mesh)
  shape = (config.num_layers, plan.kv_tokens * dp, heads, config.head_dim)
  cache_struct = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=cache_sharding(mesh, shape))
  cache = KVCache(cache_struct, cache_struct)
  rows_sharding = sr.named_sharding(mesh, (sr.DP,) if dp > 1 else ())
  ids = jax.ShapeDtypeStruct((rows * dp, query_tokens), jnp.int32, sharding=rows_sharding)
  if dp > 1:
    layout = parallel.stack_layouts([plan] * dp)
  else:
    layout = plan.to_device()
  layout = aot.placed(layout, rows_sharding)

  def step(params, cache, tokens, positions, slots, layout):
    return nnx.merge(graphdef, params)(tokens, positions, cache, slots, layout, impl=impl)

  options = {}
  if compiler_lays_out_cache:
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    auto = Format(Layout.AUTO, cache_struct.sharding)
    options = dict(in_shardings=(shardings(params), KVCache(auto, auto), rows_sharding,
                                 rows_sharding, rows_sharding, shardings(layout)),
                   out_shardings=(rows_sharding, KVCache(auto, auto)))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return jax.jit(step, donate_argnums=1, **options).lower(
        params, cache, ids, ids, ids, layout).compile()


def decode_plan(batch: int, prefix: int, private: int = 128) -> hj.SharingPlan:
  return hj.plan_tree(hj.PromptNode(prefix, num_samples=batch), private_capacity=private)


def tree_attention_kernels(topology, *, batch, prefix, heads, kv_heads, head_dim,
                           dtype=jnp.bfloat16, query_tokens=1, block_sizes=None):
  """The compiled `hj.tree_attention(impl='mosaic_tpu')` on one chip of `topology`: `batch`
  rows of `query_tokens` tokens under one `prefix`-token prompt; `block_sizes` None: the
  chip's entry of `pallas_kernels.tpu.block_sizes`."""
  mesh = aot.mesh(topology)
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  plan = decode_plan(batch, prefix, private=max(16, query_tokens))
  q = jax.ShapeDtypeStruct((plan.num_rows, query_tokens, heads, head_dim), dtype, sharding=one)
  kv = jax.ShapeDtypeStruct((plan.kv_tokens, kv_heads, head_dim), dtype, sharding=one)
  attend = lambda q, k, v, layout: hj.tree_attention(q, k, v, layout, impl='mosaic_tpu',
                                                     config=block_sizes)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return jax.jit(attend).lower(q, kv, kv, aot.placed(plan.to_device(), one)).compile()


def padded_tree_attention(topology, *, batch, prefix, heads, kv_heads, head_dim, padded_dim,
                          dtype=jnp.bfloat16):
  """The same call with q, K and V zero-padded from `head_dim` to `padded_dim` first (the
  alternative to packing heads: the scale stays head_dim's)."""
  mesh = aot.mesh(topology)
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  plan = decode_plan(batch, prefix, private=16)
  q = jax.ShapeDtypeStruct((plan.num_rows, 1, heads, head_dim), dtype, sharding=one)
  kv = jax.ShapeDtypeStruct((plan.kv_tokens, kv_heads, head_dim), dtype, sharding=one)
  pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded_dim - head_dim)])

  def attend(q, k, v, layout):
    out, lse = hj.tree_attention(pad(q), pad(k), pad(v), layout, impl='mosaic_tpu',
                                 scale=head_dim**-0.5)
    return out[..., :head_dim], lse

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return jax.jit(attend).lower(q, kv, kv, aot.placed(plan.to_device(), one)).compile()


def training_kernels(topology, *, prompt=2048, group=2, completion=512, heads=32, kv_heads=8,
                     head_dim=128, dtype=jnp.bfloat16):
  """The compiled gradient of `prefill_attention(impl='mosaic_tpu')` on one chip: every part's
  forward, dK/dV and dQ kernels."""
  mesh = aot.mesh(topology)
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  layout = plan_prefill([prompt], group, completion).to_device()
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
  q_p, q_c = struct(1, prompt, heads, head_dim), struct(group, completion, heads, head_dim)
  kv = struct(layout.kv_tokens, kv_heads, head_dim)

  def loss(q_p, q_c, k, v, layout):
    p, c = prefill_attention(q_p, q_c, k, v, layout, impl='mosaic_tpu')
    return jnp.sum(p.out.astype(jnp.float32)) + jnp.sum(c.out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return grad.lower(q_p, q_c, kv, kv, aot.placed(layout, one)).compile()


def grpo_step(config, mesh, *, prompts=1, group=4, prompt=512, completion=256, impl='mosaic_tpu'):
  """The compiled GRPO training step (loss, gradients, Adam update) of `config` on `mesh`."""
  graphdef, params = abstract_model(config, mesh)
  optimizer = optax.adam(1e-6)
  opt_state = jax.eval_shape(optimizer.init, params)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  b = prompts * group
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  batch = grpo.GrpoBatch(prompts=s((prompts, prompt), jnp.int32),
                         completions=s((b, completion), jnp.int32),
                         mask=s((b, completion), jnp.float32), advantages=s((b,), jnp.float32),
                         old_logp=s((b, completion), jnp.float32),
                         ref_logp=s((b, completion), jnp.float32))
  layout = aot.placed(plan_prefill([prompt] * prompts, group, completion).to_device(), rep)
  step = grpo.make_train_step(graphdef, optimizer, grpo.GrpoConfig(), impl=impl)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return step.jitted.lower(params, opt_state, batch, layout).compile()
