r"""Host work of one decode iteration at batch 256, without a model (CPU, seconds).

Measurements of what the engine does on the host around its model call:

* once: a full rebuild of the decode layout (segments, groups, uploads), its
  reuse (only the private lengths are uploaded), and a remove + insert.
* cache: per step, `ChunkCache.append` for every live sequence and
  `device_layout` of all rows, rebuilt only when the tree changed. Without
  churn nothing finishes; with churn a sequence that has generated
  `--new_tokens` is removed and a new request admitted in its place (`insert`
  + `commit`), as in steady serving (about batch / new_tokens per step).
* engine: `Engine.step()` of the serving engine with the model call replaced by
  a stub that returns zeros, in the same steady state; `decode host` is what
  the engine reports as host overhead (a decode step but the wait for the
  device), and the iteration adds admission, the prefill's host part and
  retirement.

The engine's chunk size, batch, layout policy and lengths are those of a 7B
serving run (`--chunk_size=64`, `--batch=256`, `--system_prompts=4` of
`--system_len=2048` tokens, `--new_tokens=512`); the model shape does not enter
the host work, so the engine runs the tiny config's (stubbed) model.

  PYTHONPATH=. python3 -m experiments.host_overhead

Flags are checked before any work: without churn every sequence appends
`WARMUP_STEPS + --steps` tokens, which must fit in the `--new_tokens` it reserved.
On a laptop in seconds: --batch=8 --system_len=64 --user_len=8 --new_tokens=48 --steps=20
--chunk_size=16 --kv_piece=64

`--mesh=dp:2` runs the engine data parallel (one chunk cache per shard, `--batch` rows in
all, split over the shards); on CPU the devices are fake, one per mesh entry:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python3 -m \
      experiments.host_overhead --mesh=dp:2
"""

import functools
import os
import statistics
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from hydrajax.attention import parallel
from experiments.benchmarking import progress, report
from hydrajax.chunk_cache import ChunkCache, ChunkCacheConfig
from hydrajax.layout import LayoutPolicy
from models import engine as engine_lib
from models.config import get_config
from models.llama import init_model

_BATCH = flags.DEFINE_integer('batch', 256, 'live sequences')
_SYSTEMS = flags.DEFINE_integer('system_prompts', 4, 'distinct system prompts')
_SYSTEM_LEN = flags.DEFINE_integer('system_len', 2048, 'tokens of each system prompt')
_USER_LEN = flags.DEFINE_integer('user_len', 32, 'unique tokens after the system prompt')
_NEW = flags.DEFINE_integer('new_tokens', 512, 'tokens generated per request')
_CHUNK = flags.DEFINE_integer('chunk_size', 64, 'tokens per chunk')
_STEPS = flags.DEFINE_integer('steps', 300, 'timed decode steps per measurement')
_KV_PIECE = flags.DEFINE_integer('kv_piece', 1024, 'shared tokens per partial state')
_MODEL_CALL = flags.DEFINE_enum(
    'model_call', 'stub', ['stub', 'jitted_stub', 'model'],
    "the engine's model call: 'stub' returns zeros in Python (no dispatch); 'jitted_stub' is a "
    'jitted call that takes every argument and returns zeros (the dispatch: arguments, uploads; '
    "no model); 'model' the tiny model's step (on CPU its compute runs partly in the dispatch)")
_WORKDIR = cli.workdir_flag('host_overhead', 'output folder (results.jsonl, README.md)')
_MESH = flags.DEFINE_string('mesh', None, "the engine's model mesh, e.g. 'dp:2' (default: one "
                            'device); --batch rows in all, split over the dp shards')
cli.at_least(1, 'batch', 'system_prompts', 'system_len', 'user_len', 'new_tokens', 'chunk_size',
             'steps', 'kv_piece')

WARMUP_STEPS = 20  # untimed first steps of the cache measurements (numpy/JAX caches warm up)


def check_flags() -> None:
  """Every flag in range, before any work (a clear error instead of a crash minutes in)."""
  for holder in (_BATCH, _SYSTEMS, _SYSTEM_LEN, _USER_LEN, _NEW, _CHUNK, _STEPS, _KV_PIECE):
    if holder.value < 1:
      raise app.UsageError(f'--{holder.name} must be >= 1, got {holder.value}')
  if _STEPS.value + WARMUP_STEPS > _NEW.value:
    raise app.UsageError(
        f'need --steps + {WARMUP_STEPS} warm-up steps <= --new_tokens (without churn every '
        f'sequence appends that many tokens to the --new_tokens it reserved), got --steps='
        f'{_STEPS.value}, --new_tokens={_NEW.value}')
  try:
    mesh = parallel.parse_mesh(_MESH.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  dp = 1 if mesh is None else mesh.shape.get('dp', 1)
  if _BATCH.value % dp:
    raise app.UsageError(f'--batch={_BATCH.value} must divide over the mesh\'s dp={dp} shards')


def _layout_policy() -> LayoutPolicy:
  return LayoutPolicy(kv_piece=_KV_PIECE.value, min_segments=8, fixed_shapes=True,
                      min_private_pages=4)


def _prompt(rng, systems, i, vocab):
  """A system prompt + a unique tail of about `--user_len` tokens (lengths staggered)."""
  n = _USER_LEN.value
  tail = rng.integers(0, vocab, int(rng.integers(n // 2, n + n // 2 + 1)))
  return systems[i % len(systems)] + tail.tolist()


def _block(layout):
  jax.block_until_ready(jax.tree_util.tree_leaves(layout))


def _cache(b, systems_count) -> ChunkCache:
  c, new, user = _CHUNK.value, _NEW.value, _USER_LEN.value
  per_seq = -(-(user + user // 2 + new) // c) + 2
  return ChunkCache(ChunkCacheConfig(
      num_chunks=b * per_seq + systems_count * (-(-_SYSTEM_LEN.value // c)) + 64, chunk_size=c,
      max_sequence_length=_SYSTEM_LEN.value + user + user // 2 + new, max_sequences=b,
      layout=_layout_policy()))


def measure_cache(churn: bool) -> dict:
  """ms per step of append + layout (+ remove/insert of finished sequences with churn)."""
  b, new = _BATCH.value, _NEW.value
  rng = np.random.default_rng(0)
  systems = [rng.integers(0, 32000, _SYSTEM_LEN.value).tolist() for _ in range(_SYSTEMS.value)]
  cache = _cache(b, len(systems))
  budget = {}  # seq id -> tokens it may still append
  for i in range(b):
    a = cache.insert(_prompt(rng, systems, i, 32000), reserve_tokens=new)
    cache.commit(a.seq_id)
    budget[a.seq_id] = int(rng.integers(1, new + 1))  # finishes staggered over `new` steps
  times = {'churn': [], 'append': [], 'layout': [], 'step': []}
  changes, next_i, warm, last = 0, b, WARMUP_STEPS, cache.structure_version
  for step in range(_STEPS.value + warm):
    tokens = rng.integers(0, 32000, b)
    t0 = time.perf_counter()
    if churn:
      done = [sid for sid in cache.rows if budget[sid] <= 0]
      for sid in done:
        cache.remove(sid)
        del budget[sid]
      for _ in done:
        a = cache.insert(_prompt(rng, systems, next_i, 32000), reserve_tokens=new)
        cache.commit(a.seq_id)
        budget[a.seq_id] = new
        next_i += 1
    t1 = time.perf_counter()
    version = cache.structure_version
    cache.append(tokens)
    t2 = time.perf_counter()
    _block(cache.device_layout(num_rows=b))
    t3 = time.perf_counter()
    for sid in cache.rows:
      budget[sid] -= 1
    if step >= warm:  # the first steps warm numpy/JAX caches
      changes += int(version != last)  # this step rebuilt the layout
      times['churn'].append(t1 - t0)
      times['append'].append(t2 - t1)
      times['layout'].append(t3 - t2)
      times['step'].append(t3 - t0)
    last = cache.structure_version
  out = {k: 1e3 * statistics.mean(v) for k, v in times.items()}
  out['median_step'] = 1e3 * statistics.median(times['step'])
  out['structure_changes'] = changes
  return out


def measure_layout_rebuild() -> dict:
  """ms of one full layout rebuild (plan + groups + upload) vs a reuse, 256 rows, no churn."""
  b = _BATCH.value
  rng = np.random.default_rng(1)
  systems = [rng.integers(0, 32000, _SYSTEM_LEN.value).tolist() for _ in range(_SYSTEMS.value)]
  cache = _cache(b, len(systems))
  for i in range(b):
    cache.commit(cache.insert(_prompt(rng, systems, i, 32000), reserve_tokens=_NEW.value).seq_id)
  out = {}
  for name, fn in [
      ('plan', lambda: cache.plan(num_rows=b)),
      ('rebuild', lambda: (cache._device_cache.clear(), _block(cache.device_layout(num_rows=b)))),
      ('reuse', lambda: _block(cache.device_layout(num_rows=b))),
      ('remove_insert', lambda: _remove_insert(cache, rng, systems)),
  ]:
    fn()
    ts = []
    for _ in range(50):
      t0 = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t0)
    out[name] = 1e3 * statistics.median(ts)
  return out


def _remove_insert(cache, rng, systems):
  cache.remove(cache.rows[int(rng.integers(cache.num_rows))])
  prompt = _prompt(rng, systems, int(rng.integers(len(systems))), 32000)
  cache.commit(cache.insert(prompt, reserve_tokens=_NEW.value).seq_id)


def _stub_model(engine) -> None:
  """Replaces the engine's jitted model call by zeros (the host path is unchanged)."""

  def fake(params, cache, tokens, positions, slots, layout, key, request_ids, *args, **kwargs):
    return jnp.zeros(request_ids.shape[0], jnp.int32), cache

  engine.runner.model_step = fake


def _jitted_stub(engine) -> None:
  """Replaces the engine's model call by a jitted one that takes every argument (uploaded,
  in the shardings the compiler picks) and returns zeros: the dispatch without the model."""

  @functools.partial(jax.jit, static_argnames=('impl', 'top_logprobs'),
                     donate_argnames=('cache',), keep_unused=True)
  def fake(params, cache, tokens, positions, slots, layout, seeds, streams, *args, impl,
           top_logprobs, **kwargs):
    del params, tokens, positions, slots, layout, seeds, args, impl, top_logprobs, kwargs
    return jnp.zeros(streams.shape[0], jnp.int32), cache

  engine.runner.model_step = fake


def measure_engine() -> dict:
  """Engine steps at batch `--batch` with the model stubbed: decode host ms and iteration ms."""
  b, c, new = _BATCH.value, _CHUNK.value, _NEW.value
  mesh = parallel.parse_mesh(_MESH.value)
  model = init_model(get_config('tiny_gqa'), mesh=mesh)
  dp = 1 if mesh is None else mesh.shape.get('dp', 1)
  per_shard = b // dp  # the pool, max_batch and buckets are per dp shard
  vocab = model.config.vocab_size
  rng = np.random.default_rng(2)
  systems = [rng.integers(0, vocab, _SYSTEM_LEN.value).tolist() for _ in range(_SYSTEMS.value)]
  sizes = _cache(per_shard, len(systems)).config
  config = engine_lib.EngineConfig(
      num_chunks=sizes.num_chunks, chunk_size=c, max_batch=per_shard,
      max_sequence_length=sizes.max_sequence_length,
      max_prefill_rows=1, max_prefill_tokens=8192, decode_buckets=(per_shard,),
      layout=_layout_policy(), impl='xla', prefill_impl='xla')
  params = engine_lib.SamplingParams(max_new_tokens=new)
  engine = engine_lib.Engine(model, config)
  if _MODEL_CALL.value == 'stub':
    _stub_model(engine)
  elif _MODEL_CALL.value == 'jitted_stub':
    _jitted_stub(engine)
  submitted = 0
  # One arrival per step until the batch is full (staggered lengths), then one per finish;
  # `new` more steps reach the steady state (about b / new requests finish per step).
  while engine.num_running < b:
    if engine.num_queued == 0:
      engine.submit(_prompt(rng, systems, submitted, vocab), params)
      submitted += 1
    engine.step()
  iteration = []
  for step in range(new + _STEPS.value):
    if step == new:
      engine.stats = type(engine.stats)()
    while engine.num_running + engine.num_queued < b:
      engine.submit(_prompt(rng, systems, submitted, vocab), params)
      submitted += 1
    t0 = time.perf_counter()
    engine.step()
    if step >= new:
      iteration.append(time.perf_counter() - t0)
  s = engine.stats.summary()
  return dict(decode_host_ms=s['mean_decode_host_ms'], decode_step_ms=s['mean_decode_step_ms'],
              prepare_ms=s['mean_decode_prepare_ms'], dispatch_ms=s['mean_decode_dispatch_ms'],
              plan_builds=s['plan_builds'], decode_steps=s['decode_steps'],
              iteration_ms=1e3 * statistics.mean(iteration),
              median_iteration_ms=1e3 * statistics.median(iteration),
              mean_batch=s['decode_rows'] / max(s['decode_steps'], 1),
              finished=sum(r.state == 'done' for r in engine.requests.values()))


def main(argv):
  del argv
  check_flags()
  os.makedirs(_WORKDIR.value, exist_ok=True)
  writer = report.JsonlWriter(os.path.join(_WORKDIR.value, 'results.jsonl'))
  open(writer.path, 'w').close()
  lines = []

  def say(line, record):
    print(line)
    lines.append(f'- {line}')
    writer.append(record)

  say(f'batch {_BATCH.value}, {_SYSTEMS.value} system prompts x {_SYSTEM_LEN.value} tokens '
      f'+ {_USER_LEN.value} unique, {_NEW.value} new tokens, chunk {_CHUNK.value}, '
      f'{jax.default_backend()}', dict(kind='settings', batch=_BATCH.value))
  once = measure_layout_rebuild()
  say('once (median ms): ' + ', '.join(f'{k} {v:.3f}' for k, v in once.items()),
      dict(kind='layout_rebuild', ms=once))
  for churn in progress((False, True), total=2, desc='cache'):
    r = measure_cache(churn)
    say(f'cache, churn={churn} (mean ms per step): step {r["step"]:.3f} (median '
        f'{r["median_step"]:.3f}) = remove/insert {r["churn"]:.3f} + append {r["append"]:.3f} '
        f'+ layout {r["layout"]:.3f}; {r["structure_changes"]} of {_STEPS.value} steps changed '
        'the tree', dict(kind='cache', with_churn=churn, results=r))
  r = measure_engine()
  say(f'engine, model call {_MODEL_CALL.value} (mean ms per step, batch '
      f'{r["mean_batch"]:.0f}, mesh {_MESH.value or "none"}): decode host '
      f'{r["decode_host_ms"]:.3f} = prepare {r["prepare_ms"]:.3f} + dispatch '
      f'{r["dispatch_ms"]:.3f} + emit, iteration {r["iteration_ms"]:.3f} (median '
      f'{r["median_iteration_ms"]:.3f}); {r["plan_builds"]} plan builds in '
      f'{r["decode_steps"]} steps; {r["finished"]} requests finished',
      dict(kind='engine', model_call=_MODEL_CALL.value, mesh=_MESH.value or 'none', results=r))
  report.write_workdir_readme(_WORKDIR.value, 'Host overhead of the cache and the engine',
                              '\n'.join(lines), writer.meta)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
