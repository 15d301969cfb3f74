"""A continuous-batching serving engine over the Llama and the prefix-aware chunk cache.

Each `step()` is one iteration:

1. Admission: queued requests, first come first served, while the batch has
   room (`max_batch`, counting every sample), the iteration's prefill budget
   allows, and the chunk pool can hold the prompt plus a reservation for every
   token it may still generate, for each of its samples (`ChunkCache.insert`
   with `num_samples`; cached chunks count as room). A request whose prefix is
   being prefilled in this very iteration waits one iteration, so that it
   shares it instead of computing it again. A request that can never fit is
   refused at `submit`.
2. Prefill of the admitted requests: only their unshared tokens (the cache
   shares full chunks, live or cached, and copies partial ones), in calls of
   rows with the same padded length; each sample's first token is sampled from
   the prompt's last position. A prompt with n > 1 samples is prefilled once,
   then forked into n sequences (`ChunkCache.fork`: full chunks shared, the
   partial tail copied).
3. Decode: one token for every live sequence in one jitted call, batch padded
   to a bucket (few compiles); attention over the pool through the cache's
   `TreeLayout` (segment metadata rebuilt only when the tree changes). With
   `overlap_decode`, step k+1 is dispatched before step k's tokens are read,
   so the host's work overlaps the device's.
4. Retirement: finished (stop token, `max_new_tokens`) or cancelled requests
   release their chunks; with `retain_prefixes` their full prompt chunks stay
   cached (a later request with the same prefix does not prefill it) until the
   pool needs the room (LRU eviction).

Parallel sampling: `SamplingParams(n=k)` makes k requests of one prompt, with
consecutive ids `rid, rid + 1, ..., rid + k - 1` (`submit` returns rid;
`samples(rid)` lists them). Each has its own output, events, callback calls
and cancellation; they share the prompt's prefill.

Streaming: `step()` returns the `TokenEvent`s of the iteration, a request's
`on_token` callback gets its own, and `stream()` yields them until all work
is done. `cancel(request_id)` takes effect at the next iteration boundary.

Sampling is per request (greedy or temperature) with a key that depends only
on (seed, request id, token index): a request's tokens do not depend on which
other requests share its batch, and sample i of a prompt draws what a lone
request with id rid + i would.
"""

import collections
import dataclasses
import functools
import time
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import AttentionImpl
from hydrajax.chunk_cache import (
    CapacityError, ChunkCache, ChunkCacheConfig, LayoutPolicy, copy_slots, next_power_of_two,
)
from models.kv_cache import KVCache
from models.llama import Llama


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and policies of an engine.

  Attributes:
    num_chunks: chunks in the KV pool (memory: num_chunks * chunk_size tokens).
    chunk_size: C, tokens per chunk.
    max_batch: most live sequences.
    max_sequence_length: longest prompt + generation.
    share_prefixes: False is the no-sharing baseline (same engine, every sequence on its own).
    retain_prefixes: keep finished requests' full prompt chunks as an LRU prefix cache
      (only with share_prefixes; off, a finished request frees all of its chunks).
    max_prefill_tokens: padded prefill tokens per iteration (one request may exceed it alone).
    max_prefill_rows: most requests in one prefill call.
    decode_buckets: padded decode batch sizes (ascending; the last must be >= max_batch);
      empty: powers of two up to max_batch.
    min_prefill_len: smallest padded prefill length (lengths are padded to powers of two).
    layout: static-shape policy of decode layouts (all rows).
    prefill_layout: policy of prefill layouts (default: adaptive shapes with layout's
      kv_piece and min_private_pages: padded segment slots cost T times more there).
    impl: attention implementation of decode steps.
    prefill_impl: attention implementation of prefill calls.
    cache_dtype: KV dtype (default: the model's).
    seed: sampling seed.
    overlap_decode: dispatch decode step k+1 before waiting for step k, so that the host's work
      (tree, layout, dispatch, handing out tokens) overlaps the device's. Step k+1 takes its
      input tokens from step k's output on the device; the tree records them when they are
      back. Outputs are the same. A request that hits a stop token runs one step more (its
      extra token is dropped), and finishes one iteration later.
  """

  num_chunks: int
  chunk_size: int = 64
  max_batch: int = 64
  max_sequence_length: int = 4096
  share_prefixes: bool = True
  retain_prefixes: bool = True
  max_prefill_tokens: int = 8192
  max_prefill_rows: int = 8
  decode_buckets: tuple[int, ...] = ()
  min_prefill_len: int = 16
  layout: LayoutPolicy = LayoutPolicy()
  prefill_layout: LayoutPolicy | None = None
  impl: AttentionImpl | str = AttentionImpl.AUTO
  prefill_impl: AttentionImpl | str = AttentionImpl.AUTO
  cache_dtype: str | None = None
  seed: int = 0
  overlap_decode: bool = False

  def __post_init__(self):
    for name in ('num_chunks', 'chunk_size', 'max_batch', 'max_sequence_length',
                 'max_prefill_tokens', 'max_prefill_rows', 'min_prefill_len'):
      if getattr(self, name) < 1:
        raise ValueError(f'EngineConfig.{name} must be >= 1, got {getattr(self, name)}')
    buckets = tuple(self.decode_buckets)
    if buckets and (list(buckets) != sorted(buckets) or buckets[-1] < self.max_batch):
      raise ValueError(
          f'decode_buckets must ascend and end >= max_batch={self.max_batch}, got {buckets}'
      )

  def decode_rows(self, b: int) -> int:
    """The padded batch of a decode step with b live sequences."""
    for bucket in self.decode_buckets:
      if bucket >= b:
        return bucket
    return next_power_of_two(max(b, 1))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a request is continued.

  Attributes:
    max_new_tokens: tokens to generate (fewer after a stop token).
    temperature: 0 is greedy; > 0 samples from softmax(logits / temperature).
    stop_tokens: ids that end the request (the stop token is returned).
    n: samples of the prompt, each a request of its own (see `Engine.submit`).
  """

  max_new_tokens: int = 16
  temperature: float = 0.0
  stop_tokens: tuple[int, ...] = ()
  n: int = 1

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f'max_new_tokens must be >= 1, got {self.max_new_tokens}')
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if self.n < 1:
      raise ValueError(f'n must be >= 1, got {self.n}')


class TokenEvent(NamedTuple):
  """One streamed token (or a cancellation, token -1). A NamedTuple: cheap to make per token."""

  request_id: int
  token: int
  index: int  # 0-based index of the token among the request's outputs
  finished: bool
  reason: str | None = None  # 'stop', 'length' or 'cancelled' when finished


@dataclasses.dataclass
class Request:
  """A request's state and timings (seconds of the engine's clock).

  `first_sample` is the id of sample 0 of its prompt (its own id when n = 1),
  `sample_index` its own index; `shared_tokens`, `cached_tokens` (the part of
  them reused from finished requests) and `prefilled_tokens` describe its
  prompt's admission, which all its samples share.
  """

  id: int
  prompt: np.ndarray
  params: SamplingParams
  on_token: Callable[[TokenEvent], None] | None = None
  arrival: float = 0.0
  first_sample: int = -1
  sample_index: int = 0
  admitted: float | None = None
  first_token: float | None = None
  finished: float | None = None
  state: str = 'queued'  # queued, running, done, cancelled
  reason: str | None = None
  output: list[int] = dataclasses.field(default_factory=list)
  seq_id: int = -1
  shared_tokens: int = 0
  cached_tokens: int = 0
  prefilled_tokens: int = 0
  cancel_requested: bool = False


@dataclasses.dataclass
class EngineStats:
  """Counters of an engine's life (seconds of the engine's clock).

  A decode step's time is `decode_host_s` (host overhead: the tree and its
  metadata, the batch arrays and their upload, the dispatch of the jitted call,
  and handing out the tokens) plus `decode_wait_s` (waiting for the device's
  result): step wall time minus the wait for the device. Of the host part,
  `decode_prepare_s` is the tree, layout and arrays, `decode_dispatch_s` the
  jitted call's dispatch. With `overlap_decode` a step's prepare and dispatch
  run while the device computes the step before it, so its host time is
  hidden rather than added; its wait is what is left of the device's time.
  A step whose shapes
  the engine runs for the first time (it may compile) is counted apart, in
  `new_shape_steps` and `new_shape_s`, not in the decode figures.
  """

  iterations: int = 0
  decode_steps: int = 0
  decode_rows: int = 0
  decode_chunks: int = 0  # chunks in use, summed over the counted decode steps
  decode_s: float = 0.0
  decode_host_s: float = 0.0
  decode_prepare_s: float = 0.0  # host: the tree, layout and batch arrays, before the dispatch
  decode_dispatch_s: float = 0.0  # host: the jitted call's dispatch (arguments, uploads)
  decode_wait_s: float = 0.0
  new_shape_steps: int = 0
  new_shape_s: float = 0.0
  prefill_calls: int = 0
  prefill_tokens: int = 0
  prefill_padded_tokens: int = 0
  prefill_s: float = 0.0
  shared_tokens: int = 0
  cached_tokens: int = 0
  copied_tokens: int = 0
  forked_samples: int = 0
  generated_tokens: int = 0
  peak_chunks: int = 0
  peak_rows: int = 0
  shapes: set = dataclasses.field(default_factory=set)

  def summary(self) -> dict:
    out = {k: v for k, v in dataclasses.asdict(self).items() if k != 'shapes'}
    out['distinct_step_shapes'] = len(self.shapes)
    out['host_overhead_fraction'] = self.decode_host_s / self.decode_s if self.decode_s else 0.0
    out['mean_decode_step_ms'] = 1e3 * self.decode_s / max(self.decode_steps, 1)
    out['mean_decode_host_ms'] = 1e3 * self.decode_host_s / max(self.decode_steps, 1)
    out['mean_decode_wait_ms'] = 1e3 * self.decode_wait_s / max(self.decode_steps, 1)
    out['mean_decode_prepare_ms'] = 1e3 * self.decode_prepare_s / max(self.decode_steps, 1)
    out['mean_decode_dispatch_ms'] = 1e3 * self.decode_dispatch_s / max(self.decode_steps, 1)
    return out


@dataclasses.dataclass
class _DecodeStep:
  """A decode step's inputs, and once dispatched its tokens on the device."""

  model_args: tuple  # tokens, positions, slots [b, 1], layout
  reqs: list  # Request of each live row, row order
  b: int  # padded rows
  ahead: np.ndarray  # [rows] 1 where the input token is the previous step's, still on the device
  feed: tuple | None  # (previous step's tokens [b], src [b]) for overlapped steps
  patch: tuple  # (seq ids, positions, rows of the previous step): placeholders to record
  used_chunks: int
  new_shape: bool = False
  tokens_out: object = None  # [b] int32 on the device
  host: tuple = (0.0, 0.0)  # prepare, dispatch seconds


def _row_keys(key, request_ids, indices):
  return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(key, r), i))(
      request_ids, indices)


def _sample(logits, key, request_ids, indices, temperature):
  """logits [B, V] f32 -> tokens [B] int32: greedy where temperature == 0."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  keys = _row_keys(key, request_ids, indices)
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def _model_step(graphdef, treedef, params, cache, tokens, positions, slots, layout, key,
                request_ids, indices, temperature, sample_rows=None, feed=None, *, impl):
  """One model call: writes the new tokens' KV, samples next tokens from last positions.

  One token per row, or with `sample_rows` [S] one per entry, from that row's
  logits (request_ids, indices, temperature are then [S]). `params` are the
  model's state leaves (`treedef` rebuilds the state). `feed` = (previous
  tokens [B], src [B]) replaces the tokens of rows with src >= 0.
  """
  if feed is not None:  # rows with src >= 0 take the previous step's token, still on the device
    previous, src = feed
    tokens = jnp.where(src[:, None] >= 0, previous[jnp.maximum(src, 0)][:, None], tokens)
  model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
  h, cache = model.forward_hidden(tokens, positions, cache, slots, layout, impl=impl)
  logits = model.logits(h[:, -1])  # [B, V]
  if sample_rows is not None:
    logits = logits[sample_rows]
  return _sample(logits, key, request_ids, indices, temperature), cache


class Engine:
  """Continuous batching over a `Llama` with a prefix-aware chunk cache (see the module doc)."""

  def __init__(self, model: Llama, config: EngineConfig, *,
               clock: Callable[[], float] = time.perf_counter):
    self.model = model
    self.config = config
    self.clock = clock
    self.cache = ChunkCache(ChunkCacheConfig(
        num_chunks=config.num_chunks, chunk_size=config.chunk_size,
        max_sequence_length=config.max_sequence_length, max_sequences=config.max_batch,
        share_prefixes=config.share_prefixes,
        retain_prefixes=config.share_prefixes and config.retain_prefixes, layout=config.layout,
    ))
    dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else model.dtype
    mesh = getattr(model, 'mesh', None)  # tensor parallel over the model's mesh
    if mesh is not None and mesh.shape.get('dp', 1) > 1:
      raise ValueError(f'the engine runs tensor parallel only (one chunk pool); the model mesh '
                       f'has dp={mesh.shape["dp"]}: run one engine per dp group instead')
    self.kv = KVCache.zeros(model.config, config.num_chunks * config.chunk_size, dtype,
                            mesh=mesh)
    self.kv_bytes_per_token = model.config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    self._prefill_policy = config.prefill_layout or LayoutPolicy(
        kv_piece=config.layout.kv_piece, min_private_pages=config.layout.min_private_pages)
    # Bound once: hashing the graph definition and flattening the model's state on every
    # call (as a static and a pytree argument) would cost host time on every step.
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    self._params = tuple(leaves)
    self._model_step = jax.jit(functools.partial(_model_step, graphdef, treedef),
                               static_argnames=('impl',), donate_argnames=('cache',))
    self._key = jax.random.key(config.seed)
    self._queue: collections.deque[list[Request]] = collections.deque()  # a prompt's samples
    self._by_seq: dict[int, Request] = {}
    self.requests: dict[int, Request] = {}
    self._next_id = 0
    self._seen_shapes: set = set()  # step shapes run so far (the first run may compile)
    self._last_new_shape = False
    self._inflight: _DecodeStep | None = None  # overlap_decode: the step on the device
    self.stats = EngineStats()

  # ---- the API ----------------------------------------------------------------------------

  def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(), *,
             on_token: Callable[[TokenEvent], None] | None = None,
             arrival: float | None = None) -> int:
    """Queues a request; returns its id. Raises ValueError if it can never fit.

    With `params.n` = k > 1 it queues k requests of the prompt (its samples),
    with ids `rid .. rid + k - 1` (rid is returned; `samples(rid)` lists them),
    one callback `on_token` for all of them (events carry each one's id).
    """
    prompt = np.asarray(prompt, np.int64).reshape(-1)
    c = self.config
    if prompt.size < 1:
      raise ValueError('prompt must hold at least one token id')
    if prompt.min() < 0 or prompt.max() >= self.model.config.vocab_size:
      raise ValueError(f'prompt token ids must be in [0, {self.model.config.vocab_size})')
    if prompt.size + params.max_new_tokens > c.max_sequence_length:
      raise ValueError(
          f'prompt ({prompt.size}) + max_new_tokens ({params.max_new_tokens}) exceed '
          f'max_sequence_length={c.max_sequence_length}'
      )
    if params.n > c.max_batch:
      raise ValueError(f'n={params.n} samples exceed max_batch={c.max_batch}: it can never fit')
    worst = self.cache.max_chunks(prompt.size, reserve_tokens=params.max_new_tokens - 1,
                                  num_samples=params.n)
    if worst > c.num_chunks:
      raise ValueError(
          f'the request needs up to {worst} chunks; the pool has {c.num_chunks}: it can never fit'
      )
    rid = self._next_id
    self._next_id += params.n
    arrival = self.clock() if arrival is None else arrival
    group = [Request(rid + i, prompt, params, on_token, arrival, rid, i) for i in range(params.n)]
    for req in group:
      self.requests[req.id] = req
    self._queue.append(group)
    return rid

  def samples(self, request_id: int) -> tuple[int, ...]:
    """Ids of the samples of the request's prompt (all n of them), sample 0 first."""
    req = self.requests[request_id]
    return tuple(range(req.first_sample, req.first_sample + req.params.n))

  def cancel(self, request_id: int) -> bool:
    """Cancels a queued or running request (at the next iteration boundary); False if finished."""
    req = self.requests.get(request_id)
    if req is None or req.state in ('done', 'cancelled'):
      return False
    req.cancel_requested = True
    return True

  @property
  def has_work(self) -> bool:
    return bool(self._queue or self._by_seq or self._inflight is not None)

  @property
  def num_running(self) -> int:
    return len(self._by_seq)

  @property
  def num_queued(self) -> int:
    """Queued requests (samples count one each)."""
    return sum(len(g) for g in self._queue)

  def step(self) -> list[TokenEvent]:
    """One iteration (admit + prefill, one decode step, retire); returns its events."""
    events: list[TokenEvent] = []
    self.stats.iterations += 1
    self._apply_cancellations(events)
    admitted = self._admit()
    if admitted:
      self._prefill(admitted, events)
    if self.config.overlap_decode:
      self._decode_overlapped(events)
    elif self._by_seq:
      self._decode(events)
    for event in events:
      cb = self.requests[event.request_id].on_token
      if cb is not None:
        cb(event)
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
    return self.cache.num_used_chunks * self.config.chunk_size * self.kv_bytes_per_token

  # ---- the iteration ----------------------------------------------------------------------

  def _apply_cancellations(self, events):
    for group in [g for g in self._queue if any(r.cancel_requested for r in g)]:
      for req in [r for r in group if r.cancel_requested]:  # its other samples stay queued
        group.remove(req)
        self._finish(req, 'cancelled', events, cancelled=True)
    if not all(self._queue):
      self._queue = collections.deque(g for g in self._queue if g)
    for req in [r for r in self._by_seq.values() if r.cancel_requested]:
      self._finish(req, 'cancelled', events, cancelled=True)

  def _admit(self) -> list[tuple[list[Request], object]]:
    """Admits queued prompts; returns (the prompt's samples, its `Admission`) of each."""
    c, cache = self.config, self.cache
    admitted, budget, rows = [], c.max_prefill_tokens, len(self._by_seq)
    while self._queue and rows + len(self._queue[0]) <= c.max_batch:
      group = self._queue[0]
      lead = group[0]
      reserve = lead.params.max_new_tokens - 1
      match = cache.match(lead.prompt, reserve_tokens=reserve, num_samples=len(group))
      if match.pending:
        break  # its prefix is being prefilled now: next iteration it is shared instead
      padded = self._prefill_len(lead.prompt.size - match.shared_tokens - match.copied_tokens)
      if admitted and padded > budget:
        break
      try:
        adm = cache.insert(lead.prompt, reserve_tokens=reserve, num_samples=len(group))
      except CapacityError:
        break  # waits for memory; submit() guaranteed it fits an empty pool
      self._queue.popleft()
      budget -= padded
      rows += len(group)
      now = self.clock()
      for req in group:
        req.state, req.admitted = 'running', now
        req.shared_tokens, req.cached_tokens = adm.shared_tokens, adm.cached_tokens
        req.prefilled_tokens = adm.num_tokens - adm.prefill_start
      lead.seq_id = adm.seq_id  # the others get theirs from the fork after the prefill
      self._by_seq[adm.seq_id] = lead
      admitted.append((group, adm))
      self.stats.shared_tokens += adm.shared_tokens
      self.stats.cached_tokens += adm.cached_tokens
      self.stats.copied_tokens += adm.copied_tokens
    self._track_peak()
    return admitted

  def _prefill_len(self, n: int) -> int:
    return max(next_power_of_two(n), self.config.min_prefill_len)

  def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
    """Runs KV copies (copy on write), padded to a power of two."""
    if src.size:
      size = next_power_of_two(max(src.size, 64))
      pad = lambda x, fill: np.concatenate([x, np.full(size - x.size, fill, np.int32)])
      k, v = copy_slots(self.kv.k, self.kv.v, jnp.asarray(pad(src, 0)),
                        jnp.asarray(pad(dst, self.cache.config.kv_tokens)))
      self.kv = KVCache(k, v)

  def _prefill(self, admitted, events):
    c, cache = self.config, self.cache
    t0 = self.clock()
    self._copy(np.concatenate([a.copy_src for _, a in admitted]),
               np.concatenate([a.copy_dst for _, a in admitted]))
    by_len: dict[int, list] = {}
    for group, adm in admitted:
      t = self._prefill_len(adm.num_tokens - adm.prefill_start)
      by_len.setdefault(t, []).append((group, adm))
    forks = []  # (samples, their first tokens), forked once every prefill call has run
    for t, items in sorted(by_len.items()):
      items.sort(key=lambda x: cache.row(x[1].seq_id))
      per_call = max(1, min(c.max_prefill_rows, c.max_prefill_tokens // t))
      for i in range(0, len(items), per_call):
        forks += self._prefill_call(items[i : i + per_call], t)
    src, dst = [], []
    for group, _ in forks:
      if len(group) > 1:
        f = cache.fork(group[0].seq_id, len(group),
                       reserve_tokens=group[0].params.max_new_tokens - 1)
        src.append(f.copy_src)
        dst.append(f.copy_dst)
        for req, sid in zip(group[1:], f.seq_ids[1:]):
          req.seq_id = sid
          self._by_seq[sid] = req
        self.stats.forked_samples += len(group) - 1
    if src:
      self._copy(np.concatenate(src), np.concatenate(dst))
    now = self.clock()
    for group, tokens in forks:
      for req in group:
        req.first_token = now
      self._emit(group, tokens, events)
    self._track_peak()
    self.stats.prefill_s += self.clock() - t0

  def _prefill_call(self, items, t):
    """One prefill call of (samples, admission) items; returns (samples, first tokens) of each."""
    cache, length = self.cache, self.cache.config.kv_tokens
    b = next_power_of_two(len(items))
    tokens = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    slots = np.full((b, t), length, np.int32)
    for r, (group, adm) in enumerate(items):  # left-padded: a row's new tokens are its last T
      n = adm.num_tokens - adm.prefill_start
      tokens[r, t - n :] = group[0].prompt[adm.prefill_start :]
      positions[r, t - n :] = np.arange(adm.prefill_start, adm.num_tokens)
      slots[r, t - n :] = adm.prefill_slots
    layout = cache.device_layout([adm.seq_id for _, adm in items], num_rows=b,
                                 policy=self._prefill_policy)
    samples = [req for group, _ in items for req in group]
    rows = None  # one token per row, unless a prompt has several samples
    if len(samples) > len(items):
      rows = np.zeros(next_power_of_two(len(samples)), np.int32)
      rows[: len(samples)] = [r for r, (group, _) in enumerate(items) for _ in group]
    new = self._run_model(tokens, positions, slots, layout, samples, b, self.config.prefill_impl,
                          rows)
    new = np.asarray(new)[: len(samples)].tolist()
    self.stats.prefill_calls += 1
    self.stats.prefill_tokens += sum(adm.num_tokens - adm.prefill_start for _, adm in items)
    self.stats.prefill_padded_tokens += b * t
    out, i = [], 0
    for group, adm in items:
      cache.commit(adm.seq_id)  # its KV is written: others may share it now
      out.append((group, new[i : i + len(group)]))
      i += len(group)
    return out

  def _decode(self, events):
    """One decode step, waited for (the engine without `overlap_decode`)."""
    self._collect(self._dispatch(None), events, None)

  def _decode_overlapped(self, events):
    """Dispatches step k+1, then waits for step k (`overlap_decode`; see EngineConfig)."""
    prev, self._inflight = self._inflight, None
    if prev is not None:  # a row whose token in flight is its last is in no further step
      for req in prev.reqs:
        if (req.state == 'running' and self._by_seq.get(req.seq_id) is req
            and len(req.output) + 1 >= req.params.max_new_tokens):
          del self._by_seq[req.seq_id]
          self.cache.remove(req.seq_id)  # its KV is written; the token comes at the collect
      if self._by_seq and self.config.decode_rows(self.cache.num_rows) != prev.b:
        self._collect(prev, events, None)  # a new batch size: feed this step from the host
        prev = None
    if not self._by_seq:
      if prev is not None:
        self._collect(prev, events, None)
      return
    self._inflight = self._dispatch(prev)
    if prev is not None:
      self._collect(prev, events, self._inflight.patch)

  def _dispatch(self, prev: '_DecodeStep | None') -> '_DecodeStep':
    """Prepares and dispatches a decode step (not waited for)."""
    t0 = self.clock()
    step = self._prepare_decode(prev)
    tp = self.clock()
    step.tokens_out = self._run_model(*step.model_args, step.reqs, step.b, self.config.impl,
                                      ahead=step.ahead, feed=step.feed)
    step.new_shape = self._last_new_shape
    step.host = (tp - t0, self.clock() - tp)
    return step

  def _collect(self, step: '_DecodeStep', events, patch) -> None:
    """Waits for a dispatched step's tokens; records those a later step appended; emits."""
    t1 = self.clock()
    new = np.asarray(step.tokens_out)[: len(step.reqs)]
    t2 = self.clock()
    if patch is not None and patch[0]:
      seq_ids, positions, rows = patch
      self.cache.record_tokens(seq_ids, positions, new[rows])
    live = [i for i, req in enumerate(step.reqs) if req.state == 'running']  # not cancelled
    self._emit([step.reqs[i] for i in live], new[live].tolist(), events)
    t3 = self.clock()
    self._count_decode(step, host=(step.host[0], step.host[1], t3 - t2), wait=t2 - t1)

  def _prepare_decode(self, prev: '_DecodeStep | None') -> '_DecodeStep':
    """The next decode step's inputs; rows in `prev` take their token from its device output."""
    cache = self.cache
    rows = cache.rows
    reqs = [self._by_seq[sid] for sid in rows]
    b = self.config.decode_rows(len(rows))
    src = np.full(b, -1, np.int32)  # row of `prev` whose output is this row's input token
    if prev is not None:
      where = {id(req): i for i, req in enumerate(prev.reqs)}
      src[: len(reqs)] = [where.get(id(req), -1) for req in reqs]
    ahead = (src[: len(reqs)] >= 0).astype(np.int32)  # its newest token is still on the device
    last = np.array([-1 if a else req.output[-1] for req, a in zip(reqs, ahead)], np.int64)
    slots = np.full((b, 1), cache.config.kv_tokens, np.int32)
    slots[: len(rows), 0] = cache.append(last)  # -1: a placeholder until the token is back
    tokens = np.zeros((b, 1), np.int32)
    tokens[: len(rows), 0] = np.maximum(last, 0)
    positions = np.zeros((b, 1), np.int32)
    lengths = cache.lengths()
    positions[: len(rows), 0] = lengths - 1
    layout = cache.device_layout(num_rows=b)
    self._track_peak()
    fed = np.flatnonzero(ahead)
    feed = None
    if self.config.overlap_decode:  # one input structure for every overlapped step
      feed = (prev.tokens_out if prev is not None else np.zeros(b, np.int32), src)
    return _DecodeStep(
        model_args=(tokens, positions, slots, layout), reqs=reqs, b=b, ahead=ahead, feed=feed,
        patch=([rows[i] for i in fed], (lengths[fed] - 1).tolist(), src[fed]),
        used_chunks=cache.num_used_chunks)

  def _count_decode(self, step: '_DecodeStep', *, host: tuple[float, float, float],
                    wait: float) -> None:
    stats = self.stats
    prepare, dispatch, emit = host
    total = prepare + dispatch + emit + wait
    if step.new_shape:  # a first run of these shapes: maybe a compile
      stats.new_shape_steps += 1
      stats.new_shape_s += total
      return
    stats.decode_host_s += prepare + dispatch + emit
    stats.decode_prepare_s += prepare
    stats.decode_dispatch_s += dispatch
    stats.decode_wait_s += wait
    stats.decode_s += total
    stats.decode_steps += 1
    stats.decode_rows += len(step.reqs)
    stats.decode_chunks += step.used_chunks

  def _run_model(self, tokens, positions, slots, layout, samples, b, impl, sample_rows=None, *,
                 ahead=None, feed=None):
    """Dispatches one model call; returns its sampled tokens (on the device, not waited for).

    `samples` are the requests that sample (one per row, or one per entry of
    `sample_rows`); `ahead` [k] counts tokens of theirs not yet in their output
    (sampling keys use the token's index); `feed` = (tokens [b] on the device,
    src [b]) gives rows with src >= 0 their input token from there.
    """
    s, k = (b if sample_rows is None else sample_rows.size), len(samples)
    ids = np.zeros(s, np.int32)
    index = np.zeros(s, np.int32)
    temp = np.zeros(s, np.float32)
    ids[:k] = [req.id for req in samples]
    index[:k] = [len(req.output) for req in samples]
    if ahead is not None:
      index[:k] += ahead
    temp[:k] = [req.params.temperature for req in samples]
    shapes = (tokens.shape, s, feed is not None, jax.tree_util.tree_structure(layout),
              tuple(x.shape for x in jax.tree_util.tree_leaves(layout)))
    self.stats.shapes.add(shapes)
    self._last_new_shape = shapes not in self._seen_shapes
    self._seen_shapes.add(shapes)
    # Host arrays go to the jitted call as they are: its dispatch uploads them faster than
    # one jnp.asarray each.
    new, self.kv = self._model_step(
        self._params, self.kv, tokens, positions, slots, layout, self._key, ids,
        index, temp, sample_rows, feed=feed, impl=impl,
    )
    return new

  def _emit(self, reqs: Sequence[Request], tokens: Sequence[int], events) -> None:
    """Gives each request its new token; finishes those that stop or reach max_new_tokens."""
    self.stats.generated_tokens += len(reqs)
    for req, token in zip(reqs, tokens):
      out, params = req.output, req.params
      out.append(token)
      if token in params.stop_tokens:
        self._finish(req, 'stop', events)
      elif len(out) >= params.max_new_tokens:
        self._finish(req, 'length', events)
      else:
        events.append(TokenEvent(req.id, token, len(out) - 1, False))

  def _finish(self, req: Request, reason: str, events, cancelled: bool = False) -> None:
    if self._by_seq.get(req.seq_id) is req:
      del self._by_seq[req.seq_id]
      self.cache.remove(req.seq_id)
    req.state = 'cancelled' if cancelled else 'done'
    req.reason, req.finished = reason, self.clock()
    if cancelled:
      events.append(TokenEvent(req.id, -1, len(req.output), True, reason))
    else:
      events.append(TokenEvent(req.id, req.output[-1], len(req.output) - 1, True, reason))

  def _track_peak(self) -> None:
    self.stats.peak_chunks = max(self.stats.peak_chunks, self.cache.num_used_chunks)
    self.stats.peak_rows = max(self.stats.peak_rows, self.cache.num_rows)
