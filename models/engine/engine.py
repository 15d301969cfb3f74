"""The Engine: its API, the iteration, prefill and the decode loop (see the package doc)."""

import dataclasses
import functools
import logging
import math
import numbers
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import SharingPlan, parallel
from hydrajax.chunk_cache import ChunkCache, copy_slots, device_layout
from models.engine.config import EngineConfig, ShapeBudget, step_sampling_mode
from models.engine.decode import DecodeLoop, DecodeStep
from models.engine.prefill import Prefill
from models.engine.requests import Request, TokenEvent, check_prompt
from models.engine.scheduler import Scheduler
from models.engine.stats import EngineStats
from models.engine.step import compiler_options, model_step, segment_slots
from models import sharding_rules as sr
from models.kv_cache import KVCache
from models.llama import Llama
from models.sampling import Sampled, SamplingMode, SamplingParams, SamplingRows

log = logging.getLogger(__name__)
_FINISHED = ('done', 'cancelled', 'error')


class Engine(Prefill, DecodeLoop):
  """Continuous batching over a `Llama` with a prefix-aware chunk cache (see the package doc).

  With a model mesh of dp > 1 (data parallel) it keeps one chunk cache per shard
  (`caches`; `cache` is one device's only) and runs every step as one program over the
  mesh (see the package doc).
  """

  def __init__(self, model: Llama, config: EngineConfig, *,
               clock: Callable[[], float] = time.perf_counter):
    if not isinstance(config, EngineConfig):
      raise ValueError(f'config must be an EngineConfig, got {config!r}')
    self.model = model
    self.config = config
    self.clock = clock
    mesh = getattr(model, 'mesh', None)  # tensor and data parallel over the model's mesh
    dp = 1 if mesh is None else mesh.shape.get('dp', 1)
    if dp > 1 and config.overlap_decode:
      raise ValueError(f'EngineConfig.overlap_decode is not supported with data parallelism '
                       f'(the model mesh has dp={dp}); set overlap_decode=False')
    self.num_shards = dp
    # One chunk cache per dp shard (one device: one), each over its own L_s = num_chunks * C
    # tokens; shard d's tokens are [d L_s, (d+1) L_s) of the one KV buffer (sharded over dp).
    cache_config = dataclasses.replace(config.cache, layout=config.decode_policy())
    self.caches = tuple(ChunkCache(cache_config, first_seq_id=d << 40) for d in range(dp))
    self._cache = self.caches[0] if dp == 1 else None
    self._shard_tokens = cache_config.kv_tokens
    self._drop_slot = dp * cache_config.kv_tokens  # a write slot that no shard writes
    dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else model.dtype
    self.kv = KVCache.zeros(model.config, dp * cache_config.kv_tokens, dtype, mesh=mesh)
    self.kv_bytes_per_token = model.config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    self._prefill_policy = config.prefill_policy()
    self._budget = config.shape_budget(dp)
    self._allowed = ({('decode', *s) for s in self._budget.decode}
                     | {('prefill', *s) for s in self._budget.prefill})
    log.info('engine: %s', self._budget)
    # Bound once: hashing the graph definition and flattening the model's state on every
    # call (as a static and a pytree argument) would cost host time on every step.
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    self._params = tuple(leaves)
    # Tests and host-overhead experiments may replace `_model_step` by a stub with the same
    # arguments; a stub may return just the tokens [S] instead of a `Sampled`.
    platform = next(iter(leaves[0].devices())).platform
    self._model_step = jax.jit(functools.partial(model_step, graphdef, treedef),
                               static_argnames=('impl', 'top_logprobs'),
                               donate_argnames=('cache',),
                               compiler_options=compiler_options(
                                   platform, command_buffers=config.command_buffers))
    self.stats = EngineStats()
    self._scheduler = Scheduler(config, self.caches, self.stats, clock)
    self._by_seq: dict[int, Request] = {}
    self.requests: dict[int, Request] = {}
    self._next_id = 0
    self._seen_shapes: set = set()  # step shapes run so far (the first run may compile)
    self._last_new_shape = False
    self._inflight: DecodeStep | None = None  # overlap_decode: the step on the device
    self._plan: tuple | None = None  # (tree key, AttentionPlan) of the decode steps
    if dp > 1:  # KV copies keep the buffer's sharding (tokens over dp)
      self._copy_fn = jax.jit(copy_slots, donate_argnums=(0, 1),
                              out_shardings=(self.kv.k.sharding, self.kv.v.sharding))

  @property
  def cache(self) -> ChunkCache:
    """The chunk cache (one device, or tensor parallel only); with dp > 1 see `caches`."""
    if self._cache is None:
      raise AttributeError(f'with data parallelism (dp={self.num_shards}) the engine has one '
                           'chunk cache per shard: engine.caches')
    return self._cache

  @property
  def stats(self) -> EngineStats:
    return self._stats

  @stats.setter
  def stats(self, value: EngineStats) -> None:  # a reset (experiments) reaches the scheduler
    self._stats = value
    if hasattr(self, '_scheduler'):
      self._scheduler.stats = value

  # ---- the API ----------------------------------------------------------------------------

  def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(), *,
             on_token: Callable[[TokenEvent], None] | None = None,
             arrival: float | None = None) -> int:
    """Queues a request; returns its id. Raises ValueError (naming the argument) if it is
    malformed or can never fit; a refused request changes nothing.

    With `params.n` = k > 1 it queues k requests of the prompt (its samples),
    with ids `rid .. rid + k - 1` (rid is returned; `samples(rid)` lists them),
    one callback `on_token` for all of them (events carry each one's id).
    """
    c = self.config
    if not isinstance(params, SamplingParams):
      raise ValueError(f'params must be a SamplingParams, got {type(params).__name__}')
    prompt = check_prompt(prompt, self.model.config.vocab_size)
    if on_token is not None and not callable(on_token):
      raise ValueError(f'on_token must be callable or None, got {on_token!r}')
    if arrival is not None and not (isinstance(arrival, numbers.Real)
                                    and not isinstance(arrival, bool) and math.isfinite(arrival)):
      raise ValueError(f'arrival must be a finite number of seconds, got {arrival!r}')
    if params.top_logprobs > c.max_top_logprobs:
      raise ValueError(f'top_logprobs={params.top_logprobs} exceeds the engine\'s '
                       f'max_top_logprobs={c.max_top_logprobs}')
    if prompt.size + params.max_new_tokens > c.max_sequence_length:
      raise ValueError(
          f'prompt ({prompt.size}) + max_new_tokens ({params.max_new_tokens}) exceed '
          f'max_sequence_length={c.max_sequence_length}'
      )
    if params.n > c.max_batch:
      raise ValueError(f'n={params.n} samples exceed max_batch={c.max_batch}: it can never fit')
    worst = self.caches[0].max_chunks(prompt.size, reserve_tokens=params.max_new_tokens - 1,
                                  num_samples=params.n)
    if worst > c.num_chunks:
      raise ValueError(
          f'the request needs up to {worst} chunks; the pool has {c.num_chunks}: it can never fit'
      )
    rid = self._next_id
    arrival = self.clock() if arrival is None else float(arrival)
    group = [Request(rid + i, prompt, params, on_token, arrival, rid, i)
             for i in range(params.n)]
    self._next_id = rid + params.n
    for req in group:
      self.requests[req.id] = req
    self._scheduler.add(group)
    return rid

  def samples(self, request_id: int) -> tuple[int, ...]:
    """Ids of the samples of the request's prompt (all n of them), sample 0 first."""
    req = self.requests[request_id]
    return tuple(range(req.first_sample, req.first_sample + req.params.n))

  def cancel(self, request_id: int) -> bool:
    """Cancels a queued or running request (at the next iteration boundary); False if finished."""
    req = self.requests.get(request_id)
    if req is None or req.state in _FINISHED:
      return False
    req.cancel_requested = True
    return True

  @property
  def has_work(self) -> bool:
    return bool(self._scheduler.queue or self._by_seq or self._inflight is not None)

  @property
  def num_running(self) -> int:
    return len(self._by_seq)

  @property
  def num_queued(self) -> int:
    """Queued requests (samples count one each)."""
    return self._scheduler.num_queued

  def step(self) -> list[TokenEvent]:
    """One iteration (admit + prefill, one decode step, retire); returns its events.

    A request whose admission, prefill or callback fails finishes with reason 'error'
    (its `error` says why); the others go on. A failed decode step fails its rows.
    """
    events: list[TokenEvent] = []
    self.stats.iterations += 1
    self._apply_cancellations(events)
    admitted, failed = self._scheduler.admit(len(self._by_seq))
    for group, error in failed:
      for req in group:
        self._finish(req, 'error', events, error=error)
    for group, adm in admitted:
      self._by_seq[adm.seq_id] = group[0]
    self._track_peak()
    if admitted:
      self._prefill(admitted, events)
    try:
      if self.config.overlap_decode:
        self._decode_overlapped(events)
      elif self._by_seq:
        self._decode(events)
    except Exception as e:  # noqa: BLE001 - the engine goes on; this step's rows fail
      self._fail_running(events, e)
    for event in events:
      req = self.requests.get(event.request_id)  # a caller may drop finished requests
      if req is not None and req.on_token is not None:
        try:
          req.on_token(event)
        except Exception as e:  # noqa: BLE001 - a callback fails its own request only
          if req.state not in _FINISHED:
            req.error, req.cancel_requested = f'on_token raised {e!r}', True
    return events

  def stream(self) -> Iterator[TokenEvent]:
    """Yields events until every submitted request is finished."""
    while self.has_work:
      yield from self.step()

  def run(self) -> dict[int, list[int]]:
    """Runs until idle; returns every request's output tokens."""
    for _ in self.stream():
      pass
    return {rid: list(r.output) for rid, r in self.requests.items()}

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()
               ) -> list[list[int]]:
    """Submits the prompts, runs to completion, returns their outputs in order.

    With `params.n` > 1: n outputs per prompt, a prompt's samples together.
    """
    ids = [i for p in prompts for i in self.samples(self.submit(p, params))]
    self.run()
    return [list(self.requests[i].output) for i in ids]

  def kv_bytes_in_use(self) -> int:
    used = sum(cache.num_used_chunks for cache in self.caches)
    return used * self.config.chunk_size * self.kv_bytes_per_token

  def compiled_shape_budget(self) -> ShapeBudget:
    """Every shape the engine's jitted calls may run (fixed by the config; see EngineConfig)."""
    return self._budget

  def warmup(self) -> None:
    """Compiles every shape of the budget now (model steps on empty rows, KV copies)."""
    c, dp = self.config, self.num_shards
    s = dp * c.prefill_sample_rows()
    for b, j in self._budget.decode:
      layout = self._prepare_plan(self._empty_layout(b, j, self.caches[0].config.layout), c.impl)
      if dp > 1:  # as a decode step passes it: private lengths swapped in from the host
        layout = layout.with_private_lengths(np.zeros(dp * b, np.int32))
      feed = (np.zeros(b, np.int32), np.full(b, -1, np.int32)) if c.overlap_decode else None
      rows = None if dp == 1 else np.zeros(dp * b, np.int32)  # dp: decode samples by row index
      self._warm(('decode', b, j), np.zeros((dp * b, 1), np.int32), layout, dp * b, c.impl,
                 rows, feed)
    for t, b, j in self._budget.prefill:
      layout = self._prepare_plan(self._empty_layout(b, j, self._prefill_policy), c.prefill_impl, t)
      self._warm(('prefill', t, b, j), np.zeros((dp * b, t), np.int32), layout, s,
                 c.prefill_impl, np.zeros(s, np.int32), None)
    for size in self._budget.copies:
      self._copy_padded(np.zeros(size, np.int32), np.full(size, self._drop_slot, np.int32))
    jax.block_until_ready(self.kv)

  # ---- the iteration ----------------------------------------------------------------------

  def _apply_cancellations(self, events):
    for req in self._scheduler.take_cancelled():
      self._finish_cancelled(req, events)
    for req in [r for r in self._by_seq.values() if r.cancel_requested]:
      self._finish_cancelled(req, events)

  def _finish_cancelled(self, req: Request, events) -> None:
    if req.error is not None:  # its callback failed
      self._finish(req, 'error', events, error=req.error)
    else:
      self._finish(req, 'cancelled', events)

  # ---- model calls ------------------------------------------------------------------------

  def _sampling_inputs(self, samples: Sequence[Request], s: int, ahead=None):
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

  def _run_model(self, tokens, positions, slots, layout, samples, s, impl, sample_rows=None, *,
                 ahead=None, feed=None, kind=()):
    """Dispatches one model call; returns its draws (on the device, not waited for).

    `samples` are the requests that sample (one per row, or one per entry of
    `sample_rows`, s entries in all); `ahead` [k] counts tokens of theirs not yet
    in their output (sampling keys use the token's index); `feed` = (tokens [b]
    on the device, src [b]) gives rows with src >= 0 their input token from there.
    """
    seeds, streams, index, rows = self._sampling_inputs(samples, s, ahead)
    rows = dataclasses.replace(rows, mode=step_sampling_mode(kind, rows.mode))
    shape = kind + (segment_slots(layout),)
    if shape not in self._allowed:
      warnings.warn(f'engine step shape {shape} is outside its budget ({self._budget})',
                    stacklevel=2)
    key = _shape_key(tokens, s, feed, layout, rows)
    self.stats.shapes.add(key)
    self._last_new_shape = key not in self._seen_shapes
    self._seen_shapes.add(key)
    # Host arrays go to the jitted call as they are: its dispatch uploads them faster than
    # one jnp.asarray each.
    out, self.kv = self._model_step(
        self._params, self.kv, tokens, positions, slots, layout, seeds, streams, index, rows,
        sample_rows, feed=feed, impl=impl, top_logprobs=self.config.max_top_logprobs,
    )
    if not isinstance(out, Sampled):  # a stub's tokens
      out = Sampled(out, None, None, None)
    return out

  def _fetch(self, out: Sampled, reqs: Sequence[Request]) -> tuple:
    """The draws of the first len(reqs) entries on the host: (tokens, log-probs, top ids,
    top log-probs), the last three None unless one of the requests asked for log-probs."""
    k = len(reqs)
    tokens = sr.to_host(out.tokens)[:k]
    if out.logprobs is None or not any(r.params.wants_logprobs for r in reqs):
      return tokens, None, None, None
    return (tokens, sr.to_host(out.logprobs)[:k], sr.to_host(out.top_tokens)[:k],
            sr.to_host(out.top_logprobs)[:k])

  def _prepare_plan(self, layout, impl, query_tokens: int = 1):
    """The model's attention plan over `layout` for `query_tokens` per row (1: decode), prepared
    on the host, outside the jitted step (the layout itself for NO_ATTENTION)."""
    return self.model.prepare_attention(layout, query_tokens=query_tokens, cache=self.kv,
                                        impl=impl, interpret=self.config.interpret)

  def _empty_layout(self, b: int, j: int, policy):
    """A layout of b empty rows with J = j segment slots (0: none), as the cache would shape it
    (with dp: one per shard, stacked)."""
    c = self.caches[0].config
    plan = SharingPlan(b, (), c.chunk_size, ((),) * b, (0,) * b, c.kv_tokens)
    policy = (dataclasses.replace(policy, fixed_shapes=False) if j == 0
              else dataclasses.replace(policy, min_segments=j))
    if self.num_shards > 1:
      return parallel.stack_layouts([plan] * self.num_shards, policy=policy,
                                    max_private_pages=c.max_pages, upload=False)
    return device_layout(plan, policy=policy, max_private_pages=c.max_pages)

  def _warm(self, shape, tokens, layout, s, impl, sample_rows, feed) -> None:
    """Compiles one shape in each sampling mode its steps run (each is a program of its own)."""
    b, t = tokens.shape
    slots = np.full((b, t), self._drop_slot, np.int32)  # writes nothing
    seeds, streams, index, greedy_rows = self._sampling_inputs([], s)
    for mode in sorted({step_sampling_mode(shape, m) for m in SamplingMode}, key=str):
      rows = dataclasses.replace(greedy_rows, mode=mode)
      out, self.kv = self._model_step(
          self._params, self.kv, tokens, np.zeros((b, t), np.int32), slots, layout, seeds,
          streams, index, rows, sample_rows, feed=feed, impl=impl,
          top_logprobs=self.config.max_top_logprobs)
      jax.block_until_ready(out)
      self._seen_shapes.add(_shape_key(tokens, s, feed, layout, rows))

  # ---- handing out tokens -----------------------------------------------------------------

  def _emit(self, reqs: Sequence[Request], drawn: tuple, index: Sequence[int], events) -> None:
    """Gives each request its new token (entry `index[i]` of the draws); finishes those
    that stop or reach max_new_tokens."""
    tokens, logprobs, top_ids, top_values = drawn
    self.stats.generated_tokens += len(reqs)
    for req, i in zip(reqs, index):
      try:
        token, params = int(tokens[i]), req.params
        logprob = top = None
        if params.wants_logprobs and logprobs is not None:
          logprob = float(logprobs[i])
          req.logprobs.append(logprob)
          if params.top_logprobs:
            top = tuple(zip(top_ids[i, : params.top_logprobs].tolist(),
                            top_values[i, : params.top_logprobs].tolist()))
            req.top_logprobs.append(top)
        req.output.append(token)
        n = len(req.output)
        if params.stops(req.output):
          reason = 'stop'
        elif n >= params.max_new_tokens:
          reason = 'length'
        else:
          events.append(TokenEvent(req.id, token, n - 1, False, None, logprob, top))
          continue
        self._finish(req, reason, events, logprob=logprob, top=top)
      except Exception as e:  # noqa: BLE001 - this request fails, the others go on
        self._finish(req, 'error', events, error=e)

  def _finish(self, req: Request, reason: str, events, *, error=None, logprob=None,
              top=None) -> None:
    if req.state in _FINISHED:
      return
    if self._by_seq.get(req.seq_id) is req:
      del self._by_seq[req.seq_id]
      self.caches[req.shard].remove(req.seq_id)
    req.reason, req.finished = reason, self.clock()
    if reason in ('cancelled', 'error'):
      req.state = reason
      if reason == 'error':
        req.error = req.error or (error if isinstance(error, str) else repr(error))
        self.stats.errors += 1
        log.warning('engine: request %d failed: %s', req.id, req.error)
      events.append(TokenEvent(req.id, -1, len(req.output), True, reason))
    else:
      req.state = 'done'
      events.append(TokenEvent(req.id, req.output[-1], len(req.output) - 1, True, reason,
                               logprob, top))

  def _fail_group(self, group: Sequence[Request], events, error) -> None:
    for req in group:
      self._finish(req, 'error', events, error=error)

  def _fail_running(self, events, error) -> None:
    """A decode step failed: its rows (every running request) finish with reason 'error'."""
    self._inflight = None
    for req in [r for r in self.requests.values() if r.state == 'running']:
      self._finish(req, 'error', events, error=error)

  def _track_peak(self) -> None:
    if self.num_shards > 1:  # the sums over the shards
      self.stats.peak_chunks = max(self.stats.peak_chunks,
                                   sum(cache.num_used_chunks for cache in self.caches))
      self.stats.peak_rows = max(self.stats.peak_rows, sum(c.num_rows for c in self.caches))
      return
    self.stats.peak_chunks = max(self.stats.peak_chunks, self.cache.num_used_chunks)
    self.stats.peak_rows = max(self.stats.peak_rows, self.cache.num_rows)


def _shape_key(tokens, s, feed, layout, rows: SamplingRows) -> tuple:
  """What selects a compiled model step: shapes, the layout's structure, the sampling mode."""
  return (tokens.shape, s, feed is not None, jax.tree_util.tree_structure(layout),
          tuple(x.shape for x in jax.tree_util.tree_leaves(layout)), rows.mode)
