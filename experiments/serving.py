r"""Serving benchmark: the continuous-batching engine with and without prefix sharing.

Requests arrive as a Poisson process at a sweep of rates. Each prompt is
`prompt_len` tokens whose first `shared_frac` are one of several system
prompts (the rest unique); each asks for `--new_tokens` tokens, in
`--num_samples` samples (one prefill, then a fork; the rate counts prompts).
Per point: normalized latency (end-to-end latency / output tokens, queueing
included, per sample), throughput, peak KV memory and KV per live sequence,
host overhead per decode step (ms and % of the step: the step's wall time
minus its wait for the device). The same engine with `share_prefixes=False` is the baseline; the
sharing engine keeps finished prompts' chunks cached (`retain_prefixes`,
emptied before each point, so every point starts cold).

Per (prompt length, shared fraction): the rate at the latency bound, i.e. the
highest rate whose mean normalized latency stays under each of `--latency_bounds_ms` on
the measured curve (linear interpolation between the two measured rates around
the crossing; a bound outside the measured rates is reported as such), for
each engine, and their ratio (sharing on / off) at that equal normalized
latency; and each engine's most tokens/s over the points. Points that compiled
(a decode shape first seen inside the point) are left out of these. These are
the `rate_at_bound` records of results.jsonl and the last tables of table.md
(computed in experiments/serving_report.py).

The H200 runs are in experiments/results/serving/ (its README). The main one
(2K prompts, 100% shared; on a GPU machine with --workdir=workdir/f/sweep):

  PYTHONPATH=. python3 -m experiments.serving --model=llama2_7b --prompt_lens=2048 \
      --shared_fracs=1,0.5 --rates=6,12,24,48 --num_requests=96 --new_tokens=512 \
      --kv_gib=32 --max_batch=128 --impl=auto --deadline_s=400

`--profile_batches=32,128,256` first profiles decode steps of full batches
(step, host and device time, the costliest kernels); `--report_from=results.jsonl`
only rewrites a run's report.

The full sweep of the issue: `--prompt_lens=1024,2048,4096 --shared_fracs=0,0.5,1
--new_tokens=512` (long: `--resume` continues a cut sweep in the same --workdir).
`--smoke` runs a tiny model on CPU in under a minute.
Writes results.jsonl, table.md and plots into --workdir.
"""

import gc
import os
import time

from absl import app, flags, logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import cli
import hydrajax as hj
from experiments.serving_engine import (
    make_engine, make_workload, profile_decode, reset, resolved_impl, serve, warm_up,
)
from experiments.serving_report import profile_table, summarize
from experiments.benchmarking import report, timing
from hydrajax.chunk_cache import ChunkCache, ChunkCacheConfig
from hydrajax.layout import LayoutPolicy
from hydrajax.layout import SharingPlan
from hydrajax.attention.parallel import initialize_distributed, parse_mesh
from models import sharding_rules as sr
from models.config import get_config
from models.engine import SamplingParams
from models.llama import init_model

_MODEL = flags.DEFINE_string('model', 'llama2_7b', 'model preset (random weights)')
_MESH = flags.DEFINE_string('mesh', '', "device mesh, e.g. 'tp:2' (tensor parallel engine; '' "
                            "or 'none': one device)")
_DISTRIBUTED = flags.DEFINE_string(
    'distributed', '', "multi-host start-up: 'auto' or 'HOST:PORT,NUM_PROCESSES,PROCESS_ID' "
    '(see hydrajax/PARALLELISM.md)')
_PROMPT_LENS = flags.DEFINE_list('prompt_lens', ['1024', '2048', '4096'], 'prompt lengths')
_SHARED = flags.DEFINE_list('shared_fracs', ['0', '0.5', '1'], 'shared fraction of each prompt')
_RATES = flags.DEFINE_list('rates', ['6', '12', '24', '48'], 'request rates, requests/s')
_SHARING = flags.DEFINE_list('sharing', ['on', 'off'], 'engines: prefix sharing on / off')
_NUM_REQUESTS = flags.DEFINE_integer('num_requests', 96, 'requests per point')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 512, 'tokens generated per request')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'samples per prompt (forked after prefill)')
_SYSTEM_PROMPTS = flags.DEFINE_integer('system_prompts', 4, 'distinct system prompts')
_KV_GIB = flags.DEFINE_float('kv_gib', 32.0, 'KV pool size of each engine, GiB')
_CHUNK = flags.DEFINE_integer('chunk_size', 64, 'tokens per chunk')
_MAX_BATCH = flags.DEFINE_integer('max_batch', 128, 'most live sequences (the decode batch)')
_KV_PIECE = flags.DEFINE_integer('kv_piece', 1024, 'shared tokens per partial state')
_MIN_SEGMENTS = flags.DEFINE_integer('min_segments', 8, 'padded segment slots of a layout')
_IMPL = flags.DEFINE_string('impl', 'auto', 'attention implementation (auto, xla, mosaic_gpu)')
_OVERLAP = flags.DEFINE_boolean('overlap_decode', False,
                                'dispatch decode step k+1 before waiting for step k (EngineConfig)')
_COMMAND_BUFFERS = flags.DEFINE_boolean(
    'command_buffers', True, 'CUDA graphs for the model step (EngineConfig.command_buffers)')
_LATENCY_BOUNDS = flags.DEFINE_list('latency_bounds_ms', ['20', '30', '50'],
                                    'normalized latency bounds, ms/token (a table each)')
_DEADLINE = flags.DEFINE_float('deadline_s', 1e9, 'stop starting points after this many seconds')
_BENCH_IMPLS = flags.DEFINE_list('bench_impls', ['xla', 'auto'],
                                 'implementations of --attention_bench')
_ATTENTION_BENCH = flags.DEFINE_boolean('attention_bench', False,
                                        'also time attention over the pool at batch 32, 4K shared')
_PROFILE_BATCHES = flags.DEFINE_list(
    'profile_batches', [], 'first profile decode steps of a full batch of each size, per setting '
    'and engine (the engine without sharing caps it by memory)')
_PROFILE_STEPS = flags.DEFINE_integer('profile_steps', 32, 'decode steps timed per profile')
_REPORT_FROM = flags.DEFINE_string(
    'report_from', '', 'only write the report (table.md, plots) of this results.jsonl into '
    '--workdir (with this code\'s report, e.g. other --latency_bounds_ms)')
_RESUME = flags.DEFINE_boolean(
    'resume', False, 'keep the points of --workdir/results.jsonl that ran to the end and run '
    'only the missing ones (a long sweep over several device calls)')
_SMOKE = flags.DEFINE_boolean('smoke', False, 'tiny model on CPU, seconds')
_WORKDIR = cli.workdir_flag('serving')
_SEED = flags.DEFINE_integer('seed', 0, 'workload seed')
cli.at_least(1, 'num_requests', 'new_tokens', 'num_samples', 'system_prompts', 'chunk_size',
             'max_batch', 'kv_piece', 'min_segments', 'profile_steps')
cli.at_least(0.001, 'kv_gib', 'deadline_s')
cli.int_list('prompt_lens')
cli.number_list('shared_fracs', 0.0, strict=False)
cli.choices('sharing', ['on', 'off'])


def attention_bench(config, impls: list[str], writer) -> list[dict]:
  """Attention over the chunk pool, batch 32, a 4K prompt shared by all vs not shared."""
  b, prompt, chunk = 32, 4096, 64
  generated = 33  # private tokens after the prompt (non-multiple of the chunk)
  kh, n, h = config.num_kv_heads, config.num_heads, config.head_dim
  records = []
  key = jax.random.key(7)
  for share in (True, False):
    cache = ChunkCache(ChunkCacheConfig(
        num_chunks=b * (prompt // chunk + 2) + 8, chunk_size=chunk,
        max_sequence_length=prompt + 128, max_sequences=b, share_prefixes=share,
        layout=LayoutPolicy(kv_piece=_KV_PIECE.value)))
    tokens = list(range(prompt))
    for _ in range(b):
      cache.commit(cache.insert(tokens, reserve_tokens=64).seq_id)
    for _ in range(generated):
      cache.append(np.arange(b))
    layouts = {'two_phase' if share else 'no_sharing': cache.device_layout()}
    if share:  # PagedAttention with physically shared pages: every row pages over all its chunks
      paged = SharingPlan(b, (), chunk, tuple(tuple(cache.chunks(sid)) for sid in cache.rows),
                          tuple(int(n) for n in cache.lengths()), cache.config.kv_tokens)
      layouts['paged_shared_pages'] = paged.to_device(
          policy=cache.config.layout, max_private_pages=cache.config.max_pages)
    kk, kv, kq, key = jax.random.split(key, 4)
    length = cache.config.kv_tokens
    k = jax.random.normal(kk, (length, kh, h), jnp.bfloat16)
    v = jax.random.normal(kv, (length, kh, h), jnp.bfloat16)
    q = jax.random.normal(kq, (b, 1, n, h), jnp.bfloat16)
    expected = np.asarray(hj.naive_tree_attention(q, k, v, cache.plan()).out, np.float32)
    for name, layout in layouts.items():
      timed = set()
      for want in impls:
        try:
          chosen, _ = hj.resolve(want, q, k, v, layout)
          if chosen in timed:
            continue
          timed.add(chosen)
          fn = jax.jit(lambda q, k, v, lay, w=want: hj.tree_attention(q, k, v, lay, impl=w).out)
          out = np.asarray(fn(q, k, v, layout), np.float32)
          err = float(np.linalg.norm(out - expected) / np.linalg.norm(expected))
          t = timing.device_time(fn, q, k, v, layout, repeats=3, target_s=0.01)
          rec = dict(kind='attention', variant=name, impl=want, resolved=chosen.value, batch=b,
                     prompt=prompt, private=generated, time_us=t.median_us, spread=t.spread,
                     rel_err_vs_oracle=err)
        except Exception as e:  # recorded, not fatal: the sweep still runs
          rec = dict(kind='attention', variant=name, impl=want, error=f'{type(e).__name__}: {e}')
        logging.info('%s', rec)
        writer.append(rec)
        records.append(rec)
  return records


def write_report(records: list[dict], profiles: list[dict], writer=None) -> None:
  """table.md and the plots of serving points and decode profiles, into --workdir."""
  os.makedirs(_WORKDIR.value, exist_ok=True)
  if records:
    bounds = _positive_numbers('latency_bounds_ms', _LATENCY_BOUNDS.value)
    summarize(records, bounds, _WORKDIR.value, writer)
  if profiles:
    text = profile_table(profiles)
    with open(os.path.join(_WORKDIR.value, 'table.md'), 'a' if records else 'w') as f:
      f.write(text)
    print(text)


def _positive_numbers(name: str, values: list[str]) -> list[float]:
  """A list flag as numbers > 0, or a clear error before any work starts."""
  try:
    out = [float(v) for v in values]
  except ValueError:
    raise app.UsageError(f'--{name} must be numbers, got {values}') from None
  if any(v <= 0 for v in out):
    raise app.UsageError(f'--{name} must be > 0, got {values}')
  return out


def _ran_to_the_end(r) -> bool:
  return r.get('kind') in ('serving', 'decode_profile') and not r.get('timed_out')


def main(argv):
  del argv
  _positive_numbers('latency_bounds_ms', _LATENCY_BOUNDS.value)
  if _REPORT_FROM.value:  # only the report, from a run's results; bound rows: report.jsonl
    rows = report.read_jsonl(_REPORT_FROM.value)
    os.makedirs(_WORKDIR.value, exist_ok=True)
    path = os.path.join(_WORKDIR.value, 'report.jsonl')
    if os.path.exists(path):
      os.remove(path)
    writer = report.JsonlWriter(path)
    write_report([r for r in rows if r.get('kind') == 'serving'],
                 [r for r in rows if r.get('kind') == 'decode_profile'], writer)
    _readme(writer.meta)
    return
  if _SMOKE.value:
    model_name, lens, fracs, rates = 'tiny_gqa', [64], [1.0], [50.0, 400.0]
    num_requests, new_tokens, chunk, max_batch, kv_piece = 8, 16, 16, 8, 32
    num_chunks = 96
  else:
    model_name = _MODEL.value
    lens = [int(x) for x in _PROMPT_LENS.value]
    fracs = [float(x) for x in _SHARED.value]
    rates = _positive_numbers('rates', _RATES.value)
    num_requests, new_tokens, chunk = _NUM_REQUESTS.value, _NEW_TOKENS.value, _CHUNK.value
    max_batch, kv_piece, num_chunks = _MAX_BATCH.value, _KV_PIECE.value, None
  config = get_config(model_name)
  initialize_distributed(_DISTRIBUTED.value)
  mesh = parse_mesh(_MESH.value)  # bad meshes fail here, before any work
  if mesh is not None and mesh.shape.get('dp', 1) > 1:
    raise ValueError(f'--mesh={_MESH.value}: this experiment profiles one chunk cache; use tp '
                     'only (the engine itself runs dp: hydrajax/PARALLELISM.md)')
  sr.check_mesh(config, mesh)
  dtype = jnp.float32 if _SMOKE.value else jnp.bfloat16
  t0 = time.perf_counter()
  model = init_model(config, mesh=mesh, seed=0, dtype=dtype)  # in its shards with --mesh
  jax.block_until_ready(nnx.state(model))
  logging.info('model %s ready in %.1fs', model_name, time.perf_counter() - t0)
  if num_chunks is None:
    num_chunks = int(_KV_GIB.value * 2**30 // (chunk * config.kv_bytes_per_token(2)))
  os.makedirs(_WORKDIR.value, exist_ok=True)
  path = os.path.join(_WORKDIR.value, 'results.jsonl')
  # --resume keeps what ran (not cut short), each record with its own meta; the rest runs
  kept = report.resume_records(path, _ran_to_the_end if _RESUME.value else None)
  records = [r for r in kept if r['kind'] == 'serving']
  profiles = [r for r in kept if r['kind'] == 'decode_profile']
  if kept:
    logging.info('resuming: %d serving points already ran', len(records))
  writer = report.JsonlWriter(path)
  start = time.perf_counter()

  samples = _NUM_SAMPLES.value

  def point_key(sharing, prompt_len, frac, rate):
    return sharing, int(prompt_len), float(frac), float(rate)

  same_load = dict(num_requests=num_requests, num_samples=samples, new_tokens=new_tokens)
  done_points = {point_key(r['sharing'], r['prompt_len'], r['shared_frac'], r['rate'])
                 for r in records if all(r.get(k) == v for k, v in same_load.items())}
  params = SamplingParams(max_new_tokens=new_tokens, n=samples)
  knobs = dict(impl=_IMPL.value, min_segments=_MIN_SEGMENTS.value,
               overlap_decode=_OVERLAP.value, command_buffers=_COMMAND_BUFFERS.value)
  for prompt_len in lens:
    for frac in fracs:
      for sharing in _SHARING.value:
        done = set()
        for batch in [int(x) for x in _PROFILE_BATCHES.value]:
          engine = make_engine(model, sharing=sharing == 'on', prompt_len=prompt_len,
                               new_tokens=new_tokens, num_chunks=num_chunks,
                               chunk=chunk, max_batch=batch, kv_piece=kv_piece, **knobs)
          if engine.config.max_batch in done:  # capped by memory to a batch already profiled
            continue
          done.add(engine.config.max_batch)
          workload = make_workload(
              num_requests=engine.config.max_batch, prompt_len=prompt_len, shared_frac=frac,
              rate=1.0, system_prompts=_SYSTEM_PROMPTS.value, vocab=config.vocab_size,
              seed=_SEED.value)
          rec = dict(model=model_name, sharing=sharing, prompt_len=prompt_len, shared_frac=frac,
                     batch=engine.config.max_batch, system_prompts=_SYSTEM_PROMPTS.value,
                     impl=_IMPL.value, resolved_impl=resolved_impl(engine, _IMPL.value),
                     overlap_decode=_OVERLAP.value, command_buffers=_COMMAND_BUFFERS.value,
                     **profile_decode(engine, workload, new_tokens=new_tokens,
                                       steps=_PROFILE_STEPS.value, top=12))
          logging.info('profile: %s', rec)
          writer.append(rec)
          profiles.append(rec)
          del engine
          gc.collect()
  total, point = len(lens) * len(fracs) * len(rates) * len(_SHARING.value), 0
  bar = report.progress_counter(total=total, desc='serving points')
  for prompt_len in lens:
    for frac in fracs:
      if time.perf_counter() - start > _DEADLINE.value:
        break
      engines = {}
      todo = {sharing for sharing in _SHARING.value for rate in rates
              if point_key(sharing, prompt_len, frac, rate) not in done_points}
      for sharing in [x for x in _SHARING.value if x in todo]:  # both live: every rate gets both
        engine = make_engine(model, sharing=sharing == 'on', prompt_len=prompt_len,
                             new_tokens=new_tokens, num_chunks=num_chunks,
                             chunk=chunk, max_batch=max_batch, kv_piece=kv_piece, **knobs)
        tw = time.perf_counter()
        warm_up(engine, prompt_len, frac, config.vocab_size, samples, _SYSTEM_PROMPTS.value)
        engines[sharing] = (engine, time.perf_counter() - tw, resolved_impl(engine, _IMPL.value))
        logging.info('engine sharing=%s ready (warm-up %.1fs)', sharing, engines[sharing][1])
      for rate in rates:
        for sharing, (engine, warm_s, impl_used) in engines.items():
          left = _DEADLINE.value - (time.perf_counter() - start)
          if left <= 0:
            break
          if point_key(sharing, prompt_len, frac, rate) in done_points:
            continue
          workload = make_workload(
              num_requests=num_requests, prompt_len=prompt_len, shared_frac=frac, rate=rate,
              system_prompts=_SYSTEM_PROMPTS.value, vocab=config.vocab_size, seed=_SEED.value)
          point += 1
          logging.info('[%d/%d] sharing=%s P=%d f=%.2f rate=%g (%.0fs elapsed)', point, total,
                       sharing, prompt_len, frac, rate, time.perf_counter() - start)
          reset(engine)
          metrics = serve(engine, workload, params, deadline_s=left)
          rec = dict(kind='serving', model=model_name, sharing=sharing, prompt_len=prompt_len,
                     shared_frac=frac, rate=rate, num_requests=num_requests,
                     num_samples=samples, retain_prefixes=engine.cache.config.retain_prefixes,
                     new_tokens=new_tokens, chunk_size=chunk, max_batch=engine.config.max_batch,
                     kv_pool_gb=num_chunks * chunk * config.kv_bytes_per_token(2) / 1e9,
                     system_prompts=_SYSTEM_PROMPTS.value, impl=_IMPL.value,
                     overlap_decode=_OVERLAP.value, command_buffers=_COMMAND_BUFFERS.value,
                     resolved_impl=impl_used, warmup_s=warm_s,
                     **metrics)
          writer.append(rec)
          records.append(rec)
          bar.update()
          logging.info(
              'sharing=%s P=%d f=%.2f rate=%g: %.1f ms/token, %.0f tok/s, peak KV %.2f GB, '
              'batch %.1f, step %.1f ms, host %.2f ms (%.1f%%)', sharing, prompt_len, frac, rate,
              rec['mean_norm_latency_ms'] or -1, rec['throughput_tok_s'], rec['peak_kv_gb'],
              rec['mean_batch'], rec['mean_decode_step_ms'], rec['mean_decode_host_ms'],
              100 * rec['host_overhead_fraction'])
      engines.clear()
      gc.collect()
  bar.close()
  if point < total:
    logging.info('the deadline cut the sweep: %d of %d points ran', point, total)
  write_report(records, profiles, writer)
  if _ATTENTION_BENCH.value:  # last: a kernel failure cannot cost the sweep's results
    del model
    gc.collect()
    bench = attention_bench(config, _BENCH_IMPLS.value, writer)
    text = ('\n## Attention over the chunk pool: batch 32, 4K prompt shared by all, '
            '33 private tokens\n\n'
            + report.markdown_table(bench, [
                ('variant', 'variant'), ('impl', 'impl'), ('ran', 'resolved'),
                ('time us', 'time_us'), ('spread', 'spread'), ('rel err', 'rel_err_vs_oracle'),
                ('error', lambda r: (r.get('error') or '')[:120])]))
    with open(os.path.join(_WORKDIR.value, 'table.md'), 'a') as f:
      f.write(text)
    print(text)
  _readme(writer.meta)


def _readme(meta) -> None:
  table = os.path.join(_WORKDIR.value, 'table.md')
  body = open(table).read() if os.path.exists(table) else ''
  report.write_workdir_readme(_WORKDIR.value, 'Serving: the engine under traffic', body, meta)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
