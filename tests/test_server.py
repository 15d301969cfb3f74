"""The HTTP server over the engine: outputs equal the engine's, streaming, OpenAI completions,
bad input and bad transport get JSON errors naming the field, disconnects cancel, the engine
thread survives requests and says when it stops. Traffic goes to 127.0.0.1 only."""

import contextlib
import dataclasses
import http.client
import json
import re
import socket
import threading
import time

import numpy as np
import pytest
from flax import nnx

pytest.importorskip('uvicorn', reason='the server needs the serve extra: pip install .[serve]')
pytest.importorskip('starlette', reason='the server needs the serve extra: pip install .[serve]')

from hydrajax.layout import LayoutPolicy
from models.config import get_config
from models.engine import Engine, EngineConfig, SamplingParams
from models.chat_template import SMOLLM2_TEMPLATE
from models.llama import Llama
from models.server import ServerConfig, make_server
from models.server_api import (
    BadRequest, Limits, parse_completion, parse_generate,
)
from models.tokenizer import Tokenizer
from tests.test_engine import assert_no_leak
from tests.test_generate_cli import char_tokenizer

CONFIG = EngineConfig(
    num_chunks=28, chunk_size=4, max_batch=4, max_sequence_length=48, decode_buckets=(8,),
    min_prefill_len=32, max_prefill_rows=1, impl='xla', prefill_impl='xla',
    layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True, min_private_pages=12),
    prefill_layout=LayoutPolicy(kv_piece=16, min_segments=8, fixed_shapes=True,
                                min_private_pages=12),
)
LIMITS = Limits(vocab_size=97, max_sequence_length=48, max_batch=4)
HANG_GUARD_S = 120  # generous: only so that a broken server fails instead of hanging


@pytest.fixture(scope='module')
def model():
  return Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0))


# Engines are shared by the tests of the module (each new engine compiles its steps again);
# servers are not. Greedy outputs do not depend on request ids, so a shared engine's equal a
# fresh one's.
@pytest.fixture(scope='module')
def engine(model):
  return Engine(model, CONFIG)


@pytest.fixture(scope='module')
def reference(model):
  return Engine(model, CONFIG)


@pytest.fixture(scope='module')
def long_engine(model):
  return Engine(model, dataclasses.replace(CONFIG, num_chunks=64, max_sequence_length=240))


class Served:
  """A started server on 127.0.0.1 and a few clients of it."""

  def __init__(self, engine, **kwargs):
    self.engine = engine
    kwargs.setdefault('model_name', 'tiny')  # what the tests' requests name
    self.server = make_server(engine, port=0, **kwargs).start()
    self.port = self.server.port

  def post(self, path, payload=None, *, raw=None, headers=None):
    conn = http.client.HTTPConnection('127.0.0.1', self.port, timeout=HANG_GUARD_S)
    body = raw if raw is not None else json.dumps(payload).encode()
    conn.request('POST', path, body=body, headers=headers or {'Content-Type': 'application/json'})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data

  def get(self, path):
    conn = http.client.HTTPConnection('127.0.0.1', self.port, timeout=HANG_GUARD_S)
    conn.request('GET', path)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data)

  def raw(self, data: bytes) -> bytes:
    """Sends bytes on a fresh connection; returns all it gets back until the server closes."""
    with socket.create_connection(('127.0.0.1', self.port), timeout=HANG_GUARD_S) as s:
      s.sendall(data)
      return _read_all(s)

  def wait_idle(self):
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and (self.engine.has_work or self.server.loop.stats[
        'running'] or self.server.loop.stats['queued']):
      time.sleep(0.02)
    assert not self.engine.has_work

  def close(self):
    self.server.shutdown()


def _read_all(s) -> bytes:
  out = b''
  while chunk := s.recv(65536):
    out += chunk
  return out


def _json_body(raw: bytes) -> tuple[int, dict]:
  head, _, body = raw.partition(b'\r\n\r\n')
  return int(head.split()[1]), json.loads(body)


@pytest.fixture()
def served(engine):
  s = Served(engine)
  yield s
  s.close()


def _prompts(seed, n):
  rng = np.random.default_rng(seed)
  system = rng.integers(0, 97, 13).tolist()
  return [system + rng.integers(0, 97, int(rng.integers(1, 6))).tolist() for _ in range(n)]


# ---- parsing ----------------------------------------------------------------------------------


def test_parse_generate_names_the_bad_field(tmp_path):
  work = parse_generate(b'{"prompt": [1, 2], "n": 2, "temperature": 0.5}', None, LIMITS)
  assert (work.prompts, work.params.n, work.params.temperature, work.stream) == (
      ((1, 2),), 2, 0.5, False)
  bad = {
      b'not json': 'body', b'[1]': 'body', b'{}': 'prompt', b'[' * 100_000: 'body',
      b'\xff\xfe{': 'body', b'{"prompt": [1], "text": "a"}': 'prompt', b'{"text": "hi"}': 'text',
      b'{"prompt": []}': 'prompt', b'{"prompt": [1.5]}': 'prompt', b'{"prompt": [[1]]}': 'prompt',
      b'{"prompt": [true]}': 'prompt', b'{"prompt": [9223372036854775808]}': 'prompt',
      b'{"prompt": [-1]}': 'prompt', b'{"prompt": [97]}': 'prompt',
      b'{"prompt": [1], "max_new_tokens": 0}': 'max_new_tokens',
      b'{"prompt": [1], "max_new_tokens": 2.5}': 'max_new_tokens',
      b'{"prompt": [1], "max_new_tokens": 48}': 'max_new_tokens',
      b'{"prompt": [1], "n": true}': 'n', b'{"prompt": [1], "n": 2.0}': 'n',
      b'{"prompt": [1], "n": 5}': 'n', b'{"prompt": [1], "temperature": -1}': 'temperature',
      b'{"prompt": [1], "temperature": NaN}': 'temperature',
      b'{"prompt": [1], "temperature": Infinity}': 'temperature',
      b'{"prompt": [1], "temperature": 1e400}': 'temperature',
      b'{"prompt": [1], "temperature": "0.5"}': 'temperature',
      b'{"prompt": [1], "stream": 1}': 'stream', b'{"prompt": [1], "foo": 5}': 'foo',
      b'{"prompt": [1], "stop_tokens": 3}': 'stop_tokens',
      b'{"prompt": [1], "stop_tokens": [1.5]}': 'stop_tokens',
      b'{"prompt": [1], "stop_tokens": ["a"]}': 'stop_tokens',
      b'{"prompt": [1], "stop_tokens": [1e3]}': 'stop_tokens',
      b'{"prompt": [1], "top_p": 0}': 'top_p', b'{"prompt": [1], "seed": 0.5}': 'seed',
  }
  for body, field in bad.items():
    with pytest.raises(BadRequest) as info:
      parse_generate(body, None, LIMITS)
    assert info.value.field == field and info.value.status == 400, (body[:40], info.value)
    assert f'"{field}"' in str(info.value) or field == 'body', str(info.value)
  tok = char_tokenizer(tmp_path)
  assert parse_generate(b'{"text": "hi"}', tok, LIMITS).prompts == ((1, 75, 76),)
  with pytest.raises(BadRequest, match='surrogate') as info:
    parse_generate(b'{"text": "a\\ud800"}', tok, LIMITS)
  assert info.value.field == 'text'
  # The tokenizer's EOS ids are stop tokens.
  assert parse_generate(b'{"text": "hi"}', tok, LIMITS).params.stop_tokens == (2,)


def test_parse_completion_maps_openai_fields(tmp_path):
  tok = char_tokenizer(tmp_path)
  work = parse_completion(json.dumps({
      'model': 'm', 'prompt': ['ab', [5, 6]], 'max_tokens': 7, 'n': 2, 'temperature': 0,
      'stop': ['\n', 'xy'], 'stream': True, 'stream_options': {'include_usage': True},
      'user': 'u', 'echo': False, 'presence_penalty': 0, 'best_of': 2, 'suffix': None,
  }).encode(), tok, LIMITS)
  assert work.prompts == ((1, 68, 69), (5, 6))
  assert (work.params.max_new_tokens, work.params.n, work.params.temperature) == (7, 2, 0.0)
  assert work.stop_texts == ('\n', 'xy') and work.stream and work.include_usage
  assert work.params.stop_tokens == (2,) and work.model == 'm'
  assert parse_completion(b'{"prompt": [3, 4]}', None, LIMITS).params.temperature == 1.0  # OpenAI
  assert parse_completion(b'{"prompt": [3], "stop": [7, 8]}', None, LIMITS).stop_ids == ((7, 8),)
  assert parse_completion(b'{"prompt": [3], "stop": [[7], [8, 9]]}', None,
                          LIMITS).stop_ids == ((7,), (8, 9))
  bad = {
      b'{}': 'prompt', b'{"prompt": "hi"}': 'prompt', b'{"prompt": []}': 'prompt',
      b'{"prompt": [[]]}': 'prompt', b'{"prompt": [1], "stop": "x"}': 'stop',
      b'{"prompt": [1], "stop": [[1.5]]}': 'stop', b'{"prompt": [1], "echo": true}': 'echo',
      b'{"prompt": [1], "best_of": 3}': 'best_of', b'{"prompt": [1], "logprobs": 6}': 'logprobs',
      b'{"prompt": [1], "max_tokens": 100}': 'max_tokens', b'{"prompt": [1], "n": 0}': 'n',
      b'{"prompt": [1], "stream_options": {"include_usage": true}}': 'stream_options',
      b'{"prompt": [1], "temperature": -Infinity}': 'temperature',
      b'{"prompt": [1], "logit_bias": {"1": 5}}': 'logit_bias', b'{"prompt": [1], "x": 1}': 'x',
      b'{"prompt": [1], "seed": "1"}': 'seed', b'{"prompt": [1], "model": 3}': 'model',
      b'{"prompt": [[1]] }'.replace(b'[[1]]', json.dumps([[1]] * 65).encode()): 'prompt',
  }
  for body, field in bad.items():
    with pytest.raises(BadRequest) as info:
      parse_completion(body, None, LIMITS)
    assert info.value.field == field, (body[:40], info.value)
  with pytest.raises(BadRequest) as info:
    parse_completion(b'{"prompt": "x", "stop": "\\udc00"}', tok, LIMITS)
  assert info.value.field == 'stop'


# ---- /v1/generate -----------------------------------------------------------------------------


def test_concurrent_requests_equal_the_engine_alone(reference, served):
  prompts = _prompts(0, 5)
  expected = reference.generate(prompts, SamplingParams(max_new_tokens=5))
  results = [None] * len(prompts)

  def client(i):
    results[i] = served.post('/v1/generate', {'prompt': prompts[i], 'max_new_tokens': 5})

  threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for (status, data), want in zip(results, expected):
    assert status == 200, data
    reply = json.loads(data)
    assert reply['outputs'] == [want] and reply['finish_reasons'] == ['length']
  assert max(json.loads(d)['shared_tokens'] for _, d in results) > 0  # the system prompt
  served.wait_idle()
  assert_no_leak(served.engine)


def test_streaming_samples_and_health(reference, served):
  prompt = _prompts(1, 1)[0]
  params = SamplingParams(max_new_tokens=4, n=2)
  before = served.server.loop.finished_requests
  conn = http.client.HTTPConnection('127.0.0.1', served.port, timeout=HANG_GUARD_S)
  conn.request('POST', '/v1/generate', body=json.dumps(
      {'prompt': prompt, 'max_new_tokens': 4, 'n': 2, 'stream': True}))
  resp = conn.getresponse()
  assert resp.status == 200 and resp.getheader('Content-Type') == 'application/x-ndjson'
  assert resp.getheader('Transfer-Encoding') == 'chunked'
  lines = [json.loads(line) for line in resp.read().splitlines()]
  conn.close()
  streamed = [[e['token'] for e in lines if e['sample'] == i] for i in range(2)]
  assert all(e['index'] == k for i in range(2)
             for k, e in enumerate(e for e in lines if e['sample'] == i))
  assert [e['reason'] for e in lines if e['finished']] == ['length', 'length']
  assert streamed == reference.generate([prompt], params)
  served.wait_idle()
  status, health = served.get('/v1/health')
  assert status == 200 and health['status'] == 'ok'
  assert (health['running'], health['queued'], health['finished_requests']) == (0, 0, before + 2)
  assert not served.engine.requests  # finished requests are forgotten (a server runs for days)
  assert_no_leak(served.engine)


def test_bad_requests_get_json_errors_naming_the_field(served):
  cases = [
      ({'prompt': 'hello'}, 400, 'prompt'), ({'prompt': [1, 2, 100000]}, 400, 'prompt'),
      ({'prompt': [2**63]}, 400, 'prompt'), ({'prompt': [1] * 40, 'max_new_tokens': 40}, 400,
                                             'max_new_tokens'),
      ({'prompt': [1], 'stop_tokens': [1, 'a']}, 400, 'stop_tokens'),
  ]
  for payload, status, field in cases:
    got, data = served.post('/v1/generate', payload)
    assert (got, json.loads(data)['field']) == (status, field), data
  raw = {b'{"prompt": [1], "temperature": NaN}': 'temperature', b'[' * 50_000: 'body',
         b'{"text": "\\ud800"}': 'text', b'\xff': 'body'}
  for body, field in raw.items():
    got, data = served.post('/v1/generate', raw=body)
    assert (got, json.loads(data)['field']) == (400, field), data
  status, body = served.get('/v1/nothing')
  assert status == 404 and body['field'] == 'path'
  head = b'POST /v1/generate HTTP/1.1\r\nHost: x\r\n'
  for header in (b'Content-Length: abc', b'Content-Length: -5', b'Content-Length: 1, 2'):
    status, body = _json_body(served.raw(head + header + b'\r\n\r\n'))
    assert status == 400 and body['field'] == 'Content-Length', body
  assert not served.engine.requests  # refused before reaching the engine
  status, health = served.get('/v1/health')
  assert status == 200 and health['status'] == 'ok'


def test_transport_chunked_body_limits_and_connection_cap(engine):
  # Deadlines far beyond any stall of a loaded machine: nothing here may time out (with 0.5 s,
  # an idle connection could be closed before the 4th opens, which then fits under the cap).
  s = Served(engine, config=ServerConfig(
      max_body_bytes=200, body_timeout_s=60, header_timeout_s=60, max_connections=3))
  try:
    body = json.dumps({'prompt': [3, 4, 5], 'max_new_tokens': 2}).encode()
    chunks = b''.join(b'%x\r\n%s\r\n' % (len(body[i:i + 7]), body[i:i + 7])
                      for i in range(0, len(body), 7))
    raw = s.raw(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n'
                b'Connection: close\r\n\r\n' + chunks + b'0\r\n\r\n')
    status, reply = _json_body(raw)
    assert status == 200 and reply['finish_reasons'] == ['length'], reply
    assert s.post('/v1/generate', raw=b' ' * 201)[0] == 413
    raw = s.raw(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n'
                + (b'64\r\n' + b' ' * 100 + b'\r\n') * 3 + b'0\r\n\r\n')
    assert _json_body(raw)[0] == 413
    # A connection cap: past it, 503 naming the connection, at once.
    idle = [socket.create_connection(('127.0.0.1', s.port)) for _ in range(3)]
    try:
      status, reply = _json_body(s.raw(b'GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n'))
      assert status == 503 and reply['field'] == 'connection'
    finally:
      for c in idle:
        c.close()
    assert s.get('/v1/health')[0] == 200  # under the cap again
  finally:
    s.close()


def test_transport_timeouts(engine):
  # Short deadlines that these requests are meant to pass: a stall only makes them pass sooner.
  s = Served(engine, config=ServerConfig(body_timeout_s=0.5, header_timeout_s=0.5))
  try:
    # A body shorter than its Content-Length: 408 once the body deadline passes.
    status, reply = _json_body(s.raw(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\n'
                                     b'Content-Length: 100\r\n\r\n{"prompt"'))
    assert status == 408 and reply['field'] == 'body'
    # Headers that never end: 408, and the connection is closed.
    status, reply = _json_body(s.raw(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\n'))
    assert status == 408 and reply['field'] == 'headers'
  finally:
    s.close()


def test_fifty_parallel_clients_are_all_answered(served):
  results = []

  def client(i):  # a listen backlog of 5 reset 15-20 of them
    results.append(served.post('/v1/generate', {'prompt': [i % 97, 5], 'max_new_tokens': 1})[0])

  threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == [200] * 50



# ---- disconnects ------------------------------------------------------------------------------


@contextlib.contextmanager
def _hold_steps_until_cancel(server, free_steps: int):
  """The engine runs `free_steps` iterations, then none until the server asks for a cancel.

  Makes disconnect tests independent of speed: the request cannot finish first.
  """
  loop = server.loop
  engine = loop.engine
  cancelled = threading.Event()
  cancel = loop.cancel
  count = [0]

  def gated_step():
    count[0] += 1
    if count[0] > free_steps:
      assert cancelled.wait(HANG_GUARD_S)
    return type(engine).step(engine)

  def recording_cancel(*args, **kwargs):
    cancel(*args, **kwargs)
    cancelled.set()

  engine.step = gated_step
  loop.cancel = recording_cancel
  try:
    yield
  finally:
    del engine.step

@pytest.mark.parametrize('when', ['streaming_after_first_token', 'streaming_before_first_token',
                                  'not_streaming'])
def test_a_client_that_leaves_cancels_its_request(long_engine, when):
  s = Served(long_engine)
  try:
    with _hold_steps_until_cancel(s.server, 1 if when == 'streaming_after_first_token' else 0):
      conn = http.client.HTTPConnection('127.0.0.1', s.port, timeout=HANG_GUARD_S)
      conn.request('POST', '/v1/generate', body=json.dumps({
          'prompt': _prompts(2, 1)[0], 'max_new_tokens': 200, 'stream': when != 'not_streaming'}))
      if when == 'streaming_after_first_token':
        resp = conn.getresponse()
        assert json.loads(resp.readline())['index'] == 0
      conn.sock.shutdown(socket.SHUT_RDWR)
      conn.close()
      deadline = time.monotonic() + HANG_GUARD_S
      while time.monotonic() < deadline and not s.server.loop.recent:
        time.sleep(0.02)
    (req,) = s.server.loop.recent
    assert req.state == 'cancelled' and len(req.output) < 5
    s.wait_idle()
    assert_no_leak(s.engine)
  finally:
    s.close()


# ---- the engine thread ------------------------------------------------------------------------


def test_the_engine_thread_survives_requests_and_says_when_it_stops(engine):
  s = Served(engine)
  submit = engine.submit
  try:

    def faulty_submit(prompt, params, **kwargs):  # one request that breaks the engine's submit
      if list(prompt) == [6, 6, 6]:
        raise RuntimeError('boom')
      return submit(prompt, params, **kwargs)

    engine.submit = faulty_submit
    status, data = s.post('/v1/generate', {'prompt': [6, 6, 6]})
    assert status == 500 and 'boom' in json.loads(data)['error']
    status, data = s.post('/v1/generate', {'prompt': [7, 7], 'max_new_tokens': 2})
    assert status == 200 and json.loads(data)['finish_reasons'] == ['length']
    # An engine that fails in a step stops the loop: the client hears 503, health says so,
    # and later requests fail at once.
    engine.step = lambda: 1 / 0
    status, data = s.post('/v1/generate', {'prompt': [7, 7], 'max_new_tokens': 2})
    assert status == 503 and 'ZeroDivisionError' in json.loads(data)['error']
    status, health = s.get('/v1/health')
    assert status == 503 and health['status'] == 'error' and 'ZeroDivision' in health['error']
    for path in ('/v1/generate', '/v1/completions'):
      status, data = s.post(path, {'prompt': [7, 7]})
      assert status == 503, data
  finally:
    s.close()
    del engine.submit, engine.step
    engine.run()  # what the broken loop left queued
    assert_no_leak(engine)


def test_a_request_the_engine_fails_gets_a_500_and_the_others_go_on(engine):
  s = Served(engine)
  submit = engine.submit

  def submit_with_a_failing_callback(prompt, params, **kwargs):
    if list(prompt) == [6, 6, 6]:
      kwargs['on_token'] = lambda event: 1 / 0
    return submit(prompt, params, **kwargs)

  engine.submit = submit_with_a_failing_callback
  try:
    status, data = s.post('/v1/generate', {'prompt': [6, 6, 6], 'max_new_tokens': 3})
    assert status == 500 and 'ZeroDivisionError' in json.loads(data)['error'], data
    status, data = s.post('/v1/completions', {'prompt': [6, 6, 6], 'max_tokens': 3,
                                              'stream': True})
    assert status == 200 and b'ZeroDivisionError' in data and data.endswith(b'data: [DONE]\n\n')
    status, data = s.post('/v1/generate', {'prompt': [7, 7], 'max_new_tokens': 2})
    assert status == 200 and s.server.loop.alive
    s.wait_idle()
    assert_no_leak(engine)
  finally:
    del engine.submit
    s.close()


# ---- /v1/completions --------------------------------------------------------------------------


def _sse(data: bytes) -> list:
  events = data.decode().split('\n\n')
  assert events[-1] == '' and events[-2] == 'data: [DONE]', data[-200:]
  assert all(e.startswith('data: ') for e in events[:-1])
  return [json.loads(e[len('data: '):]) for e in events[:-2]]


def test_completions_raw_http_equal_the_engine(reference, served):
  prompts = _prompts(3, 2)
  expected = reference.generate(prompts, SamplingParams(max_new_tokens=6, n=2))
  status, data = served.post('/v1/completions', {
      'model': 'tiny', 'prompt': prompts, 'max_tokens': 6, 'n': 2, 'temperature': 0})
  assert status == 200, data
  reply = json.loads(data)
  assert reply['object'] == 'text_completion' and reply['id'].startswith('cmpl-')
  assert reply['model'] == 'tiny'
  assert [c['index'] for c in reply['choices']] == [0, 1, 2, 3]
  assert [c['token_ids'] for c in reply['choices']] == expected
  assert [c['finish_reason'] for c in reply['choices']] == ['length'] * 4
  assert reply['usage'] == {'prompt_tokens': sum(map(len, prompts)), 'completion_tokens': 24,
                            'total_tokens': sum(map(len, prompts)) + 24}
  # A stop sequence of token ids is cut from the output, and the sample stops there.
  stop = expected[0][2:4]
  status, data = served.post('/v1/completions', {'prompt': prompts[0], 'max_tokens': 6,
                                                  'temperature': 0, 'stop': [stop]})
  (choice,) = json.loads(data)['choices']
  assert choice['token_ids'] == expected[0][:2] and choice['finish_reason'] == 'stop'
  # Streamed: the same tokens, SSE chunks, one choice each, usage at the end when asked.
  status, data = served.post('/v1/completions', {
      'prompt': prompts, 'max_tokens': 6, 'n': 2, 'temperature': 0, 'stream': True,
      'stream_options': {'include_usage': True}})
  chunks = _sse(data)
  assert chunks[-1]['usage']['completion_tokens'] == 24 and chunks[-1]['choices'] == []
  got = [[t for c in chunks[:-1] for ch in c['choices'] if ch['index'] == k
          for t in ch['token_ids']] for k in range(4)]
  assert got == expected
  reasons = [ch['finish_reason'] for c in chunks for ch in c['choices'] if ch['finish_reason']]
  assert reasons == ['length'] * 4
  status, data = served.post('/v1/completions', {'prompt': [1], 'temperature': float('nan')})
  error = json.loads(data)['error']
  assert status == 400 and error['param'] == 'temperature' and 'temperature' in error['message']
  served.wait_idle()
  assert_no_leak(served.engine)


def test_completions_with_the_openai_client_and_text(engine, reference, tmp_path):
  openai = pytest.importorskip('openai')
  tok = char_tokenizer(tmp_path)
  s = Served(engine, tokenizer=tok, model_name='tiny')
  try:
    client = openai.OpenAI(base_url=f'http://127.0.0.1:{s.port}/v1', api_key='unused',
                           max_retries=0, timeout=HANG_GUARD_S)
    assert [m.id for m in client.models.list()] == ['tiny']
    prompt = 'shared prefix, then'
    ids = tok.encode(prompt)
    want = reference.generate([ids], SamplingParams(max_new_tokens=8,
                                                    stop_tokens=tok.eos_ids))[0]
    reply = client.completions.create(model='tiny', prompt=prompt, max_tokens=8, temperature=0)
    (choice,) = reply.choices
    assert choice.model_extra['token_ids'] == want
    assert choice.text == tok.decode(want)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(want)
    # Streamed text equals the whole text; a stop string cuts it, and is not in it.
    stream = client.completions.create(model='tiny', prompt=prompt, max_tokens=8, temperature=0,
                                       stream=True)
    assert ''.join(c.choices[0].text for c in stream) == choice.text
    text = choice.text
    cut = next((i for i in range(1, len(text)) if text[i] not in text[:i]), None)
    if cut is not None:  # a character that first appears at `cut`
      for streamed in (False, True):
        got = client.completions.create(model='tiny', prompt=prompt, max_tokens=8, temperature=0,
                                        stop=[text[cut]], stream=streamed)
        got_text = ''.join(c.choices[0].text for c in got) if streamed else got.choices[0].text
        assert got_text == text[:cut]
    with pytest.raises(openai.BadRequestError, match='temperature'):
      client.completions.create(model='tiny', prompt=prompt, temperature=-1)
    s.wait_idle()
    assert_no_leak(s.engine)
  finally:
    s.close()


def test_completions_map_seed_top_p_and_logprobs_onto_the_engine(reference, served):
  prompt = [5, 6, 7]
  rid = reference.submit(prompt, SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.9,
                                                seed=11, logprobs=True, top_logprobs=2))
  reference.run()
  want = reference.requests[rid]
  payload = {'prompt': prompt, 'max_tokens': 4, 'temperature': 0.9, 'top_p': 0.9, 'seed': 11,
             'logprobs': 2}
  first = json.loads(served.post('/v1/completions', payload)[1])['choices'][0]
  assert first['token_ids'] == want.output  # the request's seed: any engine, any batch
  lp = first['logprobs']
  np.testing.assert_allclose(lp['token_logprobs'], want.logprobs, rtol=1e-5, atol=1e-5)
  assert all(len(t) == 2 for t in lp['top_logprobs'])
  assert lp['tokens'] == [f'token_id:{t}' for t in first['token_ids']]
  chunks = _sse(served.post('/v1/completions', {**payload, 'stream': True})[1])
  streamed = [x for c in chunks for x in c['choices'][0]['logprobs']['token_logprobs']]
  assert [t for c in chunks for t in c['choices'][0]['token_ids']] == want.output
  np.testing.assert_allclose(streamed, want.logprobs, rtol=1e-5, atol=1e-5)
  status, data = served.post('/v1/generate', {'prompt': prompt, 'max_new_tokens': 4,
                                              'temperature': 0.9, 'top_p': 0.9, 'seed': 11,
                                              'logprobs': True})
  reply = json.loads(data)
  assert reply['outputs'] == [want.output]
  np.testing.assert_allclose(reply['logprobs'][0], want.logprobs, rtol=1e-5, atol=1e-5)


def test_a_client_that_connects_before_serving_waits(engine):
  """The socket listens from construction: the command line announces the address before
  uvicorn runs, and a client that connects in between is queued, not refused (CI once saw
  `Connection refused` there)."""
  server = make_server(engine, port=0)  # not serving yet
  try:
    with socket.create_connection(('127.0.0.1', server.port), timeout=HANG_GUARD_S) as s:
      server.start()
      s.sendall(b'GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
      assert _json_body(_read_all(s))[0] == 200
  finally:
    server.shutdown()


@pytest.mark.parametrize('mesh', ['tp:2', 'dp:2'])
def test_command_line_server_on_a_mesh_answers_as_one_device(tmp_path, mesh):
  """`python -m models.server --mesh=...` (2 fake CPU devices): the same greedy tokens as one
  device's engine; dp with --overlap_decode is refused before any work."""
  import os
  import subprocess
  import sys

  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2', JAX_PLATFORMS='cpu',
             PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  args = [sys.executable, '-m', 'models.server', '--model=tiny_gqa', '--num_chunks=32',
          '--chunk_size=16', '--max_batch=4', '--max_sequence_length=128', '--nowarmup',
          '--compilation_cache=']
  if mesh.startswith('dp'):
    refused = subprocess.run(args + [f'--mesh={mesh}', '--overlap_decode'], env=env,
                             capture_output=True, text=True, timeout=HANG_GUARD_S * 4)
    assert refused.returncode != 0 and 'overlap_decode' in refused.stderr + refused.stdout
  log = open(tmp_path / 'server.log', 'w+')
  proc = subprocess.Popen(args + [f'--mesh={mesh}', '--port=0'], env=env, stdout=log,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 240  # bounded: import, init, first compile on a loaded machine
    while not (found := re.search(r'serving .* on http://127\.0\.0\.1:(\d+)',
                                  (tmp_path / 'server.log').read_text())):
      assert proc.poll() is None, (tmp_path / 'server.log').read_text()[-3000:]
      assert time.monotonic() < deadline, 'server did not start'
      time.sleep(0.5)
    port = int(found.group(1))  # the port the server bound (--port=0: no race for a free one)
    conn = http.client.HTTPConnection('127.0.0.1', port, timeout=240)
    prompt = _prompts(0, 1)[0]
    conn.request('POST', '/v1/generate', body=json.dumps({'prompt': prompt, 'max_new_tokens': 6}),
                 headers={'Content-Type': 'application/json'})
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, reply
  finally:
    proc.terminate()
    proc.wait(timeout=60)
  model = Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0), dtype=np.float32)
  one = Engine(model, EngineConfig(num_chunks=32, chunk_size=16, max_batch=4,
                                   max_sequence_length=128))
  assert reply['outputs'] == one.generate([prompt], SamplingParams(max_new_tokens=6))


def test_chat_completions_under_the_chat_template(long_engine, tmp_path):
  openai = pytest.importorskip('openai')
  chars = char_tokenizer(tmp_path)
  tok = Tokenizer(chars.tokenizer, bos_id=chars.bos_id, eos_ids=chars.eos_ids,
                  chat_template=SMOLLM2_TEMPLATE)
  s = Served(long_engine, tokenizer=tok)
  try:
    client = openai.OpenAI(base_url=f'http://127.0.0.1:{s.port}/v1', api_key='unused',
                           max_retries=0, timeout=HANG_GUARD_S)
    messages = [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'}]
    ids = tok.encode(tok.apply_chat_template(messages), add_bos=False)
    want = s.post('/v1/completions', {'prompt': ids, 'max_tokens': 6, 'temperature': 0})
    want = json.loads(want[1])['choices'][0]['text']
    reply = client.chat.completions.create(model='tiny', messages=messages, max_tokens=6,
                                           temperature=0)
    assert reply.object == 'chat.completion' and reply.model == 'tiny'
    assert reply.choices[0].message.role == 'assistant'
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model='tiny', messages=messages, max_tokens=6,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert ''.join(c.choices[0].delta.content or '' for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == 'length'
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model='tiny', messages=[{'role': 'robot', 'content': 'x'}])
    assert e.value.body['param'] == 'messages'
  finally:
    s.close()

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_command_line_server_on_a_mesh_answers_as_one_device': ('tp:2',),
}
