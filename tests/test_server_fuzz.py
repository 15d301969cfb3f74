"""Fuzz of the server's request parsing, and of the engine through the server (hypothesis, fixed
seeds): every request gets exactly one well-formed answer (or, when its client leaves, none),
the engine thread stays alive, and no chunk leaks. Traffic goes to 127.0.0.1 only."""

import collections
import http.client
import io
import json
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip('uvicorn', reason='the server needs the serve extra: pip install .[serve]')

from models.engine import Engine
from models.server import ServerConfig
from models.server_api import (
    BadRequest, Work, parse_completion, parse_generate,
)
from tests.test_engine import assert_no_leak
from tests.test_server import (
    CONFIG, HANG_GUARD_S, LIMITS, Served, char_tokenizer, model,  # noqa: F401 (fixture)
)

VOCAB = LIMITS.vocab_size

# ---- strategies -------------------------------------------------------------------------------

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([2**63, -1, 0, 97]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(['\ud800', 'a\udfff', '', 'hello']))
junk = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.text(max_size=5), c, max_size=3), max_leaves=8)
_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)

_generate = st.fixed_dictionaries({'prompt': _ids, 'stream': st.booleans()}, optional={
    'max_new_tokens': st.integers(1, 5), 'temperature': st.sampled_from([0, 0.0, 0.8, 2]),
    'n': st.sampled_from([1, 2]), 'stop_tokens': st.lists(st.integers(0, VOCAB - 1), max_size=3)})
_completion = st.fixed_dictionaries({'prompt': st.one_of(_ids, st.lists(_ids, min_size=1,
                                                                        max_size=2)),
                                   'stream': st.booleans()}, optional={
    'model': st.just('tiny'), 'max_tokens': st.integers(1, 5),
    'temperature': st.sampled_from([0, 0.5, 1.0]), 'n': st.sampled_from([1, 2]),
    'top_p': st.sampled_from([0.5, 1.0]),
    'stop': st.one_of(st.text(min_size=1, max_size=2), st.lists(st.integers(0, VOCAB - 1),
                                                               min_size=1, max_size=2)),
    'seed': st.integers(0, 2**40), 'user': st.text(max_size=4)})
# Half the bodies keep their valid fields; the others get 1-2 replaced by junk (or junk added).
_mutations = st.one_of(st.just([]), st.lists(st.tuples(st.sampled_from([
    'prompt', 'text', 'max_new_tokens', 'max_tokens', 'temperature', 'n', 'stop_tokens', 'stop',
    'stream', 'top_p', 'seed', 'logprobs', 'stream_options', 'bogus']), junk), min_size=1,
    max_size=2))


@st.composite
def bodies(draw, valid):
  body = dict(draw(valid))
  for name, value in draw(_mutations):
    body[name] = value
  return json.dumps(body).encode()  # NaN/Infinity as JSON's non-standard literals


_raw_bodies = st.one_of(st.binary(max_size=40), st.sampled_from([
    b'', b'[' * 20_000, b'{"prompt": [1], "temperature": NaN}', b'{"prompt": [1e999]}',
    b'\xef\xbb\xbf{"prompt": [1]}', b'{"prompt": [1], "prompt": "x"}']))


@st.composite
def requests(draw):
  """(raw HTTP request bytes, path, what the client does: 'stay' or 'leave')."""
  path = draw(st.sampled_from(['/v1/generate'] * 4 + ['/v1/completions'] * 4 + ['/v1/bogus']))
  kind = draw(st.sampled_from(['json'] * 6 + ['raw']))
  if kind == 'raw':
    body = draw(_raw_bodies)
  else:
    body = draw(bodies(_completion if path == '/v1/completions' else _generate))
  framing = draw(st.sampled_from(['length'] * 4 + ['chunked'] * 2 + ['bad_length', 'get']))
  head = [f'POST {path} HTTP/1.1', 'Host: 127.0.0.1', 'Connection: close']
  if framing == 'get':
    head[0] = f'GET {path} HTTP/1.1'
    body = b''
  elif framing == 'chunked':
    head.append('Transfer-Encoding: chunked')
    step = draw(st.integers(1, 16))
    body = b''.join(b'%x\r\n%s\r\n' % (len(body[i:i + step]), body[i:i + step])
                    for i in range(0, len(body), step)) + b'0\r\n\r\n'
  elif framing == 'bad_length':
    head.append('Content-Length: ' + draw(st.sampled_from(['abc', '-1', '1 2', '0x10', ''])))
  else:
    head.append(f'Content-Length: {len(body)}')
  raw = ('\r\n'.join(head) + '\r\n\r\n').encode() + body
  return raw, path, draw(st.sampled_from(['stay', 'stay', 'stay', 'leave']))


# ---- checks -----------------------------------------------------------------------------------


class _Bytes:
  def __init__(self, data):
    self.data = data

  def makefile(self, *args, **kwargs):
    return io.BytesIO(self.data)


def one_response(raw: bytes, method: str) -> tuple[int, str, bytes]:
  """(status, content type, decoded body) of the only HTTP response in `raw`."""
  resp = http.client.HTTPResponse(_Bytes(raw), method=method)
  resp.begin()
  body = resp.read()
  assert resp.fp is None or resp.fp.read() == b'', 'bytes after the response'
  return resp.status, resp.getheader('content-type', ''), body


def check_error(status, body, path):
  payload = json.loads(body)
  error = payload['error']
  if isinstance(error, dict):  # OpenAI's shape
    assert path == '/v1/completions' and error['param'] and error['message'], payload
  else:
    assert isinstance(error, str) and isinstance(payload['field'], str) and payload['field']
  assert status in (400, 404, 405, 408, 413), payload  # never 5xx: the engine is fine


def check_generate(ctype, body):
  if ctype == 'application/json':
    reply = json.loads(body)
    assert len(reply['outputs']) == len(reply['finish_reasons'])
    assert all(0 <= t < VOCAB for o in reply['outputs'] for t in o)
    assert set(reply['finish_reasons']) <= {'stop', 'length'}
    return
  assert ctype == 'application/x-ndjson'
  lines = [json.loads(line) for line in body.splitlines()]
  samples = {e['sample'] for e in lines}
  for i in samples:
    mine = [e for e in lines if e['sample'] == i]
    assert [e['index'] for e in mine] == list(range(len(mine)))
    assert [e['finished'] for e in mine] == [False] * (len(mine) - 1) + [True]


def check_completion(ctype, body):
  if ctype == 'application/json':
    reply = json.loads(body)
    assert reply['object'] == 'text_completion'
    assert [c['index'] for c in reply['choices']] == list(range(len(reply['choices'])))
    assert all(c['finish_reason'] in ('stop', 'length') for c in reply['choices'])
    assert reply['usage']['completion_tokens'] == sum(len(c['token_ids'])
                                                      for c in reply['choices'])
    return
  assert ctype == 'text/event-stream'
  events = body.decode().split('\n\n')
  assert events[-2:] == ['data: [DONE]', '']
  chunks = [json.loads(e.removeprefix('data: ')) for e in events[:-2]]
  finished = [c['index'] for chunk in chunks for c in chunk['choices'] if c['finish_reason']]
  assert sorted(finished) == list(range(len(finished)))  # each choice finishes exactly once


SEEN = collections.Counter()  # answers by status and kind, to check that the fuzz reaches far


def exchange(port, raw, path, action):
  with socket.create_connection(('127.0.0.1', port), timeout=HANG_GUARD_S) as s:
    s.sendall(raw)
    if action == 'leave':
      return
    got = b''
    while chunk := s.recv(65536):
      got += chunk
  method = raw.split(b' ', 1)[0].decode()
  status, ctype, body = one_response(got, method)
  SEEN[status, ctype] += 1
  if status != 200:
    return check_error(status, body, path)
  assert path != '/v1/bogus' and method == 'POST'
  (check_completion if path == '/v1/completions' else check_generate)(ctype, body)


# ---- tests ------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, derandomize=True)
@given(body=st.one_of(bodies(_generate), bodies(_completion), _raw_bodies),
       api=st.sampled_from(['generate', 'completions']), with_tokenizer=st.booleans())
def test_parsing_answers_work_or_a_bad_request_naming_the_field(body, api, with_tokenizer):
  tokenizer = _TOKENIZER if with_tokenizer else None
  parse = parse_generate if api == 'generate' else parse_completion
  try:
    work = parse(body, tokenizer, LIMITS)
  except BadRequest as e:
    assert isinstance(e.field, str) and e.field and 400 <= e.status < 500
    assert e.field in str(e) or e.field == 'body', str(e)
    return
  assert isinstance(work, Work) and work.prompts
  for prompt in work.prompts:
    assert all(type(t) is int and 0 <= t < VOCAB for t in prompt)
    assert len(prompt) + work.params.max_new_tokens <= LIMITS.max_sequence_length
  assert 1 <= work.params.n <= LIMITS.max_batch
  assert all(type(t) is int and 0 <= t < VOCAB for t in work.params.stop_tokens)


_TOKENIZER = None


@pytest.fixture(scope='module', autouse=True)
def _tokenizer(tmp_path_factory):
  global _TOKENIZER
  _TOKENIZER = char_tokenizer(tmp_path_factory.mktemp('tok'))
  yield
  _TOKENIZER = None


def test_every_request_gets_one_well_formed_answer(model):  # noqa: F811
  engine = Engine(model, CONFIG)
  s = Served(engine, tokenizer=_TOKENIZER, config=ServerConfig(body_timeout_s=0.5))
  errors = []

  @settings(max_examples=50, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
  @given(batch=st.lists(requests(), min_size=1, max_size=4))
  def run(batch):
    def client(raw, path, action):
      try:
        exchange(s.port, raw, path, action)
      except BaseException as e:  # reported below, with the request
        errors.append((raw[:300], e))

    threads = [threading.Thread(target=client, args=r) for r in batch]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors, errors
    assert s.server.loop.alive

  try:
    SEEN.clear()
    run()
    # The fuzz reached the engine, streamed both ways, and was refused in many ways.
    assert min(SEEN[200, t] for t in ('application/json', 'application/x-ndjson',
                                      'text/event-stream')) >= 2, SEEN
    assert sum(v for (status, _), v in SEEN.items() if status >= 400) >= 10, SEEN
    s.wait_idle()
    assert s.server.loop.alive and s.get('/v1/health')[0] == 200
    assert not engine.requests and not s.server.loop._jobs  # nothing left behind
    assert_no_leak(engine)
  finally:
    s.close()
