"""The decode loop: one token for every live sequence per step, waited for or overlapped."""

import dataclasses
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from hydrajax import AttentionPlan
from hydrajax.attention import parallel
from hydrajax.chunk_cache import ChunkCache
from hydrajax.chunk_cache.layout_cache import no_empty_groups
from hydrajax.layout import device_groups, make_layout, page_table
from models.engine.book import RequestBook
from models.engine.config import EngineConfig
from models.engine.runner import ModelRunner
from models.engine.stats import EngineStats
from models.llama import Llama
from models.sampling import Sampled


@dataclasses.dataclass
class DecodeStep:
  """A decode step's inputs, and once dispatched its draws on the device."""

  model_args: tuple  # tokens, positions, slots [b, 1], attention plan (or layout)
  reqs: list  # Request of each live row, row order
  b: int  # padded rows
  ahead: np.ndarray  # [rows] 1 where the input token is the previous step's, still on the device
  feed: tuple | None  # (previous step's tokens [b], src [b]) for overlapped steps
  patch: tuple  # (seq ids, positions, rows of the previous step): placeholders to record
  used_chunks: int
  sample_rows: np.ndarray | None = None  # dp: the row of each request's draw ([S] entries)
  new_shape: bool = False
  out: Sampled | None = None  # on the device
  host: tuple = (0.0, 0.0)  # prepare, dispatch seconds

  @property
  def tokens_out(self):
    return self.out.tokens


class DecodeLoop:
  """The engine's decode steps over its chunk caches' live rows.

  A step pads the live rows to a decode bucket, appends a slot for each row's
  next token, and runs the model over the cache's `TreeLayout`, whose attention
  plan is prepared on the host once per tree change (`_decode_plan`; `plan` holds it). Waited, it
  reads the tokens back before the iteration ends; with `overlap_decode`, step
  k+1 is dispatched (its input tokens taken from step k's output on the device)
  before step k's tokens are read, so the host's work overlaps the device's.
  """

  def __init__(self, model: Llama, config: EngineConfig, caches: Sequence[ChunkCache],
               runner: ModelRunner, book: RequestBook, stats: EngineStats,
               clock: Callable[[], float]):
    self.config, self.caches, self.runner, self.book = config, tuple(caches), runner, book
    self.stats, self.clock = stats, clock
    self.num_shards = len(self.caches)
    self.cache = self.caches[0]  # the one chunk cache without dp
    self.group_size = model.config.num_heads // model.config.num_kv_heads
    self.inflight: DecodeStep | None = None  # overlap_decode: the step on the device
    self.plan: tuple | None = None  # (tree key, AttentionPlan, lead) of the decode steps

  @property
  def has_work(self) -> bool:
    return bool(self.book.running) or self.inflight is not None

  def step(self, events) -> None:
    """One decode step: waited for, or with `overlap_decode` dispatched before the previous
    one is collected."""
    if self.config.overlap_decode:
      self._step_overlapped(events)
    elif self.book.running:
      self._collect(self._dispatch(None), events, None)

  def drop_inflight(self) -> None:
    """Forgets the step on the device (it failed: its rows finish with the error)."""
    self.inflight = None

  def _step_overlapped(self, events):
    """Dispatches step k+1, then waits for step k (`overlap_decode`; see EngineConfig)."""
    prev, self.inflight = self.inflight, None
    if prev is not None:  # a row whose token in flight is its last is in no further step
      for req in prev.reqs:
        if (req.state == 'running' and self.book.running.get(req.seq_id) is req
            and len(req.output) + 1 >= req.params.max_new_tokens):
          self.book.release(req)  # its KV is written; the token comes at the collect
      if self.book.running and self.config.decode_rows(self.cache.num_rows) != prev.b:
        self._collect(prev, events, None)  # a new batch size: feed this step from the host
        prev = None
    if not self.book.running:
      if prev is not None:
        self._collect(prev, events, None)
      return
    try:
      self.inflight = self._dispatch(prev)
    except Exception:
      if prev is not None:
        self.inflight = prev  # its rows fail with the rest
      raise
    if prev is not None:
      self._collect(prev, events, self.inflight.patch)

  def _dispatch(self, prev: 'DecodeStep | None') -> 'DecodeStep':
    """Prepares and dispatches a decode step (not waited for)."""
    t0 = self.clock()
    step = self._prepare_decode(prev)
    tp = self.clock()
    rows = step.sample_rows
    step.out = self.runner.run(*step.model_args, step.reqs, step.b if rows is None else rows.size,
                               self.config.impl, rows, ahead=step.ahead, feed=step.feed,
                               kind=('decode', step.b))
    step.new_shape = self.runner.last_new_shape
    step.host = (tp - t0, self.clock() - tp)
    return step

  def _collect(self, step: 'DecodeStep', events, patch) -> None:
    """Waits for a dispatched step's tokens; records those a later step appended; emits."""
    t1 = self.clock()
    drawn = self.runner.fetch(step.out, step.reqs)
    t2 = self.clock()
    new = drawn[0]
    if patch is not None and patch[0]:
      seq_ids, positions, rows = patch
      self.cache.record_tokens(seq_ids, positions, new[rows])
    live = [i for i, req in enumerate(step.reqs) if req.state == 'running']  # not cancelled
    self.book.emit([step.reqs[i] for i in live], drawn, live, events)
    t3 = self.clock()
    self._count_decode(step, host=(step.host[0], step.host[1], t3 - t2), wait=t2 - t1)

  def _prepare_decode(self, prev: 'DecodeStep | None') -> 'DecodeStep':
    """The next decode step's inputs; rows in `prev` take their token from its device output."""
    if self.num_shards > 1:
      return self._prepare_decode_sharded()
    cache = self.cache
    rows = cache.rows
    reqs = [self.book.running[sid] for sid in rows]
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
    layout = self._decode_plan(cache.device_layout(num_rows=b), b)
    self.book.track_peak()
    fed = np.flatnonzero(ahead)
    feed = None
    if self.config.overlap_decode:  # one input structure for every overlapped step
      feed = (prev.tokens_out if prev is not None else np.zeros(b, np.int32), src)
    return DecodeStep(
        model_args=(tokens, positions, slots, layout), reqs=reqs, b=b, ahead=ahead, feed=feed,
        patch=([rows[i] for i in fed], (lengths[fed] - 1).tolist(), src[fed]),
        used_chunks=cache.num_used_chunks)

  def _prepare_decode_sharded(self) -> 'DecodeStep':
    """A data parallel decode step's inputs: every shard's live rows padded to one bucket b
    (the largest shard's), shard d's at rows [d b, (d+1) b) with global write slots; each
    request draws from its row (`sample_rows`)."""
    dp, caches = self.num_shards, self.caches
    rows_of = [cache.rows for cache in caches]
    b = self.config.decode_rows(max(len(rows) for rows in rows_of))
    tokens = np.zeros((dp * b, 1), np.int32)
    positions = np.zeros((dp * b, 1), np.int32)
    slots = np.full((dp * b, 1), self.runner.drop_slot, np.int32)
    lengths = np.zeros(dp * b, np.int32)  # private lengths, after the append
    reqs, where = [], []
    for d, (cache, rows) in enumerate(zip(caches, rows_of)):
      if not rows:
        continue
      live = [self.book.running[sid] for sid in rows]
      n, g = len(rows), d * b
      last = np.array([req.output[-1] for req in live], np.int64)
      slots[g : g + n, 0] = self.runner.global_slots(cache.append(last), d)
      tokens[g : g + n, 0] = last
      positions[g : g + n, 0] = cache.lengths() - 1
      lengths[g : g + b] = cache.private_lengths(b)
      reqs += live
      where += range(g, g + n)
    sample_rows = np.zeros(dp * b, np.int32)
    sample_rows[: len(where)] = where
    layout = self._decode_plan_sharded(b, lengths)
    self.book.track_peak()
    return DecodeStep(
        model_args=(tokens, positions, slots, layout), reqs=reqs, b=b,
        ahead=np.zeros(len(reqs), np.int32), feed=None, patch=((), (), ()),
        used_chunks=sum(cache.num_used_chunks for cache in caches), sample_rows=sample_rows)

  def _decode_plan_sharded(self, b: int, lengths: np.ndarray):
    """`_decode_plan` over dp shards: each shard's tree (after the `sharing_policy`) padded
    to one shape and stacked on the host, its plans prepared and put in their shards once per
    change of any shard's tree; then only the private lengths ([dp b], global rows) are
    swapped in, on the host (the step's dispatch uploads them)."""
    caches = self.caches
    key = (tuple((cache.structure_version, cache.pages_version) for cache in caches), b)
    if self.plan is None or self.plan[0] != key:
      plan, lead = self._build_plan_sharded(b)
      if not isinstance(plan.layouts, AttentionPlan):  # NO_ATTENTION: nothing to prepare
        return plan
      self.plan = (key, plan, lead)
      self.stats.plan_builds += 1
    _, plan, lead = self.plan
    # The cache that built the page table gave the lengths: no per-step value check.
    return plan.with_private_lengths(lengths if lead is None else lengths + lead, check=False)

  def _build_plan_sharded(self, b: int):
    """(the stacked per-shard plans, lead [dp b] int32 or None: see `apply_sharing_policy`)."""
    caches = self.caches
    policy = self.config.sharing_policy
    plans, leads = [], []
    for cache in caches:
      tree = cache.plan(num_rows=b)
      if policy is not None:
        demoted = policy.apply(tree, group_size=self.group_size)
        leads.append(np.subtract(demoted.private_lengths, tree.private_lengths))
        tree = demoted
      plans.append(tree)
    lead = np.concatenate(leads).astype(np.int32) if leads and np.any(leads) else None
    config = caches[0].config
    layout = parallel.stack_layouts(
        plans, policy=no_empty_groups(config.layout, config.share_prefixes),
        max_private_pages=config.max_pages, upload=False)  # prepared on the host, then uploaded
    return self.runner.prepare_plan(layout, self.config.impl), lead

  def _decode_plan(self, layout, b: int):
    """The decode step's attention plan: prepared on the host once per tree change (the cache's
    structure, page table or padded row count), then only its private lengths are swapped.
    With a `sharing_policy`, its demoted segments lead their rows' private pages."""
    cache = self.cache
    key = (id(cache), cache.structure_version, cache.pages_version, b)
    if self.plan is not None and self.plan[0] == key:
      _, plan, lead = self.plan
      lengths = layout.private_lengths
      return plan.with_private_lengths(lengths if lead is None else lengths + lead, check=False)
    layout, lead = self.apply_sharing_policy(layout, b)
    plan = self.runner.prepare_plan(layout, self.config.impl)
    if isinstance(plan, AttentionPlan):  # else NO_ATTENTION: nothing to prepare
      self.plan = (key, plan, lead)
      self.stats.plan_builds += 1
    return plan

  def apply_sharing_policy(self, layout, b: int):
    """(layout, lead [b] int32 or None): the decode layout after `config.sharing_policy`, and
    the demoted tokens that now lead each row's private KV (None: nothing demoted)."""
    policy = self.config.sharing_policy
    if policy is None:
      return layout, None
    cache = self.cache
    tree = cache.plan(num_rows=b)
    demoted = policy.apply(tree, group_size=self.group_size)
    if demoted is tree:
      return layout, None
    rules = cache.config.layout
    width = rules.page_width(max(len(p) for p in demoted.private_pages), cache.config.max_pages)
    lead = np.subtract(demoted.private_lengths, tree.private_lengths).astype(np.int32)
    layout = make_layout(
        *device_groups(demoted, rules), jnp.asarray(page_table(demoted, width)),
        jnp.asarray(np.array(demoted.private_lengths, np.int32)), demoted.page_size)
    return layout, jnp.asarray(lead)

  def _count_decode(self, step: 'DecodeStep', *, host: tuple[float, float, float],
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
