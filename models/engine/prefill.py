"""Prefill: the admitted prompts' unshared tokens, then the fork into their samples."""

import jax.numpy as jnp
import numpy as np

from hydrajax.chunk_cache import copy_slots, next_power_of_two
from models.kv_cache import KVCache


class Prefill:
  """The Engine's prefill (a mixin: it uses the engine's cache, requests and model call)."""

  def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
    """Runs KV copies (copy on write), padded to a power of two."""
    if src.size:
      size = next_power_of_two(max(src.size, 64))
      src = np.concatenate([src, np.zeros(size - src.size, np.int32)])
      dst = np.concatenate([dst, np.full(size - dst.size, self.cache.config.kv_tokens, np.int32)])
      self._copy_padded(src, dst)

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
    layout = self._prepare_plan(
        cache.device_layout([adm.seq_id for _, adm in items], num_rows=b,
                            policy=self._prefill_policy),
        self.config.prefill_impl, t)
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
