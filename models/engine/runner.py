"""The engine's model calls: the KV buffer, the jitted step, KV copies and compiled shapes."""

import dataclasses
import functools
import logging
import warnings
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import SharingPlan
from hydrajax.attention import parallel
from hydrajax.chunk_cache import ChunkCacheConfig, copy_slots
from hydrajax.layout import next_power_of_two
from models.engine.config import EngineConfig, step_sampling_mode
from models.engine.requests import Request
from models.engine.stats import EngineStats
from models.engine.step import compiler_options, model_step, segment_slots
from models import sharding_rules as sr
from models.kv_cache import KVCache
from models.llama import Llama
from models.sampling import Sampled, SamplingMode, SamplingRows

log = logging.getLogger(__name__)


class ModelRunner:
  """Owns the one KV buffer and runs every model call and KV copy of an engine.

  With dp shards, shard d's tokens are [d L_s, (d+1) L_s) of the buffer (sharded over dp);
  `drop_slot` is a write slot that no shard writes. Every call's shape is checked against the
  config's `ShapeBudget`; `seen_shapes` are the step programs run so far (a first run may
  compile). `model_step` is the jitted call: tests and host-overhead experiments may replace
  it by a stub with the same arguments, which may return just the tokens [S] instead of a
  `Sampled`.
  """

  def __init__(self, model: Llama, config: EngineConfig, cache_config: ChunkCacheConfig,
               num_shards: int, stats: EngineStats):
    self.model, self.config, self.stats = model, config, stats
    self.num_shards = num_shards
    self.cache_config = cache_config
    self.shard_tokens = cache_config.kv_tokens
    self.drop_slot = num_shards * cache_config.kv_tokens
    dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else model.dtype
    mesh = getattr(model, 'mesh', None)
    self.kv = KVCache.zeros(model.config, num_shards * cache_config.kv_tokens, dtype, mesh=mesh)
    self.kv_bytes_per_token = model.config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    self.prefill_policy = config.prefill_policy()
    self.budget = config.shape_budget(num_shards)
    self._allowed = ({('decode', *s) for s in self.budget.decode}
                     | {('prefill', *s) for s in self.budget.prefill})
    log.info('engine: %s', self.budget)
    # Bound once: hashing the graph definition and flattening the model's state on every
    # call (as a static and a pytree argument) would cost host time on every step.
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    self.params = tuple(leaves)
    platform = next(iter(leaves[0].devices())).platform
    self.model_step = jax.jit(functools.partial(model_step, graphdef, treedef),
                              static_argnames=('impl', 'top_logprobs'),
                              donate_argnames=('cache',),
                              compiler_options=compiler_options(
                                  platform, command_buffers=config.command_buffers))
    self.seen_shapes: set = set()
    self.last_new_shape = False  # whether the last call ran a shape for the first time
    self._copy_fn = copy_slots
    if num_shards > 1:  # KV copies keep the buffer's sharding (tokens over dp)
      self._copy_fn = jax.jit(copy_slots, donate_argnums=(0, 1),
                              out_shardings=(self.kv.k.sharding, self.kv.v.sharding))

  # ---- KV copies ----------------------------------------------------------------------------

  def global_slots(self, slots: np.ndarray, shard: int) -> np.ndarray:
    """A shard's flat slots in the one KV buffer (shard d's tokens start at d L_s)."""
    return slots if shard == 0 else slots + shard * self.shard_tokens

  def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
    """Runs KV copies (copy on write), padded to a power of two."""
    if src.size:
      size = next_power_of_two(max(src.size, 64))
      src = np.concatenate([src, np.zeros(size - src.size, np.int32)])
      dst = np.concatenate([dst, np.full(size - dst.size, self.drop_slot, np.int32)])
      self._copy_padded(src, dst)

  def _copy_padded(self, src: np.ndarray, dst: np.ndarray) -> None:
    k, v = self._copy_fn(self.kv.k, self.kv.v, jnp.asarray(src), jnp.asarray(dst))
    self.kv = KVCache(k, v)

  # ---- model calls ------------------------------------------------------------------------

  def sampling_inputs(self, samples: Sequence[Request], s: int, ahead=None):
    """(seeds [s] uint32, streams [s], indices [s], SamplingRows [s]) of the sampling entries.

    A request's key is (its seed, its sample index) with a seed of its own, else (the
    engine's seed, its id); the index is its token's (`ahead` counts tokens of it still
    on the device).
    """
    k = len(samples)
    seeds = np.zeros(s, np.uint32)
    streams = np.zeros(s, np.int32)
    index = np.zeros(s, np.int32)
    seed = self.config.seed
    seeds[:k] = [seed if r.params.seed is None else r.params.seed for r in samples]
    streams[:k] = [r.id if r.params.seed is None else r.sample_index for r in samples]
    index[:k] = [len(r.output) for r in samples]
    if ahead is not None:
      index[:k] += ahead
    return seeds, streams, index, SamplingRows.of([r.params for r in samples], s)

  def run(self, tokens, positions, slots, layout, samples, s, impl, sample_rows=None, *,
          ahead=None, feed=None, kind=()) -> Sampled:
    """Dispatches one model call; returns its draws (on the device, not waited for).

    `samples` are the requests that sample (one per row, or one per entry of
    `sample_rows`, s entries in all); `ahead` [k] counts tokens of theirs not yet
    in their output (sampling keys use the token's index); `feed` = (tokens [b]
    on the device, src [b]) gives rows with src >= 0 their input token from there.
    """
    seeds, streams, index, rows = self.sampling_inputs(samples, s, ahead)
    rows = dataclasses.replace(rows, mode=step_sampling_mode(kind, rows.mode))
    shape = kind + (segment_slots(layout),)
    if shape not in self._allowed:
      warnings.warn(f'engine step shape {shape} is outside its budget ({self.budget})',
                    stacklevel=2)
    key = _shape_key(tokens, s, feed, layout, rows)
    self.stats.shapes.add(key)
    self.last_new_shape = key not in self.seen_shapes
    self.seen_shapes.add(key)
    # Host arrays go to the jitted call as they are: its dispatch uploads them faster than
    # one jnp.asarray each.
    out, self.kv = self.model_step(
        self.params, self.kv, tokens, positions, slots, layout, seeds, streams, index, rows,
        sample_rows, feed=feed, impl=impl, top_logprobs=self.config.max_top_logprobs,
    )
    if not isinstance(out, Sampled):  # a stub's tokens
      out = Sampled(out, None, None, None)
    return out

  @staticmethod
  def fetch(out: Sampled, reqs: Sequence[Request]) -> tuple:
    """The draws of the first len(reqs) entries on the host: (tokens, log-probs, top ids,
    top log-probs), the last three None unless one of the requests asked for log-probs."""
    k = len(reqs)
    tokens = sr.to_host(out.tokens)[:k]  # gathered where they span other processes
    if out.logprobs is None or not any(r.params.wants_logprobs for r in reqs):
      return tokens, None, None, None
    return (tokens, sr.to_host(out.logprobs)[:k], sr.to_host(out.top_tokens)[:k],
            sr.to_host(out.top_logprobs)[:k])

  def prepare_plan(self, layout, impl, query_tokens: int = 1):
    """The model's attention plan over `layout` for `query_tokens` per row (1: decode), prepared
    on the host, outside the jitted step (the layout itself for NO_ATTENTION)."""
    return self.model.prepare_attention(layout, query_tokens=query_tokens, cache=self.kv,
                                        impl=impl, interpret=self.config.interpret)

  # ---- compiling every shape ----------------------------------------------------------------

  def empty_layout(self, b: int, j: int, policy):
    """A layout of b empty rows with J = j segment slots (0: none), as the cache would shape it
    (with dp: one per shard, stacked)."""
    c = self.cache_config
    plan = SharingPlan(b, (), c.chunk_size, ((),) * b, (0,) * b, c.kv_tokens)
    policy = (dataclasses.replace(policy, fixed_shapes=False) if j == 0
              else dataclasses.replace(policy, min_segments=j))
    if self.num_shards > 1:
      return parallel.stack_layouts([plan] * self.num_shards, policy=policy,
                                    max_private_pages=c.max_pages, upload=False)
    return plan.to_device(policy=policy, max_private_pages=c.max_pages)

  def warmup_steps(self) -> Iterator[tuple[int, int]]:
    """Compiles every shape of the budget (model steps on empty rows, KV copies) one program at
    a time, yielding (programs done, programs in all) after each. What a lone short request runs
    comes first: fewest rows, then fewest segment slots, greedy before sampling, shortest
    prefill."""
    budget = self.budget
    modes = {m: i for i, m in enumerate((SamplingMode.GREEDY, SamplingMode.DRAW,
                                         SamplingMode.FILTER))}
    steps = [('decode', b, j) for b, j in budget.decode] + [
        ('prefill', t, b, j) for t, b, j in budget.prefill]
    programs = sorted(
        ((shape[-2], shape[-1], modes[mode], shape[1] if shape[0] == 'prefill' else 1), shape,
         mode) for shape in steps for mode in {step_sampling_mode(shape, m) for m in SamplingMode})
    total = len(programs) + len(budget.copies)
    for done, (_, shape, mode) in enumerate(programs, 1):
      self._warm_shape(shape, mode)
      yield done, total
    for done, size in enumerate(budget.copies, len(programs) + 1):
      self._copy_padded(np.zeros(size, np.int32), np.full(size, self.drop_slot, np.int32))
      yield done, total
    jax.block_until_ready(self.kv)

  def _warm_shape(self, shape: tuple, mode: SamplingMode) -> None:
    c, dp = self.config, self.num_shards
    if shape[0] == 'decode':
      _, b, j = shape
      layout = self.prepare_plan(self.empty_layout(b, j, self.cache_config.layout), c.impl)
      if dp > 1:  # as a decode step passes it: private lengths swapped in from the host
        layout = layout.with_private_lengths(np.zeros(dp * b, np.int32))
      feed = (np.zeros(b, np.int32), np.full(b, -1, np.int32)) if c.overlap_decode else None
      rows = None if dp == 1 else np.zeros(dp * b, np.int32)  # dp: decode samples by row index
      self._warm(np.zeros((dp * b, 1), np.int32), layout, dp * b, c.impl, rows, feed, mode)
    else:
      _, t, b, j = shape
      s = dp * c.prefill_sample_rows()
      layout = self.prepare_plan(self.empty_layout(b, j, self.prefill_policy), c.prefill_impl, t)
      self._warm(np.zeros((dp * b, t), np.int32), layout, s, c.prefill_impl,
                 np.zeros(s, np.int32), None, mode)

  def _warm(self, tokens, layout, s, impl, sample_rows, feed, mode) -> None:
    """Compiles one shape in one sampling mode (each is a program of its own)."""
    b, t = tokens.shape
    slots = np.full((b, t), self.drop_slot, np.int32)  # writes nothing
    seeds, streams, index, greedy_rows = self.sampling_inputs([], s)
    rows = dataclasses.replace(greedy_rows, mode=mode)
    out, self.kv = self.model_step(
        self.params, self.kv, tokens, np.zeros((b, t), np.int32), slots, layout, seeds,
        streams, index, rows, sample_rows, feed=feed, impl=impl,
        top_logprobs=self.config.max_top_logprobs)
    jax.block_until_ready(out)
    self.seen_shapes.add(_shape_key(tokens, s, feed, layout, rows))


def _shape_key(tokens, s, feed, layout, rows: SamplingRows) -> tuple:
  """What selects a compiled model step: shapes, the layout's structure, the sampling mode."""
  return (tokens.shape, s, feed is not None, jax.tree_util.tree_structure(layout),
          tuple(x.shape for x in jax.tree_util.tree_leaves(layout)), rows.mode)
