"""The Llama family in Flax NNX, with attention over a hydrajax sharing layout.

Interface (the engine and generation build on it; keep it stable):

    model = Llama(config, rngs=nnx.Rngs(0))
    logits, cache = model(tokens, positions, cache, write_slots, layout, impl=AttentionImpl.AUTO)

  tokens       [B, T] int32   token ids of the T new tokens of each of the B rows
  positions    [B, T] int32   their sequence positions (RoPE)
  cache        KVCache        k, v [num_layers, L, K, H]: one flat buffer per layer, the buffers
                              a hydrajax `TreeLayout` indexes (`L % layout.page_size == 0`)
  write_slots  [B, T] int32   flat token index in [0, L) where each new token's K/V is written;
                              an index >= L drops the write (padding)
  layout       TreeLayout     what each row attends: its shared segments and private pages;
               or AttentionPlan  the row's T query tokens are its last T private tokens. A plan
                              (`model.prepare_attention`, once per tree change) is used as is;
                              a layout is prepared once per call, outside the layer loop
  impl         AttentionImpl, its string, or ModelMode.TREE / NO_ATTENTION (ignored with a plan)
  logits       [B, T, V] float32; the updated cache is returned (donate it under jit)

Each layer: RMSNorm, q/k/v projections, RoPE at `positions`, K/V scattered
into the cache at `write_slots`, then `hydrajax.attend(q, k_all, v_all, plan,
kv_offset=layer * L)`, output projection, residual, RMSNorm, SwiGLU MLP,
residual. So as not to copy a layer's buffer out of the stacked cache, `k_all,
v_all` are the whole cache viewed as `[num_layers * L, K, H]` and the layer is
a scalar token offset into it: the plan (gather indices, work lists) is the
same for every layer, and what it derives from the step's private lengths
(`AttentionPlan.for_step`) is built once before the layers.

The layers are a Python loop over per-layer parameters, not a `lax.scan`
over stacked ones: under a scan XLA materialises every layer's weight slice
before its matmuls (seen in the optimised HLO), which doubles the weight
traffic of a memory-bound decode step. The price is a longer compile.

`ModelMode` names the three ways to run the model: TREE (tree attention over
a layout), DENSE (`forward_naive`: dense per-sequence caches
(`DenseKVCache`) and `hydrajax.naive_attention`, the ground truth) and
NO_ATTENTION (every projection and the cache writes, without the attention
product: the attention output is the query itself; the throughput ceiling of
the Hydragen paper).

Parameters carry `logical_axes` metadata (see `models.sharding_rules`). With
`mesh=` (`Llama(..., mesh=mesh)` or `init_model`) the
forward pass is tensor and data parallel: the q/k/v and gate/up projections
are column-parallel (heads, MLP hidden on `tp`), wo and w_down row-parallel
(one all-reduce each per layer), and each layer's cache write and attention
are one `jax.shard_map` (`hydrajax.attention.parallel.write_and_attend`).
"""

import contextvars
import enum
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import hydrajax
from hydrajax import AttentionImpl, AttentionPlan, AttentionShapes, TreeLayout
from hydrajax.attention import parallel
from models import sharding_rules as sr
from models.config import LlamaConfig
from models.kv_cache import DenseKVCache, KVCache
from models.rope import apply_rope, inverse_frequencies


class ModelMode(enum.Enum):
  """How the model runs attention (see the module docstring)."""

  TREE = 'tree'  # tree attention over a sharing layout (the implementation: an AttentionImpl)
  DENSE = 'dense'  # per-sequence dense caches and naive attention: the ground truth
  NO_ATTENTION = 'no_attention'  # projections and cache writes without the attention product


def parse_impl(impl) -> tuple[ModelMode, AttentionImpl | None]:
  """(mode, attention implementation) of an `AttentionImpl`, a `ModelMode` or their strings.

  TREE runs AUTO. The attention implementation is None unless the
  mode is TREE.
  """
  if isinstance(impl, ModelMode):
    return impl, (AttentionImpl.AUTO if impl is ModelMode.TREE else None)
  if isinstance(impl, AttentionImpl):
    return ModelMode.TREE, impl
  if isinstance(impl, str):
    for enum_type in (AttentionImpl, ModelMode):
      try:
        return parse_impl(enum_type(impl))
      except ValueError:
        pass
  names = [i.value for i in AttentionImpl] + [m.value for m in ModelMode]
  raise ValueError(f'impl must be an AttentionImpl, a ModelMode or one of {names}, got {impl!r}')


# Where `_param` puts a new parameter: None (the default device), or a function of its logical
# axes and shape giving its sharding (`init_model` sets it), so that each device
# draws only its own slices. One small jitted draw per distinct (shape, sharding): a 32-layer
# model compiles a handful of programs, where one jitted init of the whole model took minutes
# of compile on the GPU.
PARAM_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar('param_placement', default=None)


@functools.lru_cache(maxsize=None)
def _draw(shape, dtype, std, sharding):
  def draw(key):
    if std is None:  # norm weights start at one
      return jnp.ones(shape, dtype)
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return jax.jit(draw, out_shardings=sharding)


def _param(rngs: nnx.Rngs, shape, names, dtype, std: float | None) -> nnx.Param:
  key = None if std is None else rngs.params()
  placement = PARAM_PLACEMENT.get()
  if placement is None:
    if std is None:
      value = jnp.ones(shape, dtype)
    else:
      value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  else:
    value = _draw(tuple(shape), jnp.dtype(dtype), std, placement(names, shape))(key)
  return nnx.Param(value, logical_axes=names)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x [..., D]: normalised in float32, cast back, scaled (HF LlamaRMSNorm)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


class DecoderLayer(nnx.Module):
  """One decoder block's parameters (the forward pass is `Llama`'s layer loop)."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    c = config
    self.attn_norm = _param(rngs, (c.dim,), (sr.EMBED,), dtype, None)
    self.wq = _param(rngs, (c.dim, c.num_heads, c.head_dim), (sr.EMBED, sr.HEADS, sr.HEAD_DIM),
                     dtype, c.dim**-0.5)
    # K and V projections as one weight [D, 2, K, H] (k at 0, v at 1): one GEMM. Kept apart, XLA
    # merges the two products of one input into one GEMM anyway and concatenates wk and wv for
    # it on every step (a copy of both weights per layer). `fuse_qkv` also merges wq.
    self.wkv = _param(rngs, (c.dim, 2, c.num_kv_heads, c.head_dim),
                      (sr.EMBED, None, sr.KV_HEADS, sr.HEAD_DIM), dtype, c.dim**-0.5)
    self.wo = _param(rngs, (c.num_heads, c.head_dim, c.dim), (sr.HEADS, sr.HEAD_DIM, sr.EMBED),
                     dtype, (c.num_heads * c.head_dim) ** -0.5)
    self.mlp_norm = _param(rngs, (c.dim,), (sr.EMBED,), dtype, None)
    self.w_gate = _param(rngs, (c.dim, c.mlp_dim), (sr.EMBED, sr.MLP), dtype, c.dim**-0.5)
    self.w_up = _param(rngs, (c.dim, c.mlp_dim), (sr.EMBED, sr.MLP), dtype, c.dim**-0.5)
    self.w_down = _param(rngs, (c.mlp_dim, c.dim), (sr.MLP, sr.EMBED), dtype, c.mlp_dim**-0.5)

  def arrays(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name).get_value() for name in LAYER_PARAMS
            if hasattr(self, name)}


# A layer's parameters: wq and wkv, or after `Llama.fuse_qkv` the one weight wqkv.
LAYER_PARAMS = ('attn_norm', 'wq', 'wkv', 'wqkv', 'wo', 'mlp_norm', 'w_gate', 'w_up', 'w_down')
QKV_AXES = (sr.EMBED, sr.KV_HEADS, None, sr.HEAD_DIM)  # wqkv [D, S, (N + 2K) / S, H]


def fused_qkv(wq: jax.Array, wkv: jax.Array, shards: int = 1) -> jax.Array:
  """wq [D, N, H], wkv [D, 2, K, H] -> wqkv [D, S, (N + 2K) / S, H] for S = `shards` (the
  tensor-parallel degree, which must divide K): shard s's N/S query heads, then its K/S k heads,
  then its K/S v heads. At S = 1 that is [q | k | v], the order of the copy XLA makes itself
  when it merges the q and kv products; under tp each device holds whole groups."""
  d, n, h = wq.shape
  k = wkv.shape[2]
  if wkv.shape != (d, 2, k, h) or n % k:
    raise ValueError(f'fused_qkv needs wq [D, N, H] and wkv [D, 2, K, H] with K dividing N, got '
                     f'wq {wq.shape} and wkv {wkv.shape}')
  if not isinstance(shards, int) or shards < 1 or k % shards:
    raise ValueError(f'shards must be an int >= 1 dividing the kv heads K={k}, got {shards!r}')
  kv = wkv.reshape(d, 2, shards, k // shards, h)
  return jnp.concatenate([wq.reshape(d, shards, n // shards, h), kv[:, 0], kv[:, 1]], axis=2)


def split_qkv(wqkv: jax.Array, num_heads: int) -> tuple[jax.Array, jax.Array]:
  """`fused_qkv`'s inverse, given the query heads N: (wq [D, N, H], wkv [D, 2, K, H])."""
  q, k, v = _split_fused(wqkv, num_heads, axis=1)
  return q, jnp.stack([k, v], axis=1)


def _split_fused(x: jax.Array, num_heads: int, axis: int):
  """q, k, v of `x` whose dims `axis`, `axis + 1` are wqkv's [S, (N + 2K) / S] (any view: N and
  S both global or both a device's), each with the two merged into heads."""
  shards, width = x.shape[axis], x.shape[axis + 1]
  nq = num_heads // shards
  nk = (width - nq) // 2
  merge = lambda part: part.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  take = lambda start, size: merge(jax.lax.slice_in_dim(x, start, start + size, axis=axis + 1))
  return take(0, nq), take(nq, nk), take(nq + nk, nk)


def _mlp_out(p, x, eps, reduce_dtype=None):
  """The MLP's output before the residual add (in `reduce_dtype`: a device's partial sum when
  the hidden units are split)."""
  y = rms_norm(x, p['mlp_norm'], eps)
  gate = jnp.einsum('btd,df->btf', y, p['w_gate'])
  up = jnp.einsum('btd,df->btf', y, p['w_up'])
  return jnp.einsum('btf,fd->btd', jax.nn.silu(gate) * up, p['w_down'],
                    preferred_element_type=reduce_dtype)


def _mlp(p, x, eps, reduce_dtype=None):
  return x + _mlp_out(p, x, eps, reduce_dtype).astype(x.dtype)


def _qkv(p, x, positions, inv_freq, eps):
  y = rms_norm(x, p['attn_norm'], eps)
  if 'wqkv' in p:  # one product (`Llama.fuse_qkv`); wo [N, H, D] gives the view's q heads
    qkv = jnp.einsum('btd,dsjh->btsjh', y, p['wqkv'])
    q, k, v = _split_fused(qkv, p['wo'].shape[0], axis=2)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v
  # XLA merges the two products into one GEMM over wq and wkv concatenated, a copy of both
  # weights on every call. The barrier ties that copy to this layer's input: scheduled freely,
  # a step's copies of every layer could be live at once (3 GiB at CodeLlama-7B).
  wq, wkv, y = jax.lax.optimization_barrier((p['wq'], p['wkv'], y))
  q = apply_rope(jnp.einsum('btd,dnh->btnh', y, wq), positions, inv_freq)
  kv = jnp.einsum('btd,dckh->btckh', y, wkv)
  k = apply_rope(kv[:, :, 0], positions, inv_freq)
  v = kv[:, :, 1]
  return q, k, v


def _is_plan(layout) -> bool:
  """An AttentionPlan, or per-dp-shard plans stacked (`hydrajax.attention.parallel.stack_shards`)."""
  if isinstance(layout, parallel.ShardedLayout):
    layout = layout.layouts
  return isinstance(layout, AttentionPlan)


def _plan_shapes(plan) -> AttentionShapes:
  return (plan.layouts if isinstance(plan, parallel.ShardedLayout) else plan).shapes


def _check_inputs(config, tokens, positions, write_slots=None):
  if getattr(tokens, 'ndim', None) != 2:
    raise ValueError(f'tokens must be [B, T] int32, got shape {getattr(tokens, "shape", None)}')
  if positions.shape != tokens.shape:
    raise ValueError(f'positions must be [B, T] = {tokens.shape}, got {positions.shape}')
  if write_slots is not None and write_slots.shape != tokens.shape:
    raise ValueError(f'write_slots must be [B, T] = {tokens.shape}, got {write_slots.shape}')


class Llama(nnx.Module):
  """Llama 2 / Llama 3 / CodeLlama decoder; see the module docstring for the interface."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, mesh=None,
               tp_reduce_dtype=jnp.float32, tp_micro_batches: int = 1, attention_config=None):
    sr.check_mesh(config, mesh)
    if not isinstance(tp_micro_batches, int) or tp_micro_batches < 1:
      raise ValueError(f'tp_micro_batches must be an int >= 1, got {tp_micro_batches!r}')
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.mesh = sr.auto_mesh(mesh)  # static: the forward's sharding (None: one device)
    # dtype of the tensor-parallel all-reduces after wo and w_down (bf16: half the bytes, but
    # rounded twice, so tokens may differ from one device's)
    self.tp_reduce_dtype = jnp.dtype(tp_reduce_dtype)
    # Row blocks of the dense part after attention under tensor parallelism (`_after_attention`)
    self.tp_micro_batches = tp_micro_batches
    # The attention backend's frozen config when `prepare_attention` is given none (e.g. a
    # `MosaicGpuConfig` with other knobs; ignored where another backend runs). None: defaults.
    self.attention_config = attention_config
    c = config
    self.embed = _param(rngs, (c.vocab_size, c.dim), (sr.VOCAB, sr.EMBED), dtype, 1.0)
    self.layers = nnx.List([DecoderLayer(c, rngs=rngs, dtype=dtype) for _ in range(c.num_layers)])
    self.final_norm = _param(rngs, (c.dim,), (sr.EMBED,), dtype, None)
    if not c.tie_embeddings:
      self.lm_head = _param(rngs, (c.dim, c.vocab_size), (sr.EMBED, sr.VOCAB), dtype, c.dim**-0.5)

  @property
  def qkv_fused(self) -> bool:
    return hasattr(self.layers[0], 'wqkv')

  @property
  def can_fuse_qkv(self) -> bool:
    """Whether `fuse_qkv` can run: tp divides the kv heads (no kv head replicated)."""
    c = self.config
    return sr.kv_replication(c.num_heads, c.num_kv_heads, self.mesh) == 1

  def fuse_qkv(self, *, required: bool = True) -> 'Llama':
    """Each layer's wq and wkv become one weight `wqkv` [D, S, (N + 2K) / S, H] (`fused_qkv`,
    S the mesh's tp, 1 without one), in place; returns the model. `required=False`: only where
    it can (`can_fuse_qkv`), else the model stays as it is.

    Why: left apart, XLA merges the q, k and v products of one input into one GEMM anyway and
    concatenates wq and wkv for it on every decode step; fused, that concatenation is made
    once. `load_hf_checkpoint` and `restore_params` call it by default where tp divides the kv
    heads (under tensor parallelism the kv heads are split over tp; fewer than tp: ValueError,
    or apart with `required=False`). One layer at a time, so memory grows by one layer's q/k/v
    weights at most. `save_params` writes wq and wkv again.
    """
    c, mesh = self.config, self.mesh
    if self.qkv_fused or not (required or self.can_fuse_qkv):
      return self
    if not self.can_fuse_qkv:
      raise ValueError(f'fuse_qkv needs the kv heads K={c.num_kv_heads} split over '
                       f'tp={sr.axis_size(mesh, sr.TP)} (tp must divide K)')
    shards = sr.axis_size(mesh, sr.TP)
    shape = (c.dim, shards, (c.num_heads + 2 * c.num_kv_heads) // shards, c.head_dim)
    sharding = None if mesh is None else sr.named_sharding(
        mesh, sr.partition_spec(QKV_AXES, mesh=mesh, shape=shape))
    fuse = jax.jit(functools.partial(fused_qkv, shards=shards), out_shardings=sharding)
    for layer in self.layers:
      wqkv = fuse(layer.wq.get_value(), layer.wkv.get_value())
      del layer.wq, layer.wkv
      layer.wqkv = nnx.Param(wqkv, logical_axes=QKV_AXES)
    return self

  def inv_freq(self) -> jax.Array:
    c = self.config
    return jnp.asarray(inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))

  def logits(self, h: jax.Array) -> jax.Array:
    """h [..., D] (after the final norm) -> logits [..., V] float32."""
    if self.config.tie_embeddings:
      return jnp.einsum('...d,vd->...v', h, self.embed.get_value(),
                        preferred_element_type=jnp.float32)
    return jnp.einsum('...d,dv->...v', h, self.lm_head.get_value(),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens, positions, cache: KVCache, write_slots,
               layout: TreeLayout | AttentionPlan, *, impl=AttentionImpl.AUTO):
    """Tree-attention forward; returns (logits [B, T, V] float32, cache)."""
    h, cache = self.forward_hidden(tokens, positions, cache, write_slots, layout, impl=impl)
    return self.logits(h), cache

  def attention_shapes(self, num_rows: int, query_tokens: int, cache: KVCache) -> AttentionShapes:
    """The static shapes of this model's attention calls over `cache` (one layer's buffer).

    With a mesh, those of one device's call: B/dp rows, N/tp heads, K'/tp kv heads (K' the
    cache's kv heads, replicated when K < tp), L/dp tokens of its own buffer.
    """
    c = self.config
    tp, dp = sr.axis_size(self.mesh, sr.TP), sr.axis_size(self.mesh, sr.DP)
    return AttentionShapes(num_rows // dp, query_tokens, c.num_heads // tp, cache.k.shape[2] // tp,
                           c.head_dim, cache.k.shape[1] // dp, self.dtype, cache.k.dtype)

  def prepare_attention(self, layout: TreeLayout, *, query_tokens: int, cache: KVCache,
                        impl=AttentionImpl.AUTO, config=None, interpret: bool = False):
    """The `AttentionPlan` of every layer's attention over `layout` (once per tree change).

    Returns the layout itself for `ModelMode.NO_ATTENTION` (nothing to plan).
    """
    mode, attention = parse_impl(impl)
    if mode is ModelMode.NO_ATTENTION:
      return layout
    if mode is not ModelMode.TREE:
      raise ValueError(f'impl={impl!r} does not run on a tree layout (use forward_naive)')
    shapes = self.attention_shapes(layout.num_rows, query_tokens, cache)
    if config is None:  # the model's config, where the chosen backend is its own
      config = (self.attention_config,)
    prepare = lambda lay: hydrajax.prepare_attention(lay, shapes, impl=attention, config=config,
                                                     interpret=interpret)
    if isinstance(layout, parallel.ShardedLayout):  # dp: each shard's plan, stacked
      return parallel.stack_shards([prepare(jax.tree.map(lambda x: x[d], layout.layouts))
                                    for d in range(layout.num_shards)],
                                   sharding=self._shard_leading(layout.num_shards))
    return prepare(layout)

  def _shard_leading(self, num_shards: int) -> 'jax.sharding.NamedSharding | None':
    """Where stacked per-dp-shard plans live: their leading axis over dp, replicated over tp
    (None without a mesh of `num_shards` dp shards)."""
    if sr.axis_size(self.mesh, sr.DP) != num_shards or num_shards == 1:
      return None
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(sr.DP))

  def forward_hidden(self, tokens, positions, cache: KVCache, write_slots,
                     layout: TreeLayout | AttentionPlan, *, impl=AttentionImpl.AUTO):
    """Like `__call__` but returns the final-norm hidden states [B, T, D] instead of logits."""
    c = self.config
    _check_inputs(c, tokens, positions, write_slots)
    mesh = self.mesh
    cache.check(c, sr.kv_replication(c.num_heads, c.num_kv_heads, mesh))
    plan = layout if _is_plan(layout) else None
    if plan is not None:
      layout = plan.layout if isinstance(plan, AttentionPlan) else plan
    if not isinstance(layout, (TreeLayout, parallel.ShardedLayout)):
      raise ValueError(f'layout must be a TreeLayout or an AttentionPlan, got {type(layout).__name__}')
    if layout.num_rows != tokens.shape[0]:
      raise ValueError(f'layout has {layout.num_rows} rows but tokens has B={tokens.shape[0]}')
    num_layers, length, kh, hd = cache.k.shape
    if (length // sr.axis_size(mesh, sr.DP)) % layout.page_size:
      raise ValueError(
          f'cache L={length} (per dp shard) must be a multiple of layout.page_size='
          f'{layout.page_size}')
    if num_layers * length >= 2**31:
      raise ValueError(f'num_layers * L = {num_layers * length} does not fit int32 indices')
    b, t = tokens.shape
    if plan is None:
      plan = self.prepare_attention(layout, query_tokens=t, cache=cache, impl=impl)
      if not _is_plan(plan):
        plan = None  # NO_ATTENTION
    elif _plan_shapes(plan) != self.attention_shapes(b, t, cache):
      raise ValueError(f'the plan was prepared for {_plan_shapes(plan)}, not '
                       f'{self.attention_shapes(b, t, cache)}')
    if plan is not None:  # what the backend derives from this step's lengths: once, not a layer
      plan = plan.for_step()
    replicas = sr.kv_replication(c.num_heads, c.num_kv_heads, mesh)
    reduce = self.tp_reduce_dtype if sr.axis_size(mesh, sr.TP) > 1 else None
    inv_freq = self.inv_freq()
    hidden = (sr.BATCH, None, sr.EMBED)  # x is replicated over tp between the blocks
    x = sr.constrain(self._embed(tokens), hidden, mesh)  # [B, T, D]
    k_all, v_all = cache.k, cache.v
    for index, layer in enumerate(self.layers):
      p = layer.arrays()
      q, k, v = _qkv(p, x, positions, inv_freq, c.norm_eps)
      if replicas > 1:  # K < tp: each device keeps the one kv head its query heads read
        k, v = jnp.repeat(k, replicas, axis=2), jnp.repeat(v, replicas, axis=2)
      # The cache write and the attention of this layer: one shard_map with a mesh.
      attn, k_all, v_all = parallel.write_and_attend(
          q, k, v, k_all, v_all, write_slots, layout if plan is None else plan, layer=index,
          impl=None if plan is None else AttentionImpl.AUTO, mesh=mesh, axes=sr.attention_axes())
      if plan is None:  # NO_ATTENTION
        attn = q
      x = self._after_attention(layer, p, x, attn, reduce, hidden)
    cache = KVCache(k_all, v_all)
    return rms_norm(x, self.final_norm.get_value(), c.norm_eps), cache

  def _after_attention(self, layer, p, x, attn, reduce, hidden):
    """The output projection and the MLP, each ending in one all-reduce under tensor parallelism.

    Row parallel: each device's partial sum, all-reduced in `reduce` (float32 by default: the
    one rounding to the model dtype then matches one device's, so greedy tokens do too). With
    `tp_micro_batches` = n > 1 see `_after_attention_in_blocks`.
    """
    mesh, eps = self.mesh, self.config.norm_eps
    n = self.tp_micro_batches
    specs = self._row_parallel_specs(layer) if n > 1 and reduce is not None else None
    if specs is not None and sr.axis_size(mesh, sr.DP) == 1 and x.shape[0] % n == 0:
      return self._after_attention_in_blocks(p, x, attn, reduce, specs)
    out = jnp.einsum('btnh,nhd->btd', attn, p['wo'], preferred_element_type=reduce)
    x = sr.constrain(x + out.astype(x.dtype), hidden, mesh)
    return sr.constrain(_mlp(p, x, eps, reduce), hidden, mesh)

  def _row_parallel_specs(self, layer: DecoderLayer):
    """Partition specs of wo and the MLP's weights (name -> spec, from their logical axes) when
    wo's heads and the MLP's hidden units are both split over tp (else None)."""
    every = sr.param_partition_specs(nnx.state(layer, nnx.Param), mesh=self.mesh)
    specs = {name: every[name] for name in ('wo', 'mlp_norm', 'w_gate', 'w_up', 'w_down')}
    if specs['wo'][0] != sr.TP or specs['w_down'][0] != sr.TP or any(specs['mlp_norm']):
      return None
    return specs

  def _after_attention_in_blocks(self, p, x, attn, reduce, specs):
    """`_after_attention` with the rows in `tp_micro_batches` blocks, in one `jax.shard_map`.

    Each block's all-reduces are explicit psums, and each psum's input is tied to the result
    of the one before it (`optimization_barrier`): the reductions run in a fixed order, XLA's
    all-reduce combiner cannot merge them back into one, and a block's all-reduce can run
    beside the next block's matmuls (XLA's latency-hiding scheduler places them). Every row
    computes as in one block.
    """
    eps, n = self.config.norm_eps, self.tp_micro_batches

    def body(x, attn, w):
      xs, attns = jnp.split(x, n), jnp.split(attn, n)
      done = None

      def all_reduce(part):  # after the previous block's reduction
        nonlocal done
        if done is not None:
          part, _ = jax.lax.optimization_barrier((part, done))
        done = jax.lax.psum(part, sr.TP)
        return done.astype(x.dtype)

      for i in range(n):
        xs[i] = xs[i] + all_reduce(
            jnp.einsum('btnh,nhd->btd', attns[i], w['wo'], preferred_element_type=reduce))
      for i in range(n):
        xs[i] = xs[i] + all_reduce(_mlp_out(w, xs[i], eps, reduce))
      return jnp.concatenate(xs)

    replicated = jax.sharding.PartitionSpec()
    heads = jax.sharding.PartitionSpec(None, None, sr.TP, None)
    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(replicated, heads, specs),
                       out_specs=replicated)
    return fn(x, attn, {name: p[name] for name in specs})

  def _embed(self, tokens):
    """tokens [B, T] -> [B, T, D]; a vocab-sharded table is read locally and summed."""
    table = self.embed.get_value()
    spec = sr.partition_spec((sr.VOCAB, sr.EMBED), mesh=self.mesh, shape=table.shape)
    return parallel.embedding_lookup(table, tokens, mesh=self.mesh, vocab_axis=spec[0],
                                     batch_axis=sr.attention_axes().batch)

  def forward_naive(self, tokens, positions, cache: DenseKVCache):
    """The ground truth: per-sequence dense caches and `hydrajax.naive_attention`.

    Row b's new tokens are written at indices `positions[b]` of its dense
    cache (>= S drops) and attend its first `positions[b, -1] + 1` tokens
    (causal among the new ones). Returns (logits [B, T, V] float32, cache).
    """
    c = self.config
    _check_inputs(c, tokens, positions)
    b, t = tokens.shape
    cache.check(c, b)
    s = cache.k.shape[2]
    inv_freq = self.inv_freq()
    x = self.embed.get_value()[tokens]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    kv_lengths = positions[:, -1] + 1
    k_all, v_all = cache.k, cache.v
    for index, layer in enumerate(self.layers):
      p = layer.arrays()
      q, k, v = _qkv(p, x, positions, inv_freq, c.norm_eps)
      k_all = k_all.at[index, rows, positions].set(k.astype(k_all.dtype), mode='drop')
      v_all = v_all.at[index, rows, positions].set(v.astype(v_all.dtype), mode='drop')
      attn = hydrajax.naive_attention(
          q, k_all[index], v_all[index], jnp.minimum(kv_lengths, s)).out.astype(x.dtype)
      x = x + jnp.einsum('btnh,nhd->btd', attn, p['wo'])
      x = _mlp(p, x, c.norm_eps)
    h = rms_norm(x, self.final_norm.get_value(), c.norm_eps)
    return self.logits(h), DenseKVCache(k_all, v_all)


def init_model(config: LlamaConfig, *, mesh=None, seed: int = 0, dtype=None,
               **llama_kwargs) -> Llama:
  """A `Llama` with random parameters created straight in their shards (no whole copy anywhere).

  Each parameter is drawn by a small jitted program whose `out_shardings` come
  from its `logical_axes`, so each device computes only its own slices; the
  values equal the one-device model's. `llama_kwargs` (`tp_reduce_dtype`, `tp_micro_batches`,
  `attention_config`) go to `Llama`.
  """
  dtype = jnp.float32 if dtype is None else dtype
  mesh = sr.auto_mesh(mesh)
  sr.check_mesh(config, mesh)
  make = lambda: Llama(config, rngs=nnx.Rngs(seed), dtype=dtype, mesh=mesh, **llama_kwargs)
  if mesh is None:
    return make()
  placement = lambda names, shape: sr.sharding(names, mesh, shape)
  token = PARAM_PLACEMENT.set(placement)
  try:
    return make()
  finally:
    PARAM_PLACEMENT.reset(token)
