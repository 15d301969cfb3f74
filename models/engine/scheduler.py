"""Admission: the queue of prompts and who enters the batch at each iteration."""

import collections
from typing import Callable

from hydrajax.chunk_cache import CapacityError, ChunkCache
from models.engine.config import EngineConfig
from models.engine.requests import Request
from models.engine.stats import EngineStats


class Scheduler:
  """The queue (a prompt's samples together), first come first served, and admission.

  A prompt is admitted while the batch has room (`max_batch`, counting every
  sample), the iteration's prefill budget allows, and the chunk pool can hold
  the prompt plus a reservation for every token it may still generate, for each
  of its samples (`ChunkCache.insert` with `num_samples`; cached chunks count as
  room). A prompt whose prefix is being prefilled in this very iteration waits
  one iteration, so that it shares it instead of computing it again.
  """

  def __init__(self, config: EngineConfig, cache: ChunkCache, stats: EngineStats,
               clock: Callable[[], float]):
    self.config, self.cache, self.stats, self.clock = config, cache, stats, clock
    self.queue: collections.deque[list[Request]] = collections.deque()

  @property
  def num_queued(self) -> int:
    return sum(len(g) for g in self.queue)

  def add(self, group: list[Request]) -> None:
    self.queue.append(group)

  def take_cancelled(self) -> list[Request]:
    """Removes and returns the queued requests whose cancellation was asked for."""
    out = []
    for group in [g for g in self.queue if any(r.cancel_requested for r in g)]:
      for req in [r for r in group if r.cancel_requested]:  # its other samples stay queued
        group.remove(req)
        out.append(req)
    if not all(self.queue):
      self.queue = collections.deque(g for g in self.queue if g)
    return out

  def admit(self, running: int) -> tuple[list[tuple[list[Request], object]], list]:
    """Admits queued prompts into a batch of `running` sequences.

    Returns ((samples, `Admission`) of each admitted prompt, (samples, error) of each
    prompt whose admission failed: it leaves the queue, the others go on).
    """
    c, cache = self.config, self.cache
    admitted, failed, budget, rows = [], [], c.max_prefill_tokens, running
    while self.queue and rows + len(self.queue[0]) <= c.max_batch:
      group = self.queue[0]
      lead = group[0]
      reserve = lead.params.max_new_tokens - 1
      try:
        match = cache.match(lead.prompt, reserve_tokens=reserve, num_samples=len(group))
        if match.pending:
          break  # its prefix is being prefilled now: next iteration it is shared instead
        padded = c.prefill_len(lead.prompt.size - match.shared_tokens - match.copied_tokens)
        if admitted and padded > budget:
          break
        adm = cache.insert(lead.prompt, reserve_tokens=reserve, num_samples=len(group))
      except CapacityError:
        break  # waits for memory; submit() guaranteed it fits an empty pool
      except Exception as e:  # noqa: BLE001 - this prompt fails, the queue goes on
        self.queue.popleft()
        failed.append((group, e))
        continue
      self.queue.popleft()
      budget -= padded
      rows += len(group)
      now = self.clock()
      for req in group:
        req.state, req.admitted = 'running', now
        req.shared_tokens, req.cached_tokens = adm.shared_tokens, adm.cached_tokens
        req.prefilled_tokens = adm.num_tokens - adm.prefill_start
      lead.seq_id = adm.seq_id  # the others get theirs from the fork after the prefill
      admitted.append((group, adm))
      self.stats.shared_tokens += adm.shared_tokens
      self.stats.cached_tokens += adm.cached_tokens
      self.stats.copied_tokens += adm.copied_tokens
    return admitted, failed
