"""Prefill: the admitted prompts' unshared tokens, then the fork into their samples."""

from typing import Callable, Sequence

import numpy as np

from hydrajax import SharingPlan
from hydrajax.attention import parallel
from hydrajax.chunk_cache import ChunkCache
from hydrajax.layout import next_power_of_two
from hydrajax.chunk_cache.layout_cache import no_empty_groups
from models.engine.book import RequestBook
from models.engine.config import EngineConfig
from models.engine.runner import ModelRunner
from models.engine.stats import EngineStats


class Prefill:
  """The admitted prompts' prefill: model calls over the cache's rows, then the fork of each
  prompt into its samples and their first tokens."""

  def __init__(self, config: EngineConfig, caches: Sequence[ChunkCache], runner: ModelRunner,
               book: RequestBook, stats: EngineStats, clock: Callable[[], float]):
    self.config, self.caches, self.runner, self.book = config, tuple(caches), runner, book
    self.stats, self.clock = stats, clock
    self.num_shards = len(self.caches)

  def run(self, admitted, events):
    """Prefills the admitted prompts (only their unshared tokens), then forks their samples.

    Calls group rows of the same padded length; each sample's first token is drawn from
    its prompt's last position. A failed call fails its prompts only.
    """
    c, caches = self.config, self.caches
    t0 = self.clock()
    try:
      self.runner.copy(
          np.concatenate([self.runner.global_slots(a.copy_src, g[0].shard) for g, a in admitted]),
          np.concatenate([self.runner.global_slots(a.copy_dst, g[0].shard) for g, a in admitted]))
    except Exception as e:  # noqa: BLE001
      for group, _ in admitted:
        self.book.fail_group(group, events, e)
      return
    by_len: dict[int, list] = {}
    for group, adm in admitted:
      t = c.prefill_len(adm.num_tokens - adm.prefill_start)
      by_len.setdefault(t, []).append((group, adm))
    forks = []  # (samples, their draws), forked once every prefill call has run
    for t, items in sorted(by_len.items()):
      per_call = c.prefill_rows_per_call(t)
      if self.num_shards > 1:  # each call: every shard's next rows of length t, stacked
        forks += self._prefill_sharded(items, t, per_call, events)
        continue
      cache = caches[0]
      items.sort(key=lambda x: cache.row(x[1].seq_id))
      for i in range(0, len(items), per_call):
        batch = items[i : i + per_call]
        try:
          forks += self._prefill_call(batch, t)
        except Exception as e:  # noqa: BLE001 - these prompts fail, the others go on
          for group, _ in batch:
            self.book.fail_group(group, events, e)
    src, dst = [], []
    for group, _ in forks:
      if len(group) > 1:
        shard = group[0].shard
        try:
          f = caches[shard].fork(group[0].seq_id, len(group),
                                 reserve_tokens=group[0].params.max_new_tokens - 1)
        except Exception as e:  # noqa: BLE001
          self.book.fail_group(group, events, e)
          continue
        src.append(self.runner.global_slots(f.copy_src, shard))
        dst.append(self.runner.global_slots(f.copy_dst, shard))
        for req, sid in zip(group[1:], f.seq_ids[1:]):
          req.seq_id = sid
          self.book.start(req)
        self.stats.forked_samples += len(group) - 1
    if src:
      self.runner.copy(np.concatenate(src), np.concatenate(dst))
    now = self.clock()
    for group, drawn in forks:
      live = [i for i, req in enumerate(group) if req.state == 'running']
      for req in group:
        req.first_token = now
      self.book.emit([group[i] for i in live], drawn, live, events)
    self.book.track_peak()
    self.stats.prefill_s += self.clock() - t0

  def _prefill_call(self, items, t):
    """One prefill call of (samples, admission) items; returns (samples, their draws) of each.

    The draws are host arrays (tokens, log-probs, top ids, top log-probs) with one row per
    sample of the item, in order.
    """
    cache = self.caches[0]
    length = cache.config.kv_tokens
    b = next_power_of_two(len(items))
    tokens = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    slots = np.full((b, t), length, np.int32)
    for r, (group, adm) in enumerate(items):  # left-padded: a row's new tokens are its last T
      n = adm.num_tokens - adm.prefill_start
      tokens[r, t - n :] = group[0].prompt[adm.prefill_start :]
      positions[r, t - n :] = np.arange(adm.prefill_start, adm.num_tokens)
      slots[r, t - n :] = adm.prefill_slots
    layout = self.runner.prepare_plan(
        cache.device_layout([adm.seq_id for _, adm in items], num_rows=b,
                            policy=self.runner.prefill_policy),
        self.config.prefill_impl, t)
    samples = [req for group, _ in items for req in group]
    # Every prefill samples a fixed number of rows (a prompt's samples each draw): one shape.
    rows = np.zeros(self.config.prefill_sample_rows(), np.int32)
    rows[: len(samples)] = [r for r, (group, _) in enumerate(items) for _ in group]
    out = self.runner.run(tokens, positions, slots, layout, samples, rows.size,
                          self.config.prefill_impl, rows, kind=('prefill', t, b))
    drawn = self.runner.fetch(out, samples)
    self.stats.prefill_calls += 1
    self.stats.prefill_tokens += sum(adm.num_tokens - adm.prefill_start for _, adm in items)
    self.stats.prefill_padded_tokens += b * t
    result, i = [], 0
    for group, adm in items:
      cache.commit(adm.seq_id)  # its KV is written: others may share it now
      result.append((group, tuple(None if x is None else x[i : i + len(group)] for x in drawn)))
      i += len(group)
    return result

  def _prefill_sharded(self, items, t: int, per_call: int, events) -> list:
    """Data parallel prefill of (samples, admission) items of padded length t: each call
    stacks up to `per_call` rows of every shard (a shard with fewer runs empty rows)."""
    shards = [[x for x in items if x[0][0].shard == d] for d in range(self.num_shards)]
    for d, xs in enumerate(shards):
      xs.sort(key=lambda x, cache=self.caches[d]: cache.row(x[1].seq_id))
    forks = []
    for i in range(0, max(len(xs) for xs in shards), per_call):
      batches = [xs[i : i + per_call] for xs in shards]
      try:
        forks += self._prefill_call_sharded(batches, t)
      except Exception as e:  # noqa: BLE001 - these prompts fail, the others go on
        for batch in batches:
          for group, _ in batch:
            self.book.fail_group(group, events, e)
    return forks

  def _prefill_call_sharded(self, batches, t: int) -> list:
    """One model call over every dp shard's batch (`_prefill_call`'s result, for all of them).

    Shard d's rows are [d b, (d+1) b) of the call, with its layout over its own cache
    (stacked: `parallel.stack_layouts`); write slots are global (d L_s + the cache's slot).
    """
    dp, c = self.num_shards, self.config
    b = next_power_of_two(max(1, max(len(x) for x in batches)))
    tokens = np.zeros((dp * b, t), np.int32)
    positions = np.zeros((dp * b, t), np.int32)
    slots = np.full((dp * b, t), self.runner.drop_slot, np.int32)
    plans, samples, rows = [], [], []
    for d, items in enumerate(batches):
      cache = self.caches[d]
      for r, (group, adm) in enumerate(items):  # left-padded: a row's new tokens are its last T
        g, n = d * b + r, adm.num_tokens - adm.prefill_start
        tokens[g, t - n :] = group[0].prompt[adm.prefill_start :]
        positions[g, t - n :] = np.arange(adm.prefill_start, adm.num_tokens)
        slots[g, t - n :] = self.runner.global_slots(adm.prefill_slots, d)
        samples += group
        rows += [g] * len(group)
      if items:
        plans.append(cache.plan([adm.seq_id for _, adm in items], num_rows=b))
      else:
        cc = cache.config
        plans.append(SharingPlan(b, (), cc.chunk_size, ((),) * b, (0,) * b, cc.kv_tokens))
    cc = self.caches[0].config
    policy = no_empty_groups(self.runner.prefill_policy, cc.share_prefixes)
    layout = self.runner.prepare_plan(
        parallel.stack_layouts(plans, policy=policy, max_private_pages=cc.max_pages,
                               upload=False),  # prepared on the host, then uploaded once
        c.prefill_impl, t)
    sample_rows = np.zeros(dp * c.prefill_sample_rows(), np.int32)
    sample_rows[: len(rows)] = rows
    out = self.runner.run(tokens, positions, slots, layout, samples, sample_rows.size,
                          c.prefill_impl, sample_rows, kind=('prefill', t, b))
    drawn = self.runner.fetch(out, samples)
    self.stats.prefill_calls += 1
    self.stats.prefill_tokens += sum(adm.num_tokens - adm.prefill_start
                                     for items in batches for _, adm in items)
    self.stats.prefill_padded_tokens += dp * b * t
    result, i = [], 0
    for d, items in enumerate(batches):
      for group, adm in items:
        self.caches[d].commit(adm.seq_id)  # its KV is written: others may share it now
        result.append((group, tuple(None if x is None else x[i : i + len(group)]
                                    for x in drawn)))
        i += len(group)
    return result
