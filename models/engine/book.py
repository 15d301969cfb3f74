"""The engine's requests: which run on which row, handing out their tokens, finishing them."""

import logging
from typing import Callable, Sequence

from hydrajax.chunk_cache import ChunkCache
from models.engine.requests import Request, TokenEvent
from models.engine.stats import EngineStats

log = logging.getLogger(__name__)
FINISHED = ('done', 'cancelled', 'error')


class RequestBook:
  """Every request by id (`requests`; a caller may drop finished ones) and the running ones by
  their sequence id in their shard's chunk cache (`running`).

  A request leaves `running` when it finishes, and its rows leave its chunk cache then.
  """

  def __init__(self, caches: Sequence[ChunkCache], stats: EngineStats,
               clock: Callable[[], float]):
    self.caches, self.stats, self.clock = tuple(caches), stats, clock
    self.requests: dict[int, Request] = {}
    self.running: dict[int, Request] = {}

  def start(self, req: Request) -> None:
    """`req` runs on its sequence `req.seq_id` (of its shard's cache)."""
    self.running[req.seq_id] = req

  def release(self, req: Request) -> None:
    """`req` leaves its row before it finishes (its last token is still on the device)."""
    del self.running[req.seq_id]
    self.caches[req.shard].remove(req.seq_id)

  def emit(self, reqs: Sequence[Request], drawn: tuple, index: Sequence[int], events) -> None:
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
        self.finish(req, reason, events, logprob=logprob, top=top)
      except Exception as e:  # noqa: BLE001 - this request fails, the others go on
        self.finish(req, 'error', events, error=e)

  def finish(self, req: Request, reason: str, events, *, error=None, logprob=None,
             top=None) -> None:
    if req.state in FINISHED:
      return
    if self.running.get(req.seq_id) is req:
      del self.running[req.seq_id]
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

  def finish_cancelled(self, req: Request, events) -> None:
    """A request whose cancellation was asked for: 'error' if its callback failed."""
    if req.error is not None:
      self.finish(req, 'error', events, error=req.error)
    else:
      self.finish(req, 'cancelled', events)

  def fail_group(self, group: Sequence[Request], events, error) -> None:
    for req in group:
      self.finish(req, 'error', events, error=error)

  def fail_running(self, events, error) -> None:
    """A decode step failed: its rows (every running request) finish with reason 'error'."""
    for req in [r for r in self.requests.values() if r.state == 'running']:
      self.finish(req, 'error', events, error=error)

  def track_peak(self) -> None:
    """The peak chunks in use and rows, summed over the shards."""
    self.stats.peak_chunks = max(self.stats.peak_chunks,
                                 sum(cache.num_used_chunks for cache in self.caches))
    self.stats.peak_rows = max(self.stats.peak_rows, sum(c.num_rows for c in self.caches))
