"""Llama training forwards over groups of completions that share a prompt.

Without editing `models.llama`, these reuse a `Llama`'s parameters and its
per-layer helpers (`_qkv`, `_mlp`, `rms_norm`):

* `shared_forward`: each prompt goes through the layers once (causal over
  itself) and its K/V is attended by all G completions through the prefill
  layout (`hydrajax.attention.training`); the prompt's dK/dV is reduced over all of them
  in one matmul per kv block.
* `unshared_forward`: the ground truth, every sample's own sequence (prompt
  copied G times) through the model's dense naive forward.

Both return the log-probabilities [Bp * G, T] float32 of the completion tokens:
token j is scored from the hidden state of the token before it (the last
prompt token for j = 0).

* `tree_forward`: any depth, a rollout tree (`hydrajax.attention.training.tree_prefill`): every node
  through the layers once, attending its ancestors; the log-probabilities of every non-root
  node's tokens, scored the same way (from its parent's last token for j = 0).

A `Llama(..., mesh=)` with a `tp` axis trains tensor parallel: each layer's attention is one
`jax.shard_map` over the heads (`_on_heads`), GSPMD shards the rest by the rules table; inside
`models.training.parallel.data_parallel` the step's mesh adds `dp`.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hydrajax.attention.dispatch import AttentionImpl
from hydrajax.partial_state import PartialState
from hydrajax.attention.training import prefill_layout as pl
from hydrajax.attention.training import tree_prefill as tp
from models import sharding_rules as sr
from models.kv_cache import DenseKVCache
from models.llama import Llama, _mlp, _qkv, rms_norm


def _check(prompts, completions, layout: pl.PrefillLayout):
  if prompts.shape != layout.prompt_slots.shape:
    raise ValueError(f'prompts must be [Bp, P] = {layout.prompt_slots.shape}, got {prompts.shape}')
  if completions.shape != layout.completion_slots.shape:
    raise ValueError(f'completions must be [Bp * G, T] = {layout.completion_slots.shape}, '
                     f'got {completions.shape}')


def _tensor_parallel(model: Llama) -> int:
  """tp of the model's mesh (1 without one); ValueError for a mesh training does not take."""
  c, mesh = model.config, model.mesh
  tp = sr.axis_size(mesh, sr.TP)
  context = jax.sharding.get_abstract_mesh()  # data_parallel's, inside its shard_map
  if not context.empty and context.shape.get(sr.TP, 1) != tp:
    raise ValueError(f'the step\'s mesh has tp={context.shape.get(sr.TP, 1)} and the model\'s '
                     f'tp={tp}: make the model on that mesh, Llama(..., mesh=mesh)')
  if c.num_kv_heads % tp:
    raise ValueError(f'tensor parallel training needs tp={tp} to divide the kv heads '
                     f'K={c.num_kv_heads}')
  return tp


def _local(x, shards: int, axis: int = 2) -> jax.ShapeDtypeStruct:
  """One device's shape of x, its head axis split into `shards` (what a plan is prepared for)."""
  shape = list(x.shape)
  shape[axis] //= shards
  return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _on_heads(model: Llama, shards: int, attend, num_q: int):
  """attend(*qs, k_buffer, v_buffer, plan) -> states, each device on its heads under the
  model's tp (`shards`, from `_tensor_parallel`; one `jax.shard_map`: q heads and kv heads
  split together, the plan replicated, no communication); attend itself without tp. GSPMD
  shards the projections around it (`models.sharding_rules`)."""
  if shards == 1:
    return attend
  q_spec, kv_spec = P(None, None, sr.TP, None), P(None, sr.TP, None)
  state = PartialState(q_spec, P(None, None, sr.TP))
  # check_vma=False: the attention's scans start from constant carries that the device's
  # heads then vary.
  context = jax.sharding.get_abstract_mesh()  # inside data_parallel's shard_map: dp is manual
  return jax.shard_map(attend, mesh=model.mesh if context.empty else context,
                       in_specs=(q_spec,) * num_q + (kv_spec, kv_spec, P()),
                       out_specs=(state,) * num_q, check_vma=False)


def _token_logprobs(model: Llama, h_prev, completions):
  """h_prev [B, T, D] (final-norm hidden of the preceding tokens) -> log p(completions) [B, T]."""
  logits = model.logits(h_prev)  # [B, T, V] float32
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, completions[..., None], axis=-1)[..., 0]


def shared_hidden(model: Llama, prompts, completions, layout: pl.PrefillLayout, *,
                  kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                  interpret: bool = False):
  """Final-norm hidden states of the prompts [Bp, P, D] and completions [Bp * G, T, D].

  impl, interpret: the attention's kernels, as in `prepare_prefill_attention`. The attention
  is prepared once, at the first layer (every layer's q and K/V have its shapes and dtypes),
  and every layer attends with that plan. A model with a `tp` mesh (`Llama(..., mesh=)`) runs
  each device's heads (`_on_heads`; the plan prepared for one device's shapes).
  """
  c = model.config
  _check(prompts, completions, layout)
  shards = _tensor_parallel(model)
  attend = _on_heads(model, shards, pl.attend_prefill, 2)
  bp, p = prompts.shape
  inv_freq = model.inv_freq()
  embed = model.embed.get_value()
  x_p, x_c = embed[prompts], embed[completions]
  pos_p = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (bp, p))
  pos_c = layout.completion_positions
  plan = None
  for layer in model.layers:
    w = layer.arrays()
    q_p, k_p, v_p = _qkv(w, x_p, pos_p, inv_freq, c.norm_eps)
    q_c, k_c, v_c = _qkv(w, x_c, pos_c, inv_freq, c.norm_eps)
    k_buf, v_buf = pl.write_kv(layout, k_p, k_c), pl.write_kv(layout, v_p, v_c)
    if plan is None:
      plan = pl.prepare_prefill_attention(
          layout, _local(q_p, shards), _local(q_c, shards), _local(k_buf, shards, 1), impl=impl,
          kv_block=kv_block, interpret=interpret)
    a_p, a_c = attend(q_p, q_c, k_buf, v_buf, plan)
    x_p = _mlp(w, x_p + jnp.einsum('btnh,nhd->btd', a_p.out.astype(x_p.dtype), w['wo']),
               c.norm_eps)
    x_c = _mlp(w, x_c + jnp.einsum('btnh,nhd->btd', a_c.out.astype(x_c.dtype), w['wo']),
               c.norm_eps)
  norm = model.final_norm.get_value()
  return rms_norm(x_p, norm, c.norm_eps), rms_norm(x_c, norm, c.norm_eps)


def shared_forward(model: Llama, prompts, completions, layout: pl.PrefillLayout, *,
                   kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                   interpret: bool = False) -> jax.Array:
  """log p(completion tokens) [Bp * G, T] float32, each prompt computed once.

  prompts [Bp, P] int32 (right-padded), completions [Bp * G, T] int32 (row r
  continues prompt r // G), layout from `plan_prefill(...).to_device()`. impl, interpret:
  the attention's kernels (MOSAIC_GPU: Hopper, bf16 / f16), as in `prepare_prefill_attention`.
  """
  h_p, h_c = shared_hidden(model, prompts, completions, layout, kv_block=kv_block, impl=impl,
                           interpret=interpret)
  g = layout.group_size
  last = h_p[jnp.arange(prompts.shape[0]), layout.prompt_lengths - 1]  # [Bp, D]
  h_prev = jnp.concatenate([jnp.repeat(last, g, axis=0)[:, None], h_c[:, :-1]], axis=1)
  return _token_logprobs(model, h_prev, completions)


def unshared_forward(model: Llama, prompts, completions, prompt_lengths, group_size: int):
  """The ground truth of `shared_forward`: each sample's own sequence through `forward_naive`."""
  b, t = completions.shape
  tokens = pl.unshared_sequences(prompts, completions, prompt_lengths, group_size)
  s = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
  cache = DenseKVCache.zeros(model.config, b, s, dtype=model.dtype)
  logits, _ = model.forward_naive(tokens, positions, cache)  # [B, S, V]
  prev = jnp.repeat(prompt_lengths, group_size)[:, None] - 1 + jnp.arange(t)[None, :]  # [B, T]
  logp = jax.nn.log_softmax(logits[jnp.arange(b)[:, None], prev], axis=-1)
  return jnp.take_along_axis(logp, completions[..., None], axis=-1)[..., 0]


def per_sequence_forward(model: Llama, prompts, completions, prompt_lengths, group_size: int,
                         attention) -> jax.Array:
  """Like `unshared_forward` with a pluggable causal attention (the benchmark baselines).

  attention(q [B, S, N, H], k [B, S, K, H], v [B, S, K, H]) -> out [B, S, N, H], causal
  over each row's own sequence, e.g. `jax.nn.dot_product_attention(..., is_causal=True)`.
  Only the completions' preceding positions reach the output head.
  """
  c = model.config
  b, t = completions.shape
  tokens = pl.unshared_sequences(prompts, completions, prompt_lengths, group_size)
  s = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
  inv_freq = model.inv_freq()
  x = model.embed.get_value()[tokens]
  for layer in model.layers:
    w = layer.arrays()
    q, k, v = _qkv(w, x, positions, inv_freq, c.norm_eps)
    out = attention(q, k, v).astype(x.dtype)
    x = _mlp(w, x + jnp.einsum('btnh,nhd->btd', out, w['wo']), c.norm_eps)
  prev = jnp.repeat(prompt_lengths, group_size)[:, None] - 1 + jnp.arange(t)[None, :]  # [B, T]
  h = rms_norm(x[jnp.arange(b)[:, None], prev], model.final_norm.get_value(), c.norm_eps)
  return _token_logprobs(model, h, completions)


def causal_logits(model: Llama, tokens):
  """Training forward: the model's own layers with causal `jax.nn.dot_product_attention`.

  The same math as `Llama.forward_naive` (tested equal in tests/test_apps_eval.py; experiments/train_tiny_coder.py trains with it), without the
  dense cache scatter and float32-HIGHEST oracle attention that make that path slow to train.
  """
  c = model.config
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  inv_freq = model.inv_freq()
  x = model.embed.get_value()[tokens]
  for layer in model.layers:
    p = layer.arrays()
    q, k, v = _qkv(p, x, positions, inv_freq, c.norm_eps)
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + jnp.einsum('btnh,nhd->btd', attn, p['wo'])
    x = _mlp(p, x, c.norm_eps)
  return model.logits(rms_norm(x, model.final_norm.get_value(), c.norm_eps))


def tree_hidden(model: Llama, level_tokens, layout: tp.TreePrefillLayout, *,
                kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                interpret: bool = False):
  """Final-norm hidden states [B_d, C_d, D] of every level of a token tree, each node once.

  level_tokens: [B_d, C_d] int32 a level (`plan_tree_prefill`'s rows, right-padded). Each
  node's queries attend its ancestors through `tree_prefill` (prepared once, at the first
  layer); impl, interpret: its kernels, as in `prepare_tree_prefill`. A model with a `tp` mesh
  runs each device's heads, as `shared_hidden` does.
  """
  c = model.config
  shapes = layout.level_shapes
  if len(level_tokens) != len(shapes) or any(
      tuple(x.shape) != shape for x, shape in zip(level_tokens, shapes)):
    raise ValueError(f'level_tokens must be one [B_d, C_d] array a level, {shapes}, got '
                     f'{[tuple(x.shape) for x in level_tokens]}')
  shards = _tensor_parallel(model)
  attend = _on_heads(model, shards,
                     lambda *a: tuple(tp.attend_tree_prefill(list(a[:-3]), *a[-3:])), len(shapes))
  inv_freq = model.inv_freq()
  xs = [model.embed.get_value()[tokens] for tokens in level_tokens]
  plan = None
  for layer in model.layers:
    w = layer.arrays()
    qkv = [_qkv(w, x, pos, inv_freq, c.norm_eps) for x, pos in zip(xs, layout.positions)]
    k_buf = tp.write_tree_kv(layout, [k for _, k, _ in qkv])
    v_buf = tp.write_tree_kv(layout, [v for _, _, v in qkv])
    qs = [q for q, _, _ in qkv]
    if plan is None:
      plan = tp.prepare_tree_prefill(layout, [_local(q, shards) for q in qs],
                                     _local(k_buf, shards, 1), impl=impl, kv_block=kv_block,
                                     interpret=interpret)
    states = attend(*qs, k_buf, v_buf, plan)
    xs = [_mlp(w, x + jnp.einsum('btnh,nhd->btd', a.out.astype(x.dtype), w['wo']), c.norm_eps)
          for x, a in zip(xs, states)]
  norm = model.final_norm.get_value()
  return [rms_norm(x, norm, c.norm_eps) for x in xs]


def tree_forward(model: Llama, level_tokens, layout: tp.TreePrefillLayout, *,
                 kv_block: int = 1024, impl: AttentionImpl | str = AttentionImpl.XLA,
                 interpret: bool = False) -> list[jax.Array]:
  """log p of every non-root node's tokens, [B_d, C_d] float32 for each level d >= 1.

  Token j of a node is scored from the hidden state of the token before it: the node's own
  token j - 1, or for j = 0 its parent's last real token. Padding tokens get values too; mask
  them (`layout.lengths`). Arguments as in `tree_hidden`.
  """
  hs = tree_hidden(model, level_tokens, layout, kv_block=kv_block, impl=impl,
                   interpret=interpret)
  logps = []
  for d in range(1, len(hs)):
    above, rows = hs[d - 1], layout.parent_rows[d - 1]
    last = above[rows, layout.lengths[d - 1][rows] - 1]  # [B_d, D]
    h_prev = jnp.concatenate([last[:, None], hs[d][:, :-1]], axis=1)
    logps.append(_token_logprobs(model, h_prev, level_tokens[d]))
  return logps
