"""The serving sweep's workloads and engines: arrivals, the replay loop, warm-up, profiles.

No flags here (experiments.serving defines them): tests import this module.
"""

import dataclasses
import time

import jax
import numpy as np
from absl import logging

import hydrajax as hj
from experiments.benchmarking import timing
from hydrajax.layout import LayoutPolicy
from models.engine import Engine, EngineConfig, SamplingParams
from models.llama import Llama


@dataclasses.dataclass(frozen=True)
class Workload:
  """Prompts and Poisson arrival times (seconds from the start)."""

  prompts: tuple[tuple[int, ...], ...]
  arrivals: tuple[float, ...]


def make_workload(*, num_requests: int, prompt_len: int, shared_frac: float, rate: float,
                  system_prompts: int, vocab: int, seed: int) -> Workload:
  rng = np.random.default_rng(seed)
  shared = int(round(prompt_len * shared_frac))
  systems = rng.integers(0, vocab, (system_prompts, max(shared, 1)))
  prompts = []
  for i in range(num_requests):
    head = systems[i % system_prompts, :shared].tolist()
    prompts.append(tuple(head + rng.integers(0, vocab, prompt_len - shared).tolist()))
  arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
  return Workload(tuple(prompts), tuple(float(a) for a in arrivals))


def serve(engine: Engine, workload: Workload, params: SamplingParams, *, deadline_s: float,
          log_every_s: float = 30.0) -> dict:
  """Replays the arrivals in real time; returns the point's metrics (per sample request)."""
  start = engine.clock()
  ids, i, n = [], 0, len(workload.prompts)
  timed_out, next_log = False, log_every_s
  while i < n or engine.has_work:
    now = engine.clock() - start
    if now > deadline_s:
      timed_out = True
      break
    if now > next_log:  # progress of a long point
      done = sum(engine.requests[r].state == 'done' for r in ids)
      logging.info('  %.0fs: %d/%d prompts arrived, %d/%d requests done, %d running, %d queued',
                   now, i, n, done, n * params.n, engine.num_running, engine.num_queued)
      next_log += log_every_s
    while i < n and workload.arrivals[i] <= now:
      rid = engine.submit(workload.prompts[i], params, arrival=start + workload.arrivals[i])
      ids.extend(engine.samples(rid))
      i += 1
    if engine.has_work:
      engine.step()
    elif i < n:
      time.sleep(max(0.0, workload.arrivals[i] - (engine.clock() - start)))
  reqs = [engine.requests[r] for r in ids if engine.requests[r].state == 'done']
  norm = np.array([(r.finished - r.arrival) / len(r.output) for r in reqs]) * 1e3
  ttft = np.array([r.first_token - r.arrival for r in reqs])
  end = max((r.finished for r in reqs), default=start)
  tokens = sum(len(r.output) for r in reqs)
  stats = engine.stats.summary()
  return dict(
      completed=len(reqs), timed_out=timed_out,
      mean_norm_latency_ms=float(norm.mean()) if reqs else None,
      p50_norm_latency_ms=float(np.median(norm)) if reqs else None,
      p90_norm_latency_ms=float(np.percentile(norm, 90)) if reqs else None,
      mean_ttft_s=float(ttft.mean()) if reqs else None,
      makespan_s=end - start,
      throughput_tok_s=tokens / max(end - start, 1e-9),
      request_throughput=len(reqs) / max(end - start, 1e-9),
      peak_kv_gb=stats['peak_chunks'] * engine.config.chunk_size * engine.kv_bytes_per_token / 1e9,
      mean_batch=stats['decode_rows'] / max(stats['decode_steps'], 1),
      # KV in use per live sequence, averaged over decode steps (cached prefixes included)
      kv_per_seq_mb=(stats['decode_chunks'] * engine.config.chunk_size
                     * engine.kv_bytes_per_token / max(stats['decode_rows'], 1) / 1e6),
      mean_shared_tokens=float(np.mean([r.shared_tokens for r in reqs])) if reqs else None,
      evicted_chunks=engine.cache.evicted_chunks,
      **{k: stats[k] for k in ('host_overhead_fraction', 'mean_decode_step_ms',
                               'mean_decode_host_ms', 'mean_decode_wait_ms',
                               'mean_decode_prepare_ms', 'mean_decode_dispatch_ms', 'decode_steps',
                               'prefill_tokens', 'cached_tokens', 'forked_samples',
                               'prefill_calls', 'peak_rows', 'distinct_step_shapes',
                               'new_shape_steps', 'new_shape_s')},
  )


def make_engine(model: Llama, *, sharing: bool, prompt_len: int, new_tokens: int,
                num_chunks: int, chunk: int, max_batch: int, kv_piece: int,
                impl: str = 'auto', min_segments: int = 8,
                overlap_decode: bool = False, command_buffers: bool = True) -> Engine:
  """An engine of the sweep.

  Without sharing, memory bounds the batch: decode steps are padded to that bound,
  not to max_batch. The page table always has a column for every page a request
  may hold (like a paged server's block table): a width that grows with the
  tree would compile again in the middle of a point (about 12 s per new width
  on the H200). The Mosaic GPU kernels read only valid pages, so the width
  costs nothing there; the XLA path gathers every column.
  """
  per_request = -(-(prompt_len + new_tokens) // chunk)
  batch = max_batch if sharing else max(1, min(max_batch, num_chunks // per_request))
  return Engine(model, EngineConfig(
      num_chunks=num_chunks, chunk_size=chunk, max_batch=batch,
      max_sequence_length=prompt_len + new_tokens, share_prefixes=sharing,
      max_prefill_rows=1, max_prefill_tokens=max(8192, 2 * prompt_len),
      decode_buckets=(batch,), impl=impl, prefill_impl=impl, overlap_decode=overlap_decode,
      command_buffers=command_buffers,
      layout=LayoutPolicy(kv_piece=kv_piece, min_segments=min_segments, fixed_shapes=True,
                          min_private_pages=per_request),
  ))


def profile_decode(engine: Engine, workload: Workload, *, new_tokens: int, steps: int,
                   top: int) -> dict:
  """Decode steps of a full batch: wall, host and device time per step, and its costliest kernels.

  Admits every prompt of `workload` (at once), decodes up to 8 steps (new shapes),
  then times up to `steps` steps (as many as the requests' new_tokens leave), then
  profiles one more (GPU: CUPTI; its kernels' total time is the device time of the
  step).
  """
  params = SamplingParams(max_new_tokens=new_tokens)
  for prompt in workload.prompts:
    engine.submit(prompt, params)
  while engine.num_queued:
    engine.step()
  left = new_tokens - 2 - max(len(r.output) for r in engine.requests.values())
  warm = min(8, left // 4)  # the steps that follow run shapes seen before
  steps = min(steps, left - warm)
  if steps < 1:
    raise ValueError(f'new_tokens={new_tokens} leave no decode step to profile')
  for _ in range(warm):
    engine.step()
  engine.stats = type(engine.stats)()
  for _ in range(steps):
    engine.step()
  stats = engine.stats.summary()
  b = engine.config.decode_rows(engine.cache.num_rows)
  layout_ms = 1e3 * timing.host_time(lambda: engine.cache.device_layout(num_rows=b),
                                     sync=lambda x: x).median_s
  rec = dict(kind='decode_profile', live_rows=engine.cache.num_rows, padded_rows=b,
             used_chunks=engine.cache.num_used_chunks, layout_ms=layout_ms,
             kv_per_seq_mb=(engine.cache.num_used_chunks * engine.config.chunk_size
                            * engine.kv_bytes_per_token / engine.cache.num_rows / 1e6),
             **{k: stats[k] for k in ('mean_decode_step_ms', 'mean_decode_host_ms',
                                      'mean_decode_wait_ms', 'mean_decode_prepare_ms',
                                      'mean_decode_dispatch_ms', 'decode_steps',
                                      'new_shape_steps')})
  if jax.default_backend() == 'gpu':
    # One whole step under CUPTI: with overlap_decode the step before is still on the device
    # (drained first), and a step returns with its own step dispatched (waited for at the end).
    jax.block_until_ready(engine.kv)
    _, kernels = timing.kernel_times(lambda: (engine.step(), engine.kv)[1])
    rec['device_ms'] = sum(k[1] for k in kernels) / 1e3
    rec['top_kernels'] = kernels[:top]
  for rid in list(engine.requests):
    engine.cancel(rid)
  engine.run()  # one iteration: the cancellations release every chunk
  return rec


def warm_up(engine: Engine, prompt_len: int, shared_frac: float, vocab: int,
            num_samples: int = 1, system_prompts: int = 1) -> None:
  """Compiles the point's shapes, then resets.

  A first and a sharing request, then a burst that fills the batch with every
  system prompt (its layouts have about as many segments as a busy point's),
  then a lone request that reuses cached chunks (they are its private pages).
  """
  shared = int(round(prompt_len * shared_frac))
  rng = np.random.default_rng(12345)
  systems = [rng.integers(0, vocab, shared).tolist() for _ in range(system_prompts)]
  params = SamplingParams(max_new_tokens=4, n=num_samples)

  def prompt(i):
    return systems[i % system_prompts] + rng.integers(0, vocab, prompt_len - shared).tolist()

  for _ in range(2):
    engine.submit(prompt(0), params)  # the second shares the first's prefix
  engine.run()
  for i in range(max(1, engine.config.max_batch // num_samples)):
    engine.submit(prompt(i), params)
  engine.run()
  engine.submit(prompt(0), params)
  engine.run()
  reset(engine)


def reset(engine: Engine) -> None:
  """Before a point: no stats, no finished requests, no cached prefixes (a cold start)."""
  engine.stats = type(engine.stats)()
  engine.requests.clear()
  engine.cache.evict()
  engine.cache.evicted_chunks = 0


def resolved_impl(engine: Engine, impl: str) -> str:
  """Which attention implementation the engine's decode steps run (AUTO resolved)."""
  cfg = engine.model.config
  b = engine.config.decode_rows(max(engine.cache.num_rows, 1))
  q = jax.ShapeDtypeStruct((b, 1, cfg.num_heads, cfg.head_dim), engine.kv.k.dtype)
  kv = jax.ShapeDtypeStruct(engine.kv.k.shape[1:], engine.kv.k.dtype)
  chosen, _ = hj.resolve(impl, q, kv, kv, engine.cache.device_layout(num_rows=b))
  return chosen.value
