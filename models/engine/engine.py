"""The Engine: its API, the iteration, prefill and the decode loop (see the package doc)."""

import dataclasses
import functools
import logging
import math
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import SharingPlan
from hydrajax.chunk_cache import ChunkCache, copy_slots, device_layout, next_power_of_two
from models.engine.config import EngineConfig, ShapeBudget
from models.engine.requests import Request, TokenEvent, check_prompt
from models.engine.scheduler import Scheduler
from models.engine.stats import EngineStats
from models.engine.step import model_step, segment_slots
from models.kv_cache import KVCache
from models.llama import Llama
from models.sampling import Sampled, SamplingParams, SamplingRows, _is_number

log = logging.getLogger(__name__)
_FINISHED = ('done', 'cancelled', 'error')


@dataclasses.dataclass
class _DecodeStep:
  """A decode step's inputs, and once dispatched its draws on the device."""

  model_args: tuple  # tokens, positions, slots [b, 1], layout
  reqs: list  # Request of each live row, row order
  b: int  # padded rows
  ahead: np.ndarray  # [rows] 1 where the input token is the previous step's, still on the device
  feed: tuple | None  # (previous step's tokens [b], src [b]) for overlapped steps
  patch: tuple  # (seq ids, positions, rows of the previous step): placeholders to record
  used_chunks: int
  new_shape: bool = False
  out: Sampled | None = None  # on the device
  host: tuple = (0.0, 0.0)  # prepare, dispatch seconds

  @property
  def tokens_out(self):
    return self.out.tokens


class Engine:
  """Continuous batching over a `Llama` with a prefix-aware chunk cache (see the package doc)."""

  def __init__(self, model: Llama, config: EngineConfig, *,
               clock: Callable[[], float] = time.perf_counter):
    if not isinstance(config, EngineConfig):
      raise ValueError(f'config must be an EngineConfig, got {config!r}')
    self.model = model
    self.config = config
    self.clock = clock
    self.cache = ChunkCache(dataclasses.replace(config.cache, layout=config.decode_policy()))
    dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else model.dtype
    mesh = getattr(model, 'mesh', None)  # tensor parallel over the model's mesh
    if mesh is not None and mesh.shape.get('dp', 1) > 1:
      raise ValueError(f'the engine runs tensor parallel only (one chunk pool); the model mesh '
                       f'has dp={mesh.shape["dp"]}: run one engine per dp group instead')
    self.kv = KVCache.zeros(model.config, config.num_chunks * config.chunk_size, dtype,
                            mesh=mesh)
    self.kv_bytes_per_token = model.config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    self._prefill_policy = config.prefill_policy()
    self._budget = config.shape_budget()
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
    self._model_step = jax.jit(functools.partial(model_step, graphdef, treedef),
                               static_argnames=('impl', 'top_logprobs'),
                               donate_argnames=('cache',))
    self.stats = EngineStats()
    self._scheduler = Scheduler(config, self.cache, self.stats, clock)
    self._by_seq: dict[int, Request] = {}
    self.requests: dict[int, Request] = {}
    self._next_id = 0
    self._seen_shapes: set = set()  # step shapes run so far (the first run may compile)
    self._last_new_shape = False
    self._inflight: _DecodeStep | None = None  # overlap_decode: the step on the device

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
    if arrival is not None and not (_is_number(arrival) and math.isfinite(arrival)):
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
    worst = self.cache.max_chunks(prompt.size, reserve_tokens=params.max_new_tokens - 1,
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
      req = self.requests[event.request_id]
      if req.on_token is not None:
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
    return self.cache.num_used_chunks * self.config.chunk_size * self.kv_bytes_per_token

  def compiled_shape_budget(self) -> ShapeBudget:
    """Every shape the engine's jitted calls may run (fixed by the config; see EngineConfig)."""
    return self._budget

  def warmup(self) -> None:
    """Compiles every shape of the budget now (model steps on empty rows, KV copies)."""
    c, s = self.config, self.config.prefill_sample_rows()
    for b, j in self._budget.decode:
      layout = self._empty_layout(b, j, self.cache.config.layout)
      feed = (np.zeros(b, np.int32), np.full(b, -1, np.int32)) if c.overlap_decode else None
      self._warm(('decode', b, j), np.zeros((b, 1), np.int32), layout, b, c.impl, None, feed)
    for t, b, j in self._budget.prefill:
      layout = self._empty_layout(b, j, self._prefill_policy)
      self._warm(('prefill', t, b, j), np.zeros((b, t), np.int32), layout, s, c.prefill_impl,
                 np.zeros(s, np.int32), None)
    for size in self._budget.copies:
      self._copy_padded(np.zeros(size, np.int32), np.full(size, self.cache.config.kv_tokens,
                                                          np.int32))
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

  def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
    """Runs KV copies (copy on write), padded to a power of two."""
    if src.size:
      size = next_power_of_two(max(src.size, 64))
      pad = lambda x, fill: np.concatenate([x, np.full(size - x.size, fill, np.int32)])
      self._copy_padded(pad(src, 0), pad(dst, self.cache.config.kv_tokens))

  def _copy_padded(self, src: np.ndarray, dst: np.ndarray) -> None:
    k, v = copy_slots(self.kv.k, self.kv.v, jnp.asarray(src), jnp.asarray(dst))
    self.kv = KVCache(k, v)

  def _prefill(self, admitted, events):
    """Prefills the admitted prompts (only their unshared tokens), then forks their samples.

    Calls group rows of the same padded length; each sample's first token is drawn from
    its prompt's last position. A failed call fails its prompts only.
    """
    c, cache = self.config, self.cache
    t0 = self.clock()
    try:
      self._copy(np.concatenate([a.copy_src for _, a in admitted]),
                 np.concatenate([a.copy_dst for _, a in admitted]))
    except Exception as e:  # noqa: BLE001
      for group, _ in admitted:
        self._fail_group(group, events, e)
      return
    by_len: dict[int, list] = {}
    for group, adm in admitted:
      t = c.prefill_len(adm.num_tokens - adm.prefill_start)
      by_len.setdefault(t, []).append((group, adm))
    forks = []  # (samples, their draws), forked once every prefill call has run
    for t, items in sorted(by_len.items()):
      items.sort(key=lambda x: cache.row(x[1].seq_id))
      per_call = c.prefill_rows_per_call(t)
      for i in range(0, len(items), per_call):
        batch = items[i : i + per_call]
        try:
          forks += self._prefill_call(batch, t)
        except Exception as e:  # noqa: BLE001 - these prompts fail, the others go on
          for group, _ in batch:
            self._fail_group(group, events, e)
    src, dst = [], []
    for group, _ in forks:
      if len(group) > 1:
        try:
          f = cache.fork(group[0].seq_id, len(group),
                         reserve_tokens=group[0].params.max_new_tokens - 1)
        except Exception as e:  # noqa: BLE001
          self._fail_group(group, events, e)
          continue
        src.append(f.copy_src)
        dst.append(f.copy_dst)
        for req, sid in zip(group[1:], f.seq_ids[1:]):
          req.seq_id = sid
          self._by_seq[sid] = req
        self.stats.forked_samples += len(group) - 1
    if src:
      self._copy(np.concatenate(src), np.concatenate(dst))
    now = self.clock()
    for group, drawn in forks:
      live = [i for i, req in enumerate(group) if req.state == 'running']
      for req in group:
        req.first_token = now
      self._emit([group[i] for i in live], drawn, live, events)
    self._track_peak()
    self.stats.prefill_s += self.clock() - t0

  def _prefill_call(self, items, t):
    """One prefill call of (samples, admission) items; returns (samples, their draws) of each.

    The draws are host arrays (tokens, log-probs, top ids, top log-probs) with one row per
    sample of the item, in order.
    """
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
    # Every prefill samples a fixed number of rows (a prompt's samples each draw): one shape.
    rows = np.zeros(self.config.prefill_sample_rows(), np.int32)
    rows[: len(samples)] = [r for r, (group, _) in enumerate(items) for _ in group]
    out = self._run_model(tokens, positions, slots, layout, samples, rows.size,
                          self.config.prefill_impl, rows, kind=('prefill', t, b))
    drawn = self._fetch(out, samples)
    self.stats.prefill_calls += 1
    self.stats.prefill_tokens += sum(adm.num_tokens - adm.prefill_start for _, adm in items)
    self.stats.prefill_padded_tokens += b * t
    result, i = [], 0
    for group, adm in items:
      cache.commit(adm.seq_id)  # its KV is written: others may share it now
      result.append((group, tuple(None if x is None else x[i : i + len(group)] for x in drawn)))
      i += len(group)
    return result

  # ---- the decode loop --------------------------------------------------------------------

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
    try:
      self._inflight = self._dispatch(prev)
    except Exception:
      if prev is not None:
        self._inflight = prev  # its rows fail with the rest
      raise
    if prev is not None:
      self._collect(prev, events, self._inflight.patch)

  def _dispatch(self, prev: '_DecodeStep | None') -> '_DecodeStep':
    """Prepares and dispatches a decode step (not waited for)."""
    t0 = self.clock()
    step = self._prepare_decode(prev)
    tp = self.clock()
    step.out = self._run_model(*step.model_args, step.reqs, step.b, self.config.impl,
                               ahead=step.ahead, feed=step.feed, kind=('decode', step.b))
    step.new_shape = self._last_new_shape
    step.host = (tp - t0, self.clock() - tp)
    return step

  def _collect(self, step: '_DecodeStep', events, patch) -> None:
    """Waits for a dispatched step's tokens; records those a later step appended; emits."""
    t1 = self.clock()
    drawn = self._fetch(step.out, step.reqs)
    t2 = self.clock()
    new = drawn[0]
    if patch is not None and patch[0]:
      seq_ids, positions, rows = patch
      self.cache.record_tokens(seq_ids, positions, new[rows])
    live = [i for i, req in enumerate(step.reqs) if req.state == 'running']  # not cancelled
    self._emit([step.reqs[i] for i in live], drawn, live, events)
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
    shape = kind + (segment_slots(layout),)
    if shape not in self._allowed:
      warnings.warn(f'engine step shape {shape} is outside its budget ({self._budget})',
                    stacklevel=2)
    key = (tokens.shape, s, feed is not None, jax.tree_util.tree_structure(layout),
           tuple(x.shape for x in jax.tree_util.tree_leaves(layout)))
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
    tokens = np.asarray(out.tokens)[:k]
    if out.logprobs is None or not any(r.params.wants_logprobs for r in reqs):
      return tokens, None, None, None
    return (tokens, np.asarray(out.logprobs)[:k], np.asarray(out.top_tokens)[:k],
            np.asarray(out.top_logprobs)[:k])

  def _empty_layout(self, b: int, j: int, policy):
    """A layout of b empty rows with J = j segment slots (0: none), as the cache would shape it."""
    c = self.cache.config
    plan = SharingPlan(b, (), c.chunk_size, ((),) * b, (0,) * b, c.kv_tokens)
    policy = (dataclasses.replace(policy, fixed_shapes=False) if j == 0
              else dataclasses.replace(policy, min_segments=j))
    return device_layout(plan, policy=policy, max_private_pages=c.max_pages)

  def _warm(self, shape, tokens, layout, s, impl, sample_rows, feed) -> None:
    b, t = tokens.shape
    slots = np.full((b, t), self.cache.config.kv_tokens, np.int32)  # writes nothing
    seeds, streams, index, rows = self._sampling_inputs([], s)
    out, self.kv = self._model_step(
        self._params, self.kv, tokens, np.zeros((b, t), np.int32), slots, layout, seeds,
        streams, index, rows, sample_rows, feed=feed, impl=impl,
        top_logprobs=self.config.max_top_logprobs)
    jax.block_until_ready(out)
    self._seen_shapes.add((tokens.shape, s, feed is not None,
                           jax.tree_util.tree_structure(layout),
                           tuple(x.shape for x in jax.tree_util.tree_leaves(layout))))

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
      self.cache.remove(req.seq_id)
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
    self.stats.peak_chunks = max(self.stats.peak_chunks, self.cache.num_used_chunks)
    self.stats.peak_rows = max(self.stats.peak_rows, self.cache.num_rows)
