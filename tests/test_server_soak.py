"""Soak: 8 clients of mixed valid traffic through the server (prompts of 1-300 tokens sharing a few
system prefixes, n in {1, 2, 4}, both APIs, streamed or not, greedy or sampled, some clients that
leave early). Asserts: every request that stays is answered in full, the engine runs on a bounded
set of compiled shapes (its budget), memory is steady (RSS and memory-map growth after the first
third bounded), nothing leaks, and the engine thread is alive at the end.

In CI it runs HYDRAJAX_SOAK_SECONDS (default 30) of traffic on the tiny model, after compiling
every shape of the engine's budget (as the server's main does). The long form, by hand (prints the
shape count, RSS and maps over time):

  PYTHONPATH=. python -m tests.test_server_soak --soak_minutes=15

Traffic goes to 127.0.0.1 only, is bounded in count and time, and stops by itself.
"""

import http.client
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip('uvicorn', reason='the server needs the serve extra: pip install .[serve]')

from hydrajax.layout import LayoutPolicy
from models.engine import Engine, EngineConfig
from tests.test_engine import assert_no_leak
from tests.test_server import HANG_GUARD_S, Served, model  # noqa: F401 (fixture)

SOAK_S = float(os.environ.get('HYDRAJAX_SOAK_SECONDS', '30'))
MAX_REQUESTS = 100_000  # a bound on the traffic whatever the duration
CLIENTS = 8
MAX_PROMPT = 300
# Few compiled shapes, so that warming them all up stays short on a CPU: one decode bucket, one
# prefill length, and segment slots from 256 (a budget of 3 model-step shapes; at min_segments=8
# it is 11, and a warm-up takes minutes on a loaded machine).
SOAK_CONFIG = EngineConfig(
    num_chunks=384, chunk_size=16, max_batch=CLIENTS * 4, max_sequence_length=MAX_PROMPT + 20,
    decode_buckets=(CLIENTS * 4,), min_prefill_len=512, max_prefill_rows=1, impl='xla',
    prefill_impl='xla', layout=LayoutPolicy(kv_piece=16, min_segments=256, fixed_shapes=True),
)
# After the first third. RSS swings by ~100 MiB with XLA's temporaries; the leak of compiles was GBs.
RSS_GROWTH_BYTES = 192 * 2**20
MAPS_GROWTH = 256  # memory maps after the first third (the crash ran out of them)


def _rss_and_maps() -> tuple[int, int]:
  with open('/proc/self/statm') as f:
    rss = int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  with open('/proc/self/maps') as f:
    maps = sum(1 for _ in f)
  return rss, maps


def _request(rng, systems) -> tuple[str, dict, int]:
  """(path, body, choices expected) of one random valid request."""
  length = int(rng.integers(1, MAX_PROMPT + 1))
  system = systems[int(rng.integers(len(systems)))]
  prompt = (system + rng.integers(0, 97, MAX_PROMPT).tolist())[:length]
  n = int(rng.choice([1, 2, 4]))
  new = int(rng.integers(1, 17))
  temperature = float(rng.choice([0.0, 0.8]))
  stream = bool(rng.integers(2))
  if rng.integers(2):
    return '/v1/generate', {'prompt': prompt, 'n': n, 'max_new_tokens': new,
                            'temperature': temperature, 'stream': stream}, n
  return '/v1/completions', {'model': 'tiny', 'prompt': prompt, 'n': n, 'max_tokens': new,
                             'temperature': temperature, 'stream': stream}, n


def _check(path, body, n, status, ctype, data) -> None:
  assert status == 200, (status, data[:300])
  if path == '/v1/generate' and body['stream']:
    lines = [json.loads(line) for line in data.splitlines()]
    assert sum(e['finished'] for e in lines) == n
  elif path == '/v1/generate':
    reply = json.loads(data)
    assert len(reply['outputs']) == n
    assert all(1 <= len(o) <= body['max_new_tokens'] for o in reply['outputs'])
  elif body['stream']:
    assert data.endswith(b'data: [DONE]\n\n') and data.count(b'"finish_reason": "') == n
  else:
    reply = json.loads(data)
    assert len(reply['choices']) == n and all(c['finish_reason'] for c in reply['choices'])


def soak(llama, seconds: float, *, seed: int = 0, warmup: bool = True, log=None) -> dict:
  """Runs the traffic for `seconds`; returns what it saw (asserting every answer on the way)."""
  engine = Engine(llama, SOAK_CONFIG)
  if warmup:
    engine.warmup()  # every shape of the budget before the traffic, as the server's main does
  served = Served(engine)
  start = time.monotonic()
  deadline = start + seconds
  counts = {'answered': 0, 'left': 0}
  errors, samples = [], []
  lock = threading.Lock()
  rng0 = np.random.default_rng(seed)
  systems = [rng0.integers(0, 97, int(k)).tolist() for k in (0, 16, 64, 200)]

  def client(i):
    rng = np.random.default_rng(seed * 1000 + i + 1)
    while time.monotonic() < deadline:
      with lock:
        if counts['answered'] + counts['left'] >= MAX_REQUESTS:
          return
      path, body, n = _request(rng, systems)
      try:
        if rng.random() < 0.1:  # a client that leaves before its answer
          with socket.create_connection(('127.0.0.1', served.port), timeout=HANG_GUARD_S) as s:
            payload = json.dumps(body).encode()
            s.sendall(f'POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n'
                      f'\r\n'.encode() + payload)
          with lock:
            counts['left'] += 1
          continue
        conn = http.client.HTTPConnection('127.0.0.1', served.port, timeout=HANG_GUARD_S)
        conn.request('POST', path, body=json.dumps(body))
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        _check(path, body, n, resp.status, resp.getheader('content-type'), data)
        with lock:
          counts['answered'] += 1
      except BaseException as e:  # reported after the run, with its request
        errors.append((path, {k: v for k, v in body.items() if k != 'prompt'}, repr(e)))
        return

  def monitor():
    while time.monotonic() < deadline and not errors:
      rss, maps = _rss_and_maps()
      samples.append((time.monotonic() - start, len(engine.stats.shapes), rss, maps,
                      counts['answered']))
      if log is not None:
        log(f'{samples[-1][0]:7.1f} s  shapes {samples[-1][1]:3d}  rss {rss / 2**20:7.1f} MiB  '
            f'maps {maps:5d}  answered {counts["answered"]}')
      time.sleep(min(1.0, seconds / 20))

  threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
  threads.append(threading.Thread(target=monitor))
  try:
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors, errors[:5]
    served.wait_idle()
    alive = served.server.loop.alive and served.get('/v1/health')[0] == 200
    leftover = len(engine.requests)
    assert_no_leak(engine)
  finally:
    served.close()
  rss, maps = _rss_and_maps()
  samples.append((time.monotonic() - start, len(engine.stats.shapes), rss, maps,
                  counts['answered']))
  return {'samples': samples, 'alive': alive, 'leftover_requests': leftover, **counts,
          'shapes': len(engine.stats.shapes),
          'budget': engine.compiled_shape_budget().num_programs}


def _check_soak(result) -> None:
  samples = result['samples']
  assert result['alive'] and result['leftover_requests'] == 0
  assert result['answered'] >= 1 and result['answered'] + result['left'] >= CLIENTS
  assert result['shapes'] <= result['budget'], result
  third = next(s for s in samples if s[0] >= samples[-1][0] / 3)
  assert samples[-1][2] - third[2] <= RSS_GROWTH_BYTES, (third, samples[-1])
  assert samples[-1][3] - third[3] <= MAPS_GROWTH, (third, samples[-1])


def test_soak_mixed_traffic_bounded_shapes_steady_memory(model):  # noqa: F811
  _check_soak(soak(model, SOAK_S))


if __name__ == '__main__':
  from absl import app, flags
  from flax import nnx

  from models.config import get_config
  from models.llama import Llama

  _MINUTES = flags.DEFINE_float('soak_minutes', 15.0, 'traffic duration')
  _SEED = flags.DEFINE_integer('seed', 0, 'traffic seed')
  _WARMUP = flags.DEFINE_boolean('warmup', True, 'compile every shape of the budget first')

  def main(argv):
    del argv
    llama = Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0))
    result = soak(llama, 60 * _MINUTES.value, seed=_SEED.value, warmup=_WARMUP.value,
                  log=lambda m: print(m, flush=True))
    print({k: v for k, v in result.items() if k != 'samples'})
    _check_soak(result)
    print('soak passed')

  app.run(main)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_soak_mixed_traffic_bounded_shapes_steady_memory': (),
}
