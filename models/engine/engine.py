"""The Engine: its API and the iteration, over its parts (see the package doc)."""

import dataclasses
import math
import numbers
import time
from typing import Callable, Hashable, Iterator, Sequence

from hydrajax.chunk_cache import ChunkCache
from models.engine.book import FINISHED, RequestBook
from models.engine.config import EngineConfig, ShapeBudget
from models.engine.decode import DecodeLoop
from models.engine.prefill import Prefill
from models.engine.requests import Request, TokenEvent, check_prompt
from models.engine.runner import ModelRunner
from models.engine.scheduler import Scheduler
from models.engine.stats import EngineStats
from models.llama import Llama
from models.sampling import SamplingParams


class Engine:
  """Continuous batching over a `Llama` with a prefix-aware chunk cache (see the package doc).

  With a model mesh of dp > 1 (data parallel) it keeps one chunk cache per shard
  (`caches`; `cache` is one device's only) and runs every step as one program over the
  mesh (see the package doc).

  Parts: `_scheduler` (the queue and admission), `book` (requests, the running ones, their
  tokens and ends), `runner` (the KV buffer and every model call), `prefill` and `decoder`
  (the decode loop). Each iteration (`step`) runs them in that order.
  """

  def __init__(self, model: Llama, config: EngineConfig, *,
               clock: Callable[[], float] = time.perf_counter):
    if not isinstance(config, EngineConfig):
      raise ValueError(f'config must be an EngineConfig, got {config!r}')
    self.model = model
    self.config = config
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
    self._stats = stats = EngineStats()
    self._clock = clock
    self.runner = ModelRunner(model, config, cache_config, dp, stats)
    self.book = RequestBook(self.caches, stats, clock)
    self._scheduler = Scheduler(config, self.caches, stats, clock)
    self.prefill = Prefill(config, self.caches, self.runner, self.book, stats, clock)
    self.decoder = DecodeLoop(model, config, self.caches, self.runner, self.book, stats, clock)
    self._next_id = 0

  @property
  def cache(self) -> ChunkCache:
    """The chunk cache (one device, or tensor parallel only); with dp > 1 see `caches`."""
    if self.num_shards > 1:
      raise AttributeError(f'with data parallelism (dp={self.num_shards}) the engine has one '
                           'chunk cache per shard: engine.caches')
    return self.caches[0]

  @property
  def requests(self) -> dict[int, Request]:
    """Every submitted request by id (a caller may drop finished ones)."""
    return self.book.requests

  @property
  def kv(self):
    """The KV buffer of every layer (`KVCache`; with dp, every shard's part of it)."""
    return self.runner.kv

  @property
  def kv_bytes_per_token(self) -> int:
    return self.runner.kv_bytes_per_token

  @property
  def stats(self) -> EngineStats:
    return self._stats

  @stats.setter
  def stats(self, value: EngineStats) -> None:  # a reset (experiments) reaches every part
    self._stats = value
    for part in self._parts():
      part.stats = value

  @property
  def clock(self) -> Callable[[], float]:
    return self._clock

  @clock.setter
  def clock(self, value: Callable[[], float]) -> None:  # a test's clock reaches every part
    self._clock = value
    for part in self._parts():
      if hasattr(part, 'clock'):
        part.clock = value

  def _parts(self) -> tuple:
    return (self.runner, self.book, self._scheduler, self.prefill, self.decoder)

  # ---- the API ----------------------------------------------------------------------------

  def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(), *,
             on_token: Callable[[TokenEvent], None] | None = None,
             arrival: float | None = None, client: Hashable = None) -> int:
    """Queues a request; returns its id. Raises ValueError (naming the argument) if it is
    malformed or can never fit; a refused request changes nothing.

    With `params.n` = k > 1 it queues k requests of the prompt (its samples),
    with ids `rid .. rid + k - 1` (rid is returned; `samples(rid)` lists them),
    one callback `on_token` for all of them (events carry each one's id). Prompts queue
    round-robin over `client`s (any hashable: a server passes the peer's address).
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
    group = [Request(rid + i, prompt, params, on_token, arrival, rid, i, client=client)
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
    if req is None or req.state in FINISHED:
      return False
    req.cancel_requested = True
    return True

  @property
  def has_work(self) -> bool:
    return bool(self._scheduler.queue) or self.decoder.has_work

  @property
  def num_running(self) -> int:
    return len(self.book.running)

  @property
  def num_queued(self) -> int:
    """Queued requests (samples count one each)."""
    return self._scheduler.num_queued

  def step(self) -> list[TokenEvent]:
    """One iteration (admit + prefill, one decode step, retire); returns its events.

    A request whose admission, prefill or callback fails finishes with reason 'error'
    (its `error` says why); the others go on. A failed decode step fails its rows.
    """
    book = self.book
    events: list[TokenEvent] = []
    self.stats.iterations += 1
    for req in self._scheduler.take_cancelled():
      book.finish_cancelled(req, events)
    for req in [r for r in book.running.values() if r.cancel_requested]:
      book.finish_cancelled(req, events)
    admitted, failed = self._scheduler.admit(len(book.running))
    for group, error in failed:
      book.fail_group(group, events, error)
    for group, _ in admitted:
      book.start(group[0])  # its samples start at the fork, after the prefill
    book.track_peak()
    if admitted:
      self.prefill.run(admitted, events)
    try:
      self.decoder.step(events)
    except Exception as e:  # noqa: BLE001 - the engine goes on; this step's rows fail
      self.decoder.drop_inflight()
      book.fail_running(events, e)
    for event in events:
      req = self.requests.get(event.request_id)  # a caller may drop finished requests
      if req is not None and req.on_token is not None:
        try:
          req.on_token(event)
        except Exception as e:  # noqa: BLE001 - a callback fails its own request only
          if req.state not in FINISHED:
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
    return self.runner.budget

  def warmup(self) -> None:
    """Compiles every shape of the budget now (model steps on empty rows, KV copies)."""
    for _ in self.warmup_steps():
      pass

  def warmup_steps(self) -> Iterator[tuple[int, int]]:
    """`warmup` one compiled program at a time, yielding (programs done, programs in all)
    after each, so a caller can serve between them (see `ModelRunner.warmup_steps`)."""
    return self.runner.warmup_steps()
