"""Admission: the queue of prompts and who enters the batch at each iteration."""

import collections
from typing import Callable, Sequence

from hydrajax.chunk_cache import CapacityError, ChunkCache
from models.engine.config import EngineConfig
from models.engine.requests import Request
from models.engine.stats import EngineStats


class Scheduler:
  """The queue (a prompt's samples together), round-robin over clients, and admission.

  A prompt is admitted while the batch has room (`max_batch`, counting every
  sample), the iteration's prefill budget allows, and the chunk pool can hold
  the prompt plus a reservation for every token it may still generate, for each
  of its samples (`ChunkCache.insert` with `num_samples`; cached chunks count as
  room). A prompt whose prefix is being prefilled in this very iteration waits
  one iteration, so that it shares it instead of computing it again.

  Data parallel (one chunk cache per dp shard, `caches`): each prompt is routed to a
  shard once, at admission (its samples with it; it never moves). Among the shards where
  it fits now (rows, chunks, and that shard's prefill budget of the iteration), the one
  whose cache holds its longest prefix (shared plus copied tokens), then the one with the
  fewest rows, then the most available chunks. It waits (and the queue with it) when it
  fits no shard, or when its longest prefix is still being prefilled. `max_batch`,
  `max_prefill_tokens` and the pool are per shard.
  """

  def __init__(self, config: EngineConfig, caches: Sequence[ChunkCache], stats: EngineStats,
               clock: Callable[[], float]):
    self.config, self.stats, self.clock = config, stats, clock
    self.caches = tuple(caches)
    self.cache = self.caches[0]
    self.queue: collections.deque[list[Request]] = collections.deque()

  @property
  def num_queued(self) -> int:
    return sum(len(g) for g in self.queue)

  def add(self, group: list[Request]) -> None:
    """Queues a prompt's samples, interleaving clients: a client's k-th queued prompt goes
    after every other client's k-th (round-robin), so one client's many prompts never hold
    back another's first."""
    client = group[0].client
    ahead = sum(1 for g in self.queue if g[0].client == client)  # this one's round
    seen: collections.Counter = collections.Counter()
    at = 0
    for i, g in enumerate(self.queue):
      seen[g[0].client] += 1
      if seen[g[0].client] <= ahead + 1:
        at = i + 1  # a group of this round or an earlier one
    self.queue.insert(at, group)

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
    if len(self.caches) > 1:
      return self._admit_sharded()
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

  def _admit_sharded(self) -> tuple[list[tuple[list[Request], object]], list]:
    """`admit` over dp shards: each prompt routed to a shard (see the class doc)."""
    c, caches = self.config, self.caches
    admitted, failed = [], []
    rows = [cache.num_rows for cache in caches]  # live sequences per shard (forks included)
    budget = [c.max_prefill_tokens] * len(caches)
    started = [False] * len(caches)
    while self.queue:
      group = self.queue[0]
      lead = group[0]
      reserve = lead.params.max_new_tokens - 1
      try:
        matches = [cache.match(lead.prompt, reserve_tokens=reserve, num_samples=len(group))
                   for cache in caches]
        reuse = [m.shared_tokens + m.copied_tokens for m in matches]
        best = max(reuse)
        if best and any(m.pending for m, r in zip(matches, reuse) if r == best):
          break  # its prefix is being prefilled now: next iteration it is shared instead
        order = sorted(range(len(caches)), key=lambda d: (
            -reuse[d], rows[d], -caches[d].available_chunks, d))
        adm = None
        for d in order:
          padded = c.prefill_len(lead.prompt.size - reuse[d])
          if rows[d] + len(group) > c.max_batch or (started[d] and padded > budget[d]):
            continue
          try:
            adm = caches[d].insert(lead.prompt, reserve_tokens=reserve, num_samples=len(group))
          except CapacityError:
            continue  # no room on this shard now: another may have it
          break
      except Exception as e:  # noqa: BLE001 - this prompt fails, the queue goes on
        self.queue.popleft()
        failed.append((group, e))
        continue
      if adm is None:
        break  # fits no shard now; submit() guaranteed it fits an empty one
      self.queue.popleft()
      budget[d] -= padded
      started[d] = True
      rows[d] += len(group)
      now = self.clock()
      for req in group:
        req.state, req.admitted, req.shard = 'running', now, d
        req.shared_tokens, req.cached_tokens = adm.shared_tokens, adm.cached_tokens
        req.prefilled_tokens = adm.num_tokens - adm.prefill_start
      lead.seq_id = adm.seq_id
      admitted.append((group, adm))
      self.stats.shared_tokens += adm.shared_tokens
      self.stats.cached_tokens += adm.cached_tokens
      self.stats.copied_tokens += adm.copied_tokens
    return admitted, failed
