"""The HTTP server over the engine: outputs equal the engine's, streaming, bad input, disconnects."""

import dataclasses
import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest
from flax import nnx

from models.config import get_config
from models.engine import Engine, SamplingParams
from models.llama import Llama
from models.server import BadRequest, make_server, parse_request
from tests.test_engine import CONFIG, assert_no_leak


@pytest.fixture(scope='module')
def model():
  return Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0))


@pytest.fixture()
def served(model):
  engine = Engine(model, CONFIG)
  server, loop = make_server(engine, port=0)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield engine, server.server_address[1], loop
  server.shutdown()
  loop.stop()


def _post(port, payload, *, raw=None):
  conn = http.client.HTTPConnection('127.0.0.1', port, timeout=120)
  body = raw if raw is not None else json.dumps(payload).encode()
  conn.request('POST', '/v1/generate', body=body, headers={'Content-Type': 'application/json'})
  resp = conn.getresponse()
  data = resp.read()
  conn.close()
  return resp.status, data


def _prompts(seed, n):
  rng = np.random.default_rng(seed)
  system = rng.integers(0, 97, 13).tolist()
  return [system + rng.integers(0, 97, int(rng.integers(1, 6))).tolist() for _ in range(n)]


def test_parse_request_names_the_bad_field():
  prompt, params, stream = parse_request(b'{"prompt": [1, 2], "n": 2, "temperature": 0.5}', None)
  assert (prompt, params.n, params.temperature, stream) == ([1, 2], 2, 0.5, False)
  bad = {
      b'not json': 'JSON', b'[1]': 'JSON object', b'{}': 'exactly one',
      b'{"prompt": [1], "text": "a"}': 'exactly one', b'{"text": "hi"}': 'tokenizer',
      b'{"prompt": []}': '"prompt"', b'{"prompt": [1.5]}': '"prompt"',
      b'{"prompt": [1], "max_new_tokens": 0}': '"max_new_tokens"',
      b'{"prompt": [1], "n": true}': '"n"', b'{"prompt": [1], "temperature": -1}': '"temperature"',
      b'{"prompt": [1], "stream": 1}': '"stream"', b'{"prompt": [1], "top_k": 5}': 'unknown',
      b'{"prompt": [1], "stop_tokens": 3}': '"stop_tokens"',
  }
  for body, words in bad.items():
    with pytest.raises(BadRequest, match=words):
      parse_request(body, None)


def test_concurrent_requests_equal_the_engine_alone(model, served):
  engine, port, _ = served
  prompts = _prompts(0, 5)
  expected = Engine(model, CONFIG).generate(prompts, SamplingParams(max_new_tokens=5))
  results = [None] * len(prompts)

  def client(i):
    results[i] = _post(port, {'prompt': prompts[i], 'max_new_tokens': 5})

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


def test_streaming_samples_and_health(model, served):
  engine, port, _ = served
  prompt = _prompts(1, 1)[0]
  params = SamplingParams(max_new_tokens=4, temperature=0.7, n=2)
  conn = http.client.HTTPConnection('127.0.0.1', port, timeout=120)
  conn.request('POST', '/v1/generate', body=json.dumps(
      {'prompt': prompt, 'max_new_tokens': 4, 'temperature': 0.7, 'n': 2, 'stream': True}))
  resp = conn.getresponse()
  assert resp.status == 200 and resp.getheader('Content-Type') == 'application/x-ndjson'
  lines = [json.loads(line) for line in resp.read().splitlines()]
  conn.close()
  streamed = [[e['token'] for e in lines if e['sample'] == i] for i in range(2)]
  assert all(e['index'] == k for i in range(2)
             for k, e in enumerate(e for e in lines if e['sample'] == i))
  assert [e['reason'] for e in lines if e['finished']] == ['length', 'length']
  # Samples draw with keys of (seed, request id, index): the same request ids, the same tokens.
  alone = Engine(model, CONFIG)
  assert streamed == alone.generate([prompt], params)
  conn = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
  conn.request('GET', '/v1/health')
  health = json.loads(conn.getresponse().read())
  assert health['running'] == 0 and health['queued'] == 0
  assert_no_leak(engine)


def test_bad_requests_get_400_and_the_engine_never_sees_them(served):
  engine, port, _ = served
  status, data = _post(port, None, raw=b'{"prompt": "hello"}')
  assert status == 400 and '"prompt"' in json.loads(data)['error']
  status, data = _post(port, {'prompt': [1, 2, 100000]})  # out of the vocabulary
  assert status == 400 and 'token ids' in json.loads(data)['error']
  status, data = _post(port, {'prompt': [1] * 40, 'max_new_tokens': 40})  # longer than allowed
  assert status == 400 and 'max_sequence_length' in json.loads(data)['error']
  conn = http.client.HTTPConnection('127.0.0.1', port, timeout=30)
  conn.request('GET', '/v1/nothing')
  assert conn.getresponse().status == 404
  assert not engine.requests  # refused before reaching the engine, or at its door


def test_a_client_that_disconnects_cancels_its_request(model):
  config = dataclasses.replace(CONFIG, num_chunks=64, max_sequence_length=240)
  engine = Engine(model, config)
  server, loop = make_server(engine, port=0)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    conn = http.client.HTTPConnection('127.0.0.1', server.server_address[1], timeout=120)
    conn.request('POST', '/v1/generate', body=json.dumps(
        {'prompt': _prompts(2, 1)[0], 'max_new_tokens': 200, 'stream': True}))
    resp = conn.getresponse()
    assert json.loads(resp.readline())['index'] == 0
    conn.sock.shutdown(socket.SHUT_RDWR)  # gone after the first token
    conn.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (engine.has_work or not engine.requests):
      time.sleep(0.05)
    (req,) = engine.requests.values()
    assert req.state == 'cancelled' and len(req.output) < 200
    assert_no_leak(engine)
  finally:
    server.shutdown()
    loop.stop()
