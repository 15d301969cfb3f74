"""The server under greedy and hostile clients: stop strings in linear time, size checks before
work, parsing off the event loop, per-request caps, clients taking turns, per-client
connection caps, API keys, rate limits, the `model` field, lingering closes, half-closed
clients, background warm-up. Traffic goes to 127.0.0.0/8 only (a second client is a second
loopback address); nothing depends on the machine's speed (events are counted or ordered)."""

import dataclasses
import http.client
import json
import random
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip('uvicorn', reason='the server needs the serve extra: pip install .[serve]')

from models.engine import Engine, EngineConfig, SamplingParams
from models.engine.requests import Request
from models.engine.scheduler import Scheduler
from models.server import ServerConfig
from models.server_api import BadRequest, Choice, parse_completion, parse_generate
from models.server_limits import ApiKeys, RateLimiter, exposure_warning
from models.server_text import (
    MAX_STOP_CHARS, MAX_STOP_STRINGS, HoldBack, IncrementalText, StopFinder,
)
from models.engine.stats import EngineStats
from tests.test_engine import assert_no_leak
from tests.test_server import (
    CONFIG, HANG_GUARD_S, LIMITS, Served, _json_body, _prompts, char_tokenizer, engine,  # noqa: F401
    model,
)

OTHER_CLIENT = '127.0.0.2'  # a second loopback address: another client to the server


def _post(port, path, payload, *, source=None, headers=None):
  conn = http.client.HTTPConnection('127.0.0.1', port, timeout=HANG_GUARD_S,
                                    source_address=(source, 0) if source else None)
  try:
    conn.request('POST', path, body=json.dumps(payload).encode(),
                 headers={'Content-Type': 'application/json', **(headers or {})})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), dict(resp.getheaders())
  finally:
    conn.close()


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
  return char_tokenizer(str(tmp_path_factory.mktemp('tok')))


class _CountingTokenizer:
  """A tokenizer that counts the characters it decodes and the ones it encodes."""

  def __init__(self, inner):
    self.inner, self.decoded, self.encoded = inner, 0, 0
    self.eos_ids = inner.eos_ids

  def decode(self, ids, **kwargs):
    text = self.inner.decode(ids, **kwargs)
    self.decoded += len(text)
    return text

  def encode(self, text, **kwargs):
    self.encoded += len(text)
    return self.inner.encode(text, **kwargs)


# ---- stop strings -----------------------------------------------------------------------------


def _naive_stop(text, stops):
  found = [i for i in (text.find(s) for s in stops) if i >= 0]
  return min(found) if found else None


def _naive_hold(text, stops):
  return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_stop_finder_and_hold_back_equal_the_naive_search():
  rng = random.Random(0)
  for case in range(300):
    alphabet = 'ab' if case % 2 else 'abc'
    stops = [''.join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
    finder, hold = StopFinder(stops), HoldBack(stops)
    text = ''
    for _ in range(rng.randint(1, 12)):
      text += ''.join(rng.choices(alphabet, k=rng.randint(0, 3)))
      assert finder.find(text) == _naive_stop(text, stops), (text, stops)
      if _naive_stop(text, stops) is not None:
        break
      assert hold(text) == _naive_hold(text, stops), (text, stops)


def test_following_a_sample_decodes_a_bounded_window_per_token(tokenizer):
  counting = _CountingTokenizer(tokenizer)
  stops = ['x' * (MAX_STOP_CHARS - 1) + 'y'] * MAX_STOP_STRINGS  # never found, always held
  choice = Choice(counting, stop_texts=stops)
  ids = tokenizer.encode('x' * 400, add_bos=False)
  events = [SamplingEvent(0, t, i, i == len(ids) - 1, 'length' if i == len(ids) - 1 else None)
            for i, t in enumerate(ids)]
  sent = ''
  for event in events:
    assert not choice.add(event)
    sent += choice.delta()[0]
    assert len(sent) <= len(choice.text)
  assert sent + choice.delta()[0] == 'x' * 400 and choice.finish_reason == 'length'
  # Decoding recent tokens only: a constant number of characters per token (the whole text
  # each time would be 400 * 401 / 2 = 80,200).
  assert counting.decoded <= 4 * len(ids)


class SamplingEvent:
  """A TokenEvent's fields, for `Choice.add`."""

  def __init__(self, request_id, token, index, finished, reason):
    self.request_id, self.token, self.index = request_id, token, index
    self.finished, self.reason = finished, reason


def test_incremental_text_equals_whole_decoding_with_unfinished_characters(tokenizer):
  text = IncrementalText(tokenizer)
  ids = tokenizer.encode('hello, world {}', add_bos=False)
  for t in ids:
    text.add(t)
  text.flush()
  assert text.text == tokenizer.decode(ids)


def test_stop_limits_are_refused_by_field(tokenizer):
  limits = dataclasses.replace(LIMITS)
  long = {'model': None, 'prompt': 'hi', 'stop': ['x' * (MAX_STOP_CHARS + 1)]}
  many = {'prompt': 'hi', 'stop': ['x'] * (MAX_STOP_STRINGS + 1)}
  for body in (long, many):
    with pytest.raises(BadRequest) as e:
      parse_completion(json.dumps(body).encode(), tokenizer, limits)
    assert e.value.field == 'stop'
  # A flat list of token ids is one stop sequence, whatever its length (up to the id limit).
  work = parse_completion(json.dumps({'prompt': [5, 6], 'stop': list(range(3, 20))}).encode(),
                          tokenizer, limits)
  assert work.stop_ids == (tuple(range(3, 20)),)


# ---- sizes checked before work ----------------------------------------------------------------


def test_sizes_are_checked_before_tokenizing_and_fields_are_named(tokenizer):
  counting = _CountingTokenizer(tokenizer)
  huge = 'a' * (LIMITS.max_text_chars + 1)
  for parse, body, field in (
      (parse_generate, {'text': huge}, 'text'), (parse_completion, {'prompt': huge}, 'prompt'),
      (parse_completion, {'prompt': [huge]}, 'prompt'),
      (parse_generate, {'prompt': [1] * (LIMITS.max_sequence_length + 1)}, 'prompt')):
    with pytest.raises(BadRequest) as e:
      parse(json.dumps(body).encode(), counting, LIMITS)
    assert e.value.field == field, e.value
  assert counting.encoded == 0
  # A prompt that leaves no room is the prompt's fault, named as sent, with or without a length.
  fits_not = 'a' * LIMITS.max_sequence_length
  cases = ((parse_generate, {'text': fits_not}, 'text'),
           (parse_completion, {'prompt': fits_not}, 'prompt'),
           (parse_completion, {'prompt': [3] * LIMITS.max_sequence_length}, 'prompt'))
  for parse, body, field in cases:
    with pytest.raises(BadRequest) as e:
      parse(json.dumps(body).encode(), counting, LIMITS)
    assert e.value.field == field, e.value


def test_per_request_caps_on_samples_and_tokens(tokenizer):
  limits = dataclasses.replace(LIMITS, max_samples=4, max_tokens=60)
  too_many = {'prompt': [[5, 6]] * 3, 'n': 2, 'max_tokens': 2}
  too_long = {'prompt': [[5] * 20] * 2, 'n': 1, 'max_tokens': 20}
  for body, field in ((too_many, 'n'), (too_long, 'max_tokens')):
    with pytest.raises(BadRequest) as e:
      parse_completion(json.dumps(body).encode(), tokenizer, limits)
    assert (e.value.field, e.value.status) == (field, 400), e.value
  ok = parse_completion(json.dumps({'prompt': [[5] * 10] * 2, 'n': 2, 'max_tokens': 5}).encode(),
                        tokenizer, limits)
  assert len(ok.prompts) == 2


def test_the_model_field_names_the_served_model(tokenizer):
  limits = dataclasses.replace(LIMITS, model_names=('tiny',))
  assert parse_completion(b'{"prompt": [5], "model": "tiny"}', tokenizer, limits).model == 'tiny'
  with pytest.raises(BadRequest) as e:
    parse_completion(json.dumps({'prompt': [5], 'model': 'm' * 100_000}).encode(), tokenizer,
                     limits)
  assert (e.value.field, e.value.status) == ('model', 404) and len(str(e.value)) < 300


def test_parsing_runs_off_the_event_loop(engine, tokenizer):
  """A request whose tokenizing blocks until a health check is answered: the health check
  can only be answered if parsing runs off the event loop."""
  answered = threading.Event()

  class Blocking(_CountingTokenizer):
    def encode(self, text, **kwargs):
      assert answered.wait(HANG_GUARD_S), 'the event loop waited for the tokenizer'
      return super().encode(text, **kwargs)

  s = Served(engine, tokenizer=Blocking(tokenizer))
  try:
    result = {}
    slow = threading.Thread(target=lambda: result.update(r=_post(
        s.port, '/v1/generate', {'text': 'abc', 'max_new_tokens': 2})))
    slow.start()
    try:
      status, _ = s.get('/v1/health')  # answered while the tokenizer blocks
    finally:
      answered.set()
    slow.join(HANG_GUARD_S)
    assert status == 200
    assert result['r'][0] == 200
  finally:
    s.close()


# ---- fairness ---------------------------------------------------------------------------------


def test_the_queue_takes_turns_between_clients():
  scheduler = Scheduler(CONFIG, [None], EngineStats(), clock=lambda: 0.0)  # no admission here
  order = ['a', 'a', 'a', 'b', 'c', 'b', 'a']
  for i, client in enumerate(order):
    scheduler.add([Request(i, np.zeros(1, np.int64), SamplingParams(), client=client)])
  assert [g[0].client for g in scheduler.queue] == ['a', 'b', 'c', 'a', 'b', 'a', 'a']
  assert [g[0].id for g in scheduler.queue] == [0, 3, 4, 1, 5, 2, 6]  # each client in order


def test_a_small_request_is_served_while_a_large_one_runs(engine):
  """One client queues many prompts; another's single short request, sent after them, is
  admitted before most of them (admission order counted, not seconds)."""
  s = Served(engine)
  try:
    def greedy(i):
      payload = {'prompt': [_prompts(10 * i + k, 1)[0] for k in range(4)], 'max_tokens': 8}
      _post(s.port, '/v1/completions', payload, source=OTHER_CLIENT)

    threads = [threading.Thread(target=greedy, args=(i,)) for i in range(6)]
    for t in threads:
      t.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while engine.num_queued < 12 and time.monotonic() < deadline:
      time.sleep(0.005)
    status, _, _ = _post(s.port, '/v1/generate', {'prompt': [5, 6, 7], 'max_new_tokens': 2})
    for t in threads:
      t.join(HANG_GUARD_S)
    assert status == 200
    s.wait_idle()
    (small,) = [r for r in s.server.loop.recent if r.client == '127.0.0.1']
    overtaken = [r for r in s.server.loop.recent if r.client == OTHER_CLIENT
                 and r.arrival < small.arrival and r.admitted > small.admitted]
    assert len(overtaken) >= 8, len(overtaken)  # first come first served: none
    assert_no_leak(engine)
  finally:
    s.close()


def test_per_client_connection_cap_leaves_room_for_others(engine):
  s = Served(engine, config=ServerConfig(max_connections_per_client=3, header_timeout_s=60))
  idle = []
  try:
    for _ in range(3):
      c = socket.socket()
      c.bind((OTHER_CLIENT, 0))
      c.connect(('127.0.0.1', s.port))
      idle.append(c)
    c = socket.socket()
    c.bind((OTHER_CLIENT, 0))
    c.connect(('127.0.0.1', s.port))
    with c:
      c.settimeout(HANG_GUARD_S)
      c.sendall(b'GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n')
      data = b''
      while chunk := c.recv(65536):
        data += chunk
    status, reply = _json_body(data)
    assert status == 503 and reply['field'] == 'connection' and OTHER_CLIENT in reply['error']
    assert s.get('/v1/health')[0] == 200  # another address is served
  finally:
    for c in idle:
      c.close()
    s.close()


# ---- keys and rates ---------------------------------------------------------------------------


def test_api_keys_compare_in_constant_time_and_require_bearer():
  keys = ApiKeys(['k1', 'secret'])
  assert keys.allows('Bearer secret') and keys.allows('bearer k1')
  assert not any(keys.allows(h) for h in (None, '', 'secret', 'Bearer secre', 'Basic secret',
                                          'Bearer secret2', 'Bearer \u00e9'))
  assert ApiKeys([]).allows(None)
  with pytest.raises(ValueError):
    ApiKeys([' padded'])


def test_rate_limiter_token_bucket():
  now = [0.0]
  rates = RateLimiter(2.0, 3, clock=lambda: now[0])
  assert [rates.wait('a') for _ in range(3)] == [0.0] * 3
  assert rates.wait('a') == pytest.approx(0.5) and rates.wait('b') == 0.0
  now[0] = 0.5
  assert rates.wait('a') == 0.0 and rates.wait('a') > 0
  assert RateLimiter(0, 1).wait('a') == 0.0


def test_exposure_warning():
  assert exposure_warning('127.0.0.1', ApiKeys([])) is None
  assert exposure_warning('::1', ApiKeys([])) is None
  assert exposure_warning('localhost', ApiKeys([])) is None
  assert '--api_key' in exposure_warning('0.0.0.0', ApiKeys([]))
  assert exposure_warning('0.0.0.0', ApiKeys(['k'])) is None


def test_server_keys_rates_and_model_names(engine):
  s = Served(engine, model_name='tiny', config=ServerConfig(
      api_keys=('sesame',), rate_limit=1e-3, rate_burst=2))
  try:
    body = {'prompt': [5, 6], 'max_tokens': 2, 'model': 'tiny'}
    status, reply, headers = _post(s.port, '/v1/completions', body)
    assert status == 401 and reply['error']['param'] == 'authorization'
    assert headers.get('www-authenticate') == 'Bearer'
    auth = {'Authorization': 'Bearer sesame'}
    status, reply, _ = _post(s.port, '/v1/completions', body, headers=auth)
    assert status == 200 and reply['model'] == 'tiny'
    status, reply, _ = _post(s.port, '/v1/completions', {**body, 'model': 'other'}, headers=auth)
    assert status == 404 and reply['error']['param'] == 'model'
    status, reply, headers = _post(s.port, '/v1/completions', body, headers=auth)  # 3rd: over
    assert status == 429 and int(headers['retry-after']) >= 1
    status, _, _ = _post(s.port, '/v1/generate', {'prompt': [5]}, headers=auth,
                         source=OTHER_CLIENT)  # another client has its own bucket
    assert status == 200
    assert s.get('/v1/health')[0] == 200  # no key needed
  finally:
    s.close()


# ---- transport --------------------------------------------------------------------------------


def test_a_client_that_keeps_sending_gets_its_413(engine):
  s = Served(engine, config=ServerConfig(max_body_bytes=1000))
  try:
    with socket.create_connection(('127.0.0.1', s.port), timeout=HANG_GUARD_S) as c:
      c.sendall(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n')
      data = b''
      try:
        for _ in range(200):  # sends without waiting for an answer, as a raw client does
          c.sendall(b' ' * 20000)
      except (BrokenPipeError, ConnectionResetError):
        pass
      c.settimeout(HANG_GUARD_S)
      while chunk := c.recv(65536):
        data += chunk
    status, reply = _json_body(data)
    assert status == 413 and reply['field'] == 'body'
  finally:
    s.close()


def test_a_half_closed_client_is_answered(engine):
  s = Served(engine)
  try:
    body = json.dumps({'prompt': [5, 6, 7], 'max_new_tokens': 3}).encode()
    with socket.create_connection(('127.0.0.1', s.port), timeout=HANG_GUARD_S) as c:
      c.sendall(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s'
                % (len(body), body))
      c.shutdown(socket.SHUT_WR)
      data = b''
      while chunk := c.recv(65536):
        data += chunk
    final = data[data.rindex(b'HTTP/1.1 '):]  # after any interim 100 responses
    status, reply = _json_body(final)
    assert status == 200 and len(reply['outputs'][0]) == 3
  finally:
    s.close()


def test_engine_config_refuses_unknown_impls_and_cache_dtypes():
  for kwargs, name in (({'impl': 'bogus'}, 'impl'), ({'prefill_impl': 'x'}, 'prefill_impl'),
                       ({'cache_dtype': 'int8'}, 'cache_dtype')):
    with pytest.raises(ValueError, match=f'EngineConfig.{name}'):
      EngineConfig(num_chunks=8, **kwargs)


# ---- warm-up ----------------------------------------------------------------------------------


def test_warm_up_in_the_background_serves_meanwhile_and_reports(model):
  config = dataclasses.replace(CONFIG, max_batch=1, decode_buckets=(1,), max_sequence_length=32)
  engine = Engine(model, config)
  steps = []
  s = Served(engine, warmup=True, on_warmup=lambda *a: steps.append(a))
  try:
    status, reply, _ = _post(s.port, '/v1/generate', {'prompt': [5, 6, 7], 'max_new_tokens': 2})
    assert status == 200 and len(reply['outputs'][0]) == 2
    _, health = s.get('/v1/health')
    total = health['warmup']['programs']
    budget = engine.compiled_shape_budget()
    assert total == budget.num_programs + len(budget.copies)
    deadline = time.monotonic() + 3 * HANG_GUARD_S  # 5 programs, compiled one by one
    while not s.get('/v1/health')[1]['warmup']['done'] and time.monotonic() < deadline:
      time.sleep(0.05)
    _, health = s.get('/v1/health')
    assert health['warmup']['done'] and health['warmup']['programs_compiled'] == total
    assert [d for d, _, _ in steps] == list(range(1, total + 1))
  finally:
    s.close()
