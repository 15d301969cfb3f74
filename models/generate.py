"""Generation from a sharing tree of prompts: shared prefill once, one jitted decode loop.

Prompts are a forest of `hydrajax.PromptNode`s carrying token ids (see
`models.prompt_plan.prompt_node`), or plain token lists whose shared prefixes
`hydrajax.plan_from_tokens` finds. Every leaf continues into `num_samples`
sequences (rows, depth-first). `models.prompt_plan` plans them on the host: the KV
buffer `plan_tree` lays out (each tree node's tokens once, then a private region of
`max_new_tokens`, rounded up to PRIVATE_ALIGN, per row), the prefill rounds and the
decode rows; this module runs that plan on the model.

Prefill: every tree node is one row of a model call, in rounds of at most
`prefill_chunk` tokens per node (see `prefill_calls`). What a prefill row
attends is a `SharingPlan`: its ancestors as shared segments, its own tokens
as private pages of `PREFILL_PAGE` tokens (every node starts on such a page,
`plan_tree(segment_align=)`, so the Mosaic GPU kernels take prefill too). So a
segment shared by 128 samples is prefilled once, not 128 times.

Decode: one jitted `lax.while_loop` (no host round trip per token) with the
cache donated. Each step feeds every row's last token at its next private
slot and samples the next one. Rows that hit a stop token keep running
(static batch) but their outputs are -1 from then on; the loop ends early when
every row is done.

The attention plan (`hydrajax.prepare_attention`: implementation resolved, backend
metadata precomputed) is prepared once per tree change: once per prefill round,
once for the whole decode loop (whose steps only swap the private lengths).

With a model mesh of `dp` > 1 the forest's sharing groups are split over the dp shards
(`models.data_parallel`): prefill rounds and the decode loop are each one program over the mesh.

`impl=ModelMode.DENSE` runs the ground truth instead: every
sequence's full prompt in its own dense cache and `hydrajax.naive_attention`.
"""

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import AttentionImpl, AttentionPlan, SharingPolicy, TreeLayout
from hydrajax.layout import as_int
from hydrajax.attention.parallel import ShardedLayout
from hydrajax.validation import FLOAT_DTYPES, token_ids
from models import data_parallel
from models import sharding_rules as sr
from models.kv_cache import CACHE_PROGRAM_OPTIONS, DenseKVCache, KVCache
from models.llama import Llama, ModelMode, parse_impl
from models.prompt_plan import (RowSpec, TreePrompts, check_max_new_tokens, longest_prompt,
                                plan_forest, prefill_calls, prompt_forest, sequence_ids,
                                tree_rows)
from models.sampling import SEED_LIMIT, SamplingParams, SamplingRows, row_keys, sample_batch


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """Generated tokens, one row per sample, ordered by (prompt, sample).

  Attributes:
    tokens: [R, max_new_tokens] int32; -1 after a row's stop token.
    lengths: [R] tokens generated per row, the stop token included.
    logprobs: [R, max_new_tokens] float32 model log-probs of the tokens (0 after the end), or None.
    prompt_ids: [R] the prompt (input list index, or depth-first leaf index of a tree).
    sample_ids: [R] which sample of its prompt.
    top_tokens, top_logprobs: [R, max_new_tokens, n] the n most likely tokens of each position
      and their model log-probs (`SamplingParams.top_logprobs` = n > 0), or None.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  logprobs: np.ndarray | None
  prompt_ids: np.ndarray
  sample_ids: np.ndarray
  top_tokens: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('cache',),
                   compiler_options=CACHE_PROGRAM_OPTIONS)
def _prefill_step(graphdef, params, tokens, positions, cache, slots, plan, last_index):
  model = nnx.merge(graphdef, params)
  h, cache = model.forward_hidden(tokens, positions, cache, slots, plan, impl=_mode_of(plan))
  last = jnp.take_along_axis(h, jnp.maximum(last_index, 0)[:, None, None], axis=1)[:, 0]
  return model.logits(last), cache  # [B, V] float32


def _mode_of(plan) -> ModelMode:
  """What a prepared plan (or a bare layout: no attention) runs; per-dp-shard plans too."""
  if isinstance(plan, ShardedLayout):
    plan = plan.layouts
  return ModelMode.TREE if isinstance(plan, AttentionPlan) else ModelMode.NO_ATTENTION


def prefill(model: Llama, tp: TreePrompts, cache: KVCache, *, impl=AttentionImpl.AUTO,
            chunk: int = 512, interpret: bool = False) -> tuple[jax.Array, KVCache]:
  """Writes every node's KV once; returns (first-token logits [rows, V], cache)."""
  calls = [(c, c.plan.to_device(max_private_pages=c.max_private_pages))
           for c in prefill_calls(tp, chunk)]
  return run_prefill(model, calls, tp.row_node, cache, impl=impl, interpret=interpret)


def run_prefill(model: Llama, calls, row_node, cache: KVCache, *, impl=AttentionImpl.AUTO,
                interpret: bool = False) -> tuple[jax.Array, KVCache]:
  """Runs (PrefillCall, its device layout) calls; returns (logits of row_node's last tokens, cache).

  The layout is a `TreeLayout`, or a `ShardedLayout` with dp (`models.data_parallel`).
  """
  graphdef, params = nnx.split(model)
  ends = []
  for call, layout in calls:
    plan = model.prepare_attention(layout, query_tokens=call.tokens.shape[1], cache=cache,
                                   impl=impl, interpret=interpret)
    logits, cache = _prefill_step(
        graphdef, params, jnp.asarray(call.tokens), jnp.asarray(call.positions), cache,
        jnp.asarray(call.write_slots), plan, jnp.asarray(call.last_index))
    if (call.last_index >= 0).any():  # a call that ends nodes (others' logits are dropped)
      ends.append((logits, call.segment_ids, call.last_index))
  return node_logits(ends, row_node), cache


def node_logits(ends, row_node) -> jax.Array:
  """Logits [rows, V] of each row's node's last token, from the prefill calls' outputs.

  ends: (logits [B, V], segment_ids [B], last_index [B]) per call; a node's logits are those of
  the call row where it ends (last_index >= 0). One gather over the calls that end nodes (a stack
  of one [V] slice per row asks XLA for memory that grows with rows x calls).
  """
  where, parts, offset = {}, [], 0
  for logits, segment_ids, last_index in ends:
    rows = np.flatnonzero(np.asarray(last_index) >= 0)
    if len(rows):
      where.update({int(segment_ids[r]): offset + int(r) for r in rows})
      parts.append(logits)
      offset += logits.shape[0]
  flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return flat[np.asarray([where[int(j)] for j in row_node], np.int32)]


# ---------------------------------------------------------------------------
# Decode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """The decode loop's carry; `step` tokens of every row are generated."""

  step: jax.Array  # [] int32
  cache: Any  # KVCache or DenseKVCache
  tokens: jax.Array  # [B, M] int32, -1 where none
  logprobs: jax.Array  # [B, M] float32
  done: jax.Array  # [B] bool
  lengths: jax.Array  # [B] int32
  top_tokens: jax.Array  # [B, M, n] int32: the n most likely of each position (n may be 0)
  top_logprobs: jax.Array  # [B, M, n] float32


def _ends_with_stop_sequence(tokens, step, sequences) -> jax.Array:
  """[B] bool: row b's tokens up to index `step` end with one of `sequences` (static)."""
  if not sequences:
    return jnp.zeros(tokens.shape[:1], bool)
  width = max(len(q) for q in sequences)
  table = np.full((len(sequences), width), -2, np.int32)  # right-aligned; -2 matches anything
  for i, q in enumerate(sequences):
    table[i, width - len(q):] = q
  index = step - width + 1 + jnp.arange(width)
  window = jnp.where(index >= 0, tokens[:, jnp.maximum(index, 0)], -1)  # [B, W]
  match = (table[None] == -2) | (window[:, None, :] == table[None])  # [B, Q, W]
  return jnp.any(jnp.all(match, axis=-1), axis=-1)


def _group_size(model: Llama) -> int:
  """Query heads per KV head: chooses the policy's measured thresholds."""
  return model.config.num_heads // model.config.num_kv_heads


def _record(state: DecodeState, logits, key, rows: RowSpec, stop_tokens, sampling) -> DecodeState:
  """Samples token `state.step` of every row from logits [B, V]."""
  keys = row_keys(key, rows.sequence_ids, state.step)
  drawn = sample_batch(logits, keys, SamplingRows.full(sampling, logits.shape[0]),
                       top_logprobs=sampling.top_logprobs)
  new = drawn.tokens
  live = ~state.done
  tokens = state.tokens.at[:, state.step].set(jnp.where(live, new, -1))
  logprobs = state.logprobs.at[:, state.step].set(jnp.where(live, drawn.logprobs, 0))
  top_tokens = state.top_tokens.at[:, state.step].set(
      jnp.where(live[:, None], drawn.top_tokens, -1))
  top_logprobs = state.top_logprobs.at[:, state.step].set(
      jnp.where(live[:, None], drawn.top_logprobs, 0))
  done = (state.done | jnp.isin(new, stop_tokens)
          | _ends_with_stop_sequence(tokens, state.step, sampling.stop_sequences))
  return DecodeState(state.step + 1, state.cache, tokens, logprobs, done,
                     state.lengths + live.astype(jnp.int32), top_tokens, top_logprobs)


def _static_sampling(sampling: SamplingParams) -> SamplingParams:
  """What the jitted loops need of `sampling` (a static argument: the rest would recompile)."""
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f'sampling must be a SamplingParams, got {type(sampling).__name__}')
  return SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                        top_p=sampling.top_p, min_p=sampling.min_p,
                        stop_sequences=sampling.stop_sequences,
                        top_logprobs=sampling.top_logprobs)


@functools.partial(jax.jit, static_argnames=('max_new_tokens', 'sampling'),
                   donate_argnames=('cache',))
def start_decode(cache, first_logits, rows: RowSpec, key, stop_tokens, *, max_new_tokens: int,
                 sampling: SamplingParams) -> DecodeState:
  """The decode state after sampling the first token from the prefill logits."""
  b, n = first_logits.shape[0], sampling.top_logprobs
  state = DecodeState(
      jnp.zeros((), jnp.int32), cache, jnp.full((b, max_new_tokens), -1, jnp.int32),
      jnp.zeros((b, max_new_tokens), jnp.float32), jnp.zeros((b,), bool),
      jnp.zeros((b,), jnp.int32), jnp.full((b, max_new_tokens, n), -1, jnp.int32),
      jnp.zeros((b, max_new_tokens, n), jnp.float32),
  )
  return _record(state, first_logits, key, rows, stop_tokens, sampling)


def _loop(forward, state: DecodeState, rows, key, stop_tokens, num_steps, sampling):
  end = jnp.minimum(state.step + num_steps, state.tokens.shape[1])

  def cond(s):
    return (s.step < end) & ~jnp.all(s.done)

  def body(s):
    j = s.step - 1  # index of the token fed now
    last = jnp.maximum(jax.lax.dynamic_index_in_dim(s.tokens, j, axis=1, keepdims=False), 0)
    logits, cache = forward(s.cache, last, j)
    s = dataclasses.replace(s, cache=cache)
    return _record(s, logits, key, rows, stop_tokens, sampling)

  return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=('graphdef', 'sampling', 'impl'),
                   donate_argnames=('state',), compiler_options=CACHE_PROGRAM_OPTIONS)
def decode(graphdef, params, state: DecodeState, plan: AttentionPlan | TreeLayout, rows: RowSpec,
           key, stop_tokens, num_steps, *, sampling: SamplingParams,
           impl=AttentionImpl.AUTO) -> DecodeState:
  """Up to `num_steps` more tokens per row (the whole loop is this one program).

  `plan`: the decode tree's `AttentionPlan` (T = 1), prepared once per tree change (then
  `impl` is ignored); or its `TreeLayout`, prepared here with `impl` once for the loop.
  """
  model = nnx.merge(graphdef, params)
  if isinstance(plan, TreeLayout):
    plan = model.prepare_attention(plan, query_tokens=1, cache=state.cache, impl=impl)
  mode = _mode_of(plan)

  def forward(cache, last, j):
    lengths = rows.private_base + j + 1
    if mode is ModelMode.TREE or isinstance(plan, ShardedLayout):
      step_plan = plan.with_private_lengths(lengths)
    else:
      step_plan = dataclasses.replace(plan, private_lengths=lengths)
    logits, cache = model(last[:, None], (rows.positions + j)[:, None], cache,
                          (rows.write_base + j)[:, None], step_plan, impl=mode)
    return logits[:, 0], cache

  return _loop(forward, state, rows, key, stop_tokens, num_steps, sampling)


@functools.partial(jax.jit, static_argnames=('graphdef', 'sampling'), donate_argnames=('state',),
                   compiler_options=CACHE_PROGRAM_OPTIONS)
def _decode_naive(graphdef, params, state: DecodeState, rows: RowSpec, key, stop_tokens,
                  num_steps, *, sampling):
  model = nnx.merge(graphdef, params)

  def forward(cache, last, j):
    logits, cache = model.forward_naive(last[:, None], (rows.positions + j)[:, None], cache)
    return logits[:, 0], cache

  return _loop(forward, state, rows, key, stop_tokens, num_steps, sampling)


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('cache',),
                   compiler_options=CACHE_PROGRAM_OPTIONS)
def _prefill_naive(graphdef, params, tokens, cache, last_index):
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  logits, cache = model.forward_naive(tokens, positions, cache)
  return jnp.take_along_axis(logits, last_index[:, None, None], axis=1)[:, 0], cache


def _row_prompts(tp: TreePrompts) -> list[list[int]]:
  """Every row's full prompt (root to leaf)."""
  out = []
  for r in range(tp.num_rows):
    out.append([t for j in tp.plan.path(r) for t in tp.nodes[j][0]])
  return out


# ---------------------------------------------------------------------------
# The API


def generate(
    model: Llama,
    prompts,
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    return_logprobs: bool = False,
    impl: AttentionImpl | ModelMode | str = AttentionImpl.AUTO,
    prefill_impl: AttentionImpl | str | None = None,
    prefill_chunk: int = 512,
    cache_dtype=None,
    interpret: bool = False,
    sharing_policy: SharingPolicy | None = None,
) -> GenerateOutput:
  """Samples `max_new_tokens` tokens per sequence from a prompt forest.

  Args:
    model: the Llama. With a mesh, tensor parallel over its `tp` axis; with `dp` > 1 the
      independent sharing groups (the forest's roots) are split over the dp shards, each
      shard its own rows and part of the KV buffer (`models.data_parallel`; an idle shard
      runs padding rows); the outputs are the same, in the same order.
    prompts: a `PromptNode` forest with tokens (see `models.prompt_plan.prompt_node`; leaves
      give `num_samples`), or a list of token-id lists (shared prefixes found
      automatically, `num_samples` each). Ids are integers in [0, vocab_size), checked
      as the engine checks a prompt (`check_prompt`); none longer than the model's
      `max_position_embeddings`.
    max_new_tokens: tokens generated per sequence (fewer after a stop token).
    num_samples: samples per token list.
    sampling: a `SamplingParams`: greedy (default), temperature, top-k, top-p, min-p, stop
      tokens and sequences, log-probs (`logprobs`, `top_logprobs`), and a seed that overrides
      `seed`; its `max_new_tokens` and `n` are not used (this function's arguments say them).
    seed: the random seed of sampling in [0, 2**32) (keys depend on (seed, prompt, sample,
      token index)).
    stop_tokens: ids in [0, vocab_size) that end a sequence (the stop token is returned),
      with sampling's.
    return_logprobs: also return the model log-probs of the generated tokens.
    impl: attention for decode: an `AttentionImpl` (or its string), or a `ModelMode`:
      TREE (AUTO), NO_ATTENTION, DENSE (dense per-sequence caches, the ground truth).
    prefill_impl: attention for prefill (default: XLA when impl is XLA, else AUTO).
    prefill_chunk: prefill tokens per node per model call.
    cache_dtype: KV cache dtype: float32, bfloat16 or float16 (default: the model's).
    interpret: run the Mosaic kernels in interpret mode (e.g. impl='mosaic_tpu' on a CPU).
    sharing_policy: which shared segments decode reads per sequence instead of batched
      (`SharingPolicy`, applied once to the decode tree; None: `SharingPolicy.default()`,
      the measured break-even points; `SharingPolicy.never()` keeps every segment shared;
      a string such as 'never' is refused).
      The tokens are the same either way. Only whole aligned pages move (the decode plan's
      page is `max_new_tokens` rounded up to PRIVATE_ALIGN), so most segments of token
      prompts stay shared whatever the policy.
  """
  _check_mesh(model, impl)
  static = _static_sampling(sampling)
  vocab = model.config.vocab_size
  stop_tokens = _stop_ids('stop_tokens', stop_tokens, vocab)
  stop_tokens += tuple(t for t in _stop_ids('sampling.stop_tokens', sampling.stop_tokens, vocab)
                       if t not in stop_tokens)
  return_logprobs = return_logprobs or sampling.wants_logprobs
  _check_seed(seed)
  if sampling.seed is not None:
    seed = sampling.seed
  sampling = static
  max_new_tokens = check_max_new_tokens(max_new_tokens)
  if as_int(prefill_chunk, 'prefill_chunk') < 1:
    raise ValueError(f'prefill_chunk must be >= 1, got {prefill_chunk}')
  dtype = _cache_dtype(cache_dtype, model.dtype)
  if sharing_policy is not None and not isinstance(sharing_policy, SharingPolicy):
    raise ValueError(f'sharing_policy must be a SharingPolicy (e.g. SharingPolicy.never()) or '
                     f'None, got {sharing_policy!r}')
  forest = prompt_forest(prompts, num_samples=num_samples, vocab_size=vocab)
  model.config.check_prompt_length(longest_prompt(forest), 'prompts')
  dp = sr.axis_size(model.mesh, sr.DP)
  if dp > 1:  # each dp shard its own sharing groups (models.data_parallel)
    tp = data_parallel.plan_shards(forest, dp, max_new_tokens)
  else:
    tp = plan_forest(forest, max_new_tokens)
  key = jax.random.key(seed)
  stops = jnp.asarray(np.array(list(stop_tokens), np.int32).reshape(-1))
  graphdef, params = nnx.split(model)
  mode, attention = parse_impl(impl)
  if mode is ModelMode.DENSE:
    state, rows = _naive_run(model, graphdef, params, tp, dtype, key, stops, max_new_tokens,
                             sampling)
  else:
    if prefill_impl is None:
      prefill_impl = AttentionImpl.XLA if attention is AttentionImpl.XLA else AttentionImpl.AUTO
    cache = KVCache.zeros(model.config, tp.kv_tokens, dtype, mesh=model.mesh)
    policy = SharingPolicy.default() if sharing_policy is None else sharing_policy
    if dp > 1:
      calls = data_parallel.prefill_calls(tp, prefill_chunk)
      layout, rows = data_parallel.decode_layout(tp, policy, group_size=_group_size(model),
                                                 sequence_ids=sequence_ids(tp))
    else:
      calls = [(c, c.plan.to_device(max_private_pages=c.max_private_pages))
               for c in prefill_calls(tp, prefill_chunk)]
      decode_plan = policy.apply(tp.plan, group_size=_group_size(model))
      layout, rows = decode_plan.to_device(), tree_rows(tp, decode_plan)
    first, cache = run_prefill(model, calls, tp.row_node, cache, impl=prefill_impl,
                               interpret=interpret)
    plan = model.prepare_attention(layout, query_tokens=1, cache=cache, impl=impl,
                                   interpret=interpret)  # once for the decode loop
    state = start_decode(cache, first, rows, key, stops, max_new_tokens=max_new_tokens,
                         sampling=sampling)
    if dp > 1:  # padding rows are done at once: the loop still ends when the real rows stop
      state = dataclasses.replace(state, done=state.done | jnp.asarray(tp.prompt_ids < 0))
    state = decode(graphdef, params, state, plan, rows, key, stops, jnp.int32(max_new_tokens),
                   sampling=sampling, impl=mode)
  real = np.flatnonzero(tp.prompt_ids >= 0)  # without dp's padding rows
  order = real[np.lexsort((tp.sample_ids[real], tp.prompt_ids[real]))]
  tokens, lengths = sr.to_host(state.tokens), sr.to_host(state.lengths)
  return GenerateOutput(
      tokens=tokens[order],
      lengths=lengths[order],
      logprobs=sr.to_host(state.logprobs)[order] if return_logprobs else None,
      prompt_ids=tp.prompt_ids[order],
      sample_ids=tp.sample_ids[order],
      top_tokens=sr.to_host(state.top_tokens)[order] if sampling.top_logprobs else None,
      top_logprobs=sr.to_host(state.top_logprobs)[order] if sampling.top_logprobs else None,
  )


def _stop_ids(name: str, value, vocab_size: int) -> tuple[int, ...]:
  """Stop tokens checked as `SamplingParams` checks its own, and against the vocab."""
  return token_ids(value, name, vocab_size=vocab_size)


def _check_seed(seed) -> None:
  if not 0 <= as_int(seed, 'seed') < SEED_LIMIT:
    raise ValueError(f'seed must be in [0, 2**32), got {seed}')


def _cache_dtype(cache_dtype, default):
  """The KV dtype: None (the model's) or a float dtype the attention kernels take."""
  if cache_dtype is None:
    return default
  try:
    dtype = jnp.dtype(cache_dtype)
  except TypeError:
    dtype = None
  if dtype not in FLOAT_DTYPES:
    raise ValueError(f'cache_dtype must be None, float32, bfloat16 or float16, got {cache_dtype!r}')
  return dtype


def _check_mesh(model: Llama, impl) -> None:
  """generate runs on the model's mesh: tp splits heads, dp the sharing groups."""
  if getattr(model, 'mesh', None) is None:
    return
  if parse_impl(impl)[0] is ModelMode.DENSE:
    raise ValueError('impl=DENSE (the ground truth) runs on one device: use a model without '
                     'a mesh')


def _naive_run(model, graphdef, params, tp, dtype, key, stops, max_new_tokens, sampling):
  prompts = _row_prompts(tp)
  longest = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), longest), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
  cache = DenseKVCache.zeros(model.config, len(prompts), longest + max_new_tokens, dtype)
  last = jnp.asarray(tp.prompt_lengths - 1)
  first, cache = _prefill_naive(graphdef, params, jnp.asarray(tokens), cache, last)
  rows = RowSpec(
      positions=jnp.asarray(tp.prompt_lengths),
      write_base=jnp.zeros_like(last),
      private_base=jnp.zeros_like(last),
      sequence_ids=jnp.asarray(sequence_ids(tp)),
  )
  state = start_decode(cache, first, rows, key, stops, max_new_tokens=max_new_tokens,
                       sampling=sampling)
  state = _decode_naive(graphdef, params, state, rows, key, stops, jnp.int32(max_new_tokens),
                        sampling=sampling)
  return state, rows
