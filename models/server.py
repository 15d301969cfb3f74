"""An HTTP server over the continuous-batching `Engine`, on uvicorn + starlette (the `serve` extra).

One thread owns the engine (`models.server_engine.EngineLoop`); request
handlers run on uvicorn's event loop and talk to it through a queue.

Endpoints (JSON in, JSON out):

* `POST /v1/generate` with `{"prompt": [token ids]}` or `{"text": "..."}` (text
  needs a tokenizer), and optionally `max_new_tokens` (16), `temperature` (0:
  greedy), `top_k`, `top_p`, `min_p`, `seed`, `n` (samples, 1), `stop_tokens`
  ([ids]; with a tokenizer its EOS ids are added), `stop_sequences` ([[ids]]),
  `logprobs` (bool), `top_logprobs` (int) and `stream` (false).
  * Not streamed: `{"outputs": [[ids] per sample], "finish_reasons": [...],
    "texts": [...] (with a tokenizer), "shared_tokens": n}` (and `"logprobs"`).
  * Streamed: one JSON object per line (NDJSON) per token as it is made,
    `{"sample": i, "token": t, "index": k, "finished": bool, "reason": ...}`.
* `POST /v1/completions`: OpenAI's completions API (`prompt` as text or token
  ids or a list of them, `n`, `max_tokens`, `temperature`, `top_p`, `stop`,
  `logprobs`, `seed`, `stream` as server-sent events ending `data: [DONE]`).
  Choices carry `token_ids` too (the only output without a tokenizer).
* `POST /v1/chat/completions`: OpenAI's chat API (`messages` of `role` system / user /
  assistant and `content`, under the model's chat template; the completions fields but
  `logprobs`), with `choices[].message`, or `delta`s when streamed.
* `GET /v1/models`, and `GET /v1/health`: 200 `{"status": "ok", "running": ...,
  "queued": ..., "kv_bytes_in_use": ..., "warmup": {"programs_compiled", "programs", "done",
  "seconds"}}`, or 503 with `"error"` if the engine stopped.

Every error is a JSON body with a 4xx/5xx status naming the field at fault
(`{"error": "...", "field": ...}`; OpenAI's `{"error": {"message", "param", ...}}`
on the OpenAI routes), transport errors included (a bad `Content-Length`, a body
over the limit or too slow, too many connections). A client that leaves,
before or during its answer, streamed or not, cancels its request; one that only
half-closes after its request is answered. If the engine stops, health says so and
requests fail at once with 503.

Many clients, some greedy or hostile (`ServerConfig` holds the limits):
* what a request carries costs time linear in its size, within documented limits
  (`server_api.Limits`, `server_text`); sizes are checked before parsing work, and
  parsing and tokenizing run on worker threads, never on the event loop;
* a request holds at most `max_request_samples` samples and `max_request_tokens`
  tokens (400 above); the engine's queue takes turns between client addresses;
* connections are capped in all and per client address (503 above);
* `api_keys` (`--api_key`, or $HYDRAJAX_API_KEY) makes every route but /v1/health
  ask for `Authorization: Bearer <key>` (401 otherwise); `rate_limit` caps requests a
  second per client address (429 with Retry-After); serving beyond loopback without a
  key logs a warning;
* `model`, where given, must name the served model (404 otherwise); answers name the
  served model, never echo the request's.

Warm-up: the engine compiles its fixed set of programs in the background while idle,
smallest first, and serves meanwhile (a request compiles what it needs on first use);
the log and /v1/health say how far it got. On a CPU the engine is sized smaller (a
smaller batch, one prompt per prefill call) so that the set stays small.

Run: `python -m models.server` (SmolLM2-135M-Instruct, fetched on first use), or
`--checkpoint=<.gguf file or HF folder>`, or `--model=tiny_gqa` (random weights, no
tokenizer: token ids only).
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

import h11
import jax
import jax.numpy as jnp
import uvicorn
from absl import app, flags
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from hydrajax import command_line
from hydrajax.attention.parallel import initialize_distributed, parse_mesh
from models.config import get_config
from models.engine import Engine, EngineConfig
from models.checkpoint import load_checkpoint
from models.llama import init_model
from models.pretrained import load_smollm2
from models.server_api import (
    BadRequest, Choice, Limits, Work, finite, openai_error, parse_chat, parse_completion,
    parse_generate, plain_error,
)
from models.server_engine import EngineDown, EngineLoop, Job, JobDone, JobFailed
from models.server_limits import API_KEY_ENV, ApiKeys, RateLimiter, exposure_warning
from models.tokenizer import Tokenizer

@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Transport, request and client limits.

  Attributes:
    max_body_bytes: largest request body (413 above; the answer arrives even to a client
      that goes on sending: the server half-closes and drains for `linger_s`).
    body_timeout_s: a request body must arrive within this (408 after).
    header_timeout_s: a connection must send a request's headers within this of opening, or
      of its previous answer (408 after; the connection is closed).
    keep_alive_s: idle keep-alive connections close after this.
    max_connections: open connections; one more gets 503 and is closed.
    max_connections_per_client: open connections from one address; one more gets 503.
    backlog: the listen queue (connections the kernel holds before they are accepted).
    max_prompts: prompts in one /v1/completions request.
    max_request_samples: prompts x n of one request (None: the engine's max_batch).
    max_request_tokens: tokens one request may hold, each prompt plus n x its most new
      tokens (None: the engine's KV pool).
    api_keys: bearer keys a request must carry (401 otherwise; /v1/health needs none);
      empty: no key needed.
    rate_limit: requests a second one client (address) may send on average (429 above,
      with Retry-After); 0: no limit.
    rate_burst: requests a client may send at once within its rate.
    linger_s: how long a connection closed on a client still sending is drained.
    graceful_shutdown_s: what shutdown waits for answers in flight.
  """

  max_body_bytes: int = 4 * 2**20
  body_timeout_s: float = 30.0
  header_timeout_s: float = 10.0
  keep_alive_s: float = 5.0
  max_connections: int = 1024
  max_connections_per_client: int = 128
  backlog: int = 2048
  max_prompts: int = 64
  max_request_samples: int | None = None
  max_request_tokens: int | None = None
  api_keys: tuple[str, ...] = ()
  rate_limit: float = 0.0
  rate_burst: int = 32
  linger_s: float = 2.0
  graceful_shutdown_s: float = 5.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name == 'api_keys':
        ApiKeys(value)  # raises on a bad key
      elif f.name == 'rate_limit':
        if not (isinstance(value, (int, float)) and 0 <= value < float('inf')):
          raise ValueError(f'ServerConfig.rate_limit must be a finite number >= 0, got {value}')
      elif value is not None and not value > 0:
        raise ValueError(f'ServerConfig.{f.name} must be > 0, got {value}')


def _json(payload: dict[str, Any]) -> bytes:
  return json.dumps(payload, allow_nan=False).encode()


def _json_response(status: int, payload: dict[str, Any], headers=None) -> Response:
  return Response(_json(payload), status, media_type='application/json', headers=headers)


def _raw_response(status: int, reason: str, payload: dict[str, Any]) -> bytes:
  body = _json(payload)
  return (f'HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n'
          f'content-length: {len(body)}\r\nconnection: close\r\n\r\n').encode() + body


# ---- transport --------------------------------------------------------------------------------


class _RecordingConnection(h11.Connection):
  """h11's connection, keeping the last protocol error (uvicorn's 400 says only 'invalid')."""

  last_error: Exception | None = None

  def next_event(self):
    try:
      return super().next_event()
    except h11.RemoteProtocolError as e:
      self.last_error = e
      raise


class _LingeringTransport:
  """A transport whose `close`, while the client may still be sending a body nobody will
  read, half-closes and drains for a moment first: closing with unread data resets the
  connection, and the client would lose the answer already sent (e.g. a 413)."""

  def __init__(self, transport, protocol, linger_s: float):
    self._transport, self._protocol, self._linger_s = transport, protocol, linger_s
    self._closing = False

  def __getattr__(self, name):
    return getattr(self._transport, name)

  def is_closing(self) -> bool:
    return self._closing or self._transport.is_closing()

  def close(self) -> None:
    transport = self._transport
    if self.is_closing():
      return
    unread = self._protocol.conn.their_state is h11.SEND_BODY or self._protocol.refused
    if not unread or not transport.can_write_eof():
      return transport.close()
    self._closing = True
    self._protocol.draining = True
    transport.write_eof()
    transport.resume_reading()
    self._protocol.loop.call_later(self._linger_s, transport.close)


def _protocol_class(config: ServerConfig) -> type:
  """uvicorn's h11 protocol with JSON transport errors, a header deadline, connection caps
  (in all and per client address), lingering closes and answers to half-closed clients."""
  per_client: collections.Counter = collections.Counter()  # open connections by address
  refused = [0]  # refused connections still draining: they count against no cap in all

  class Protocol(H11Protocol):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      size = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
      self.conn = _RecordingConnection(h11.SERVER, size)
      self._deadline: asyncio.TimerHandle | None = None
      self._address: str | None = None
      self._half_closed = False

    refused = False  # answered 503 at once: what the client sends is discarded
    draining = False  # closing: what the client still sends is discarded

    def connection_made(self, transport):
      super().connection_made(_LingeringTransport(transport, self, config.linger_s))
      peer = transport.get_extra_info('peername')
      self._address = peer[0] if isinstance(peer, tuple) and peer else None
      per_client[self._address] += 1
      if len(self.connections) - refused[0] > config.max_connections:
        self._refuse(f'over {config.max_connections} open connections; retry later')
      elif per_client[self._address] > config.max_connections_per_client:
        self._refuse(f'over {config.max_connections_per_client} open connections from '
                     f'{self._address}; close some and retry')
      else:
        self._arm_deadline()

    def _refuse(self, message: str) -> None:
      # Answer at once, then drain what the client still sends for a moment: closing with
      # unread data would reset the connection and lose the answer.
      self.refused = True
      refused[0] += 1
      self.transport.write(_raw_response(503, 'Service Unavailable', {
          'error': message, 'field': 'connection'}))
      self.transport.close()

    def data_received(self, data):
      if not (self.refused or self.draining):
        super().data_received(data)

    def eof_received(self):
      cycle = self.cycle
      if (not self.draining and cycle is not None and not cycle.response_started
          and self.conn.their_state is h11.DONE):
        # Half-closed after a whole request: it may still read, so answer. A client that
        # closed both ways is found out by probes (interim 100 responses, which HTTP
        # clients skip): the second write to a closed peer fails and cancels the request.
        self._half_closed = True
        self._probe(cycle)
        return True
      return None

    def _probe(self, cycle) -> None:
      if self.cycle is cycle and not cycle.response_started and not self.transport.is_closing():
        self.transport.write(b'HTTP/1.1 100 Continue\r\n\r\n')
        self.loop.call_later(0.25, self._probe, cycle)

    def connection_lost(self, exc):
      if self._deadline is not None:
        self._deadline.cancel()
      per_client[self._address] -= 1
      if per_client[self._address] <= 0:
        del per_client[self._address]
      if self.refused:
        refused[0] -= 1
      super().connection_lost(exc)

    def on_response_complete(self):
      super().on_response_complete()
      if self._half_closed:  # it sends nothing more
        self.transport.close()
        return
      self._arm_deadline()

    def _arm_deadline(self):
      if self._deadline is not None:
        self._deadline.cancel()
      cycle = self.cycle
      self._deadline = self.loop.call_later(config.header_timeout_s, self._check_deadline, cycle)

    def _check_deadline(self, cycle):
      # No new request since the deadline was armed: a slow or idle client holds a connection.
      if self.cycle is cycle and not self.transport.is_closing():
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
          self.transport.write(_raw_response(408, 'Request Timeout', {
              'error': f'the request headers did not arrive within {config.header_timeout_s} s',
              'field': 'headers'}))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
      error = self.conn.last_error
      detail = str(error) if error is not None else msg
      field = next((h for h in ('Content-Length', 'Transfer-Encoding', 'Host')
                    if h.lower() in detail.lower()), 'request')
      self.transport.write(_raw_response(400, 'Bad Request', {
          'error': f'invalid HTTP request: {detail}', 'field': field}))
      self.transport.close()

  return Protocol


# ---- the application --------------------------------------------------------------------------


async def _read_body(request: Request, config: ServerConfig) -> bytes:
  """The body, chunked or not, within the size and time limits; BadRequest otherwise."""
  declared = request.headers.get('content-length')
  if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
    raise BadRequest('body', f'the body is over {config.max_body_bytes} bytes', 413)
  parts, size = [], 0
  try:
    async with asyncio.timeout(config.body_timeout_s):
      async for part in request.stream():
        size += len(part)
        if size > config.max_body_bytes:
          raise BadRequest('body', f'the body is over {config.max_body_bytes} bytes', 413)
        parts.append(part)
  except TimeoutError:
    raise BadRequest('body', f'the body did not arrive within {config.body_timeout_s} s',
                     408) from None
  return b''.join(parts)


class _Pending:
  """The engine jobs of one HTTP request, their events on this event loop, and the client."""

  def __init__(self, loop: EngineLoop, work: Work, receive, client):
    self.loop = loop
    self.work = work
    self.aloop = asyncio.get_running_loop()
    self.queue: asyncio.Queue = asyncio.Queue()
    self.jobs = [Job(p, work.params, self._deliverer(i), client=client)
                 for i, p in enumerate(work.prompts)]
    self.done = [False] * len(self.jobs)
    self.shared_tokens = 0
    self._gone = asyncio.ensure_future(self._watch(receive))

  def _deliverer(self, i):
    def deliver(item):  # engine thread
      self.aloop.call_soon_threadsafe(self.queue.put_nowait, (i, item))
    return deliver

  @staticmethod
  async def _watch(receive) -> None:
    while (await receive())['type'] != 'http.disconnect':
      pass

  def submit(self) -> None:
    for job in self.jobs:
      self.loop.submit(job)

  async def next(self):
    """(job index, events | JobDone | JobFailed), or None once the client has left."""
    if self._gone.done():
      return None
    get = asyncio.ensure_future(self.queue.get())
    await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
      i, item = get.result()
      if isinstance(item, JobDone):
        self.done[i] = True
        self.shared_tokens = max(self.shared_tokens, item.shared_tokens)
      return i, item
    get.cancel()
    return None

  @property
  def all_done(self) -> bool:
    return all(self.done)

  def close(self) -> None:
    """Cancels whatever is unfinished (the client left, or the answer ended early)."""
    self._gone.cancel()
    for job, done in zip(self.jobs, self.done):
      if not done:
        self.loop.cancel(job)


class _Answer(Response):
  """A response that submits the work, then runs `run(pending, send)` until it is answered.

  Whatever ends it (the answer, the client leaving, an error) cancels what is unfinished.
  """

  def __init__(self, loop: EngineLoop, work: Work, run, *, openai: bool, client):
    self.engine_loop, self.work, self.run, self.openai = loop, work, run, openai
    self.client = client

  async def __call__(self, scope, receive, send):
    pending = _Pending(self.engine_loop, self.work, receive, self.client)
    try:
      try:
        pending.submit()
      except EngineDown as e:
        return await _send_error(send, BadRequest('engine', str(e), 503), openai=self.openai)
      await self.run(pending, send)
    finally:
      pending.close()


async def _send_error(send, err: BadRequest, *, openai: bool) -> None:
  await _send_json(send, err.status, openai_error(err) if openai else plain_error(err))


async def _send_json(send, status: int, payload: dict[str, Any]) -> None:
  body = _json(payload)
  await _start(send, status, 'application/json', [(b'content-length', b'%d' % len(body))])
  await send({'type': 'http.response.body', 'body': body})


async def _start(send, status: int, media_type: str, headers=()) -> None:
  await send({'type': 'http.response.start', 'status': status,
              'headers': [(b'content-type', media_type.encode()), *headers]})


async def _chunk(send, data: bytes) -> None:
  await send({'type': 'http.response.body', 'body': data, 'more_body': True})


async def _end(send) -> None:
  await send({'type': 'http.response.body', 'body': b'', 'more_body': False})


def _failed(item: JobFailed) -> BadRequest:
  return BadRequest(item.field, str(item), item.status)


def _client(request: Request) -> str:
  """Who sent a request, for fairness and rate limits: the peer's address."""
  return request.client.host if request.client is not None else 'unknown'


def make_app(loop: EngineLoop, *, tokenizer: Tokenizer | None = None, model_name: str = 'hydrajax',
             config: ServerConfig = ServerConfig()) -> Starlette:
  """The ASGI application over a started `EngineLoop`.

  Bodies are parsed (JSON, token checks, tokenizing) on a worker thread, after size checks
  that bound the work (`server_api.Limits`), so the event loop only moves bytes.
  """
  mc = loop.engine.model.config
  ec = loop.engine.config
  limits = Limits(vocab_size=mc.vocab_size, max_sequence_length=ec.max_sequence_length,
                  max_batch=ec.max_batch, max_prompts=config.max_prompts,
                  max_samples=config.max_request_samples,
                  max_tokens=config.max_request_tokens or ec.num_chunks * ec.chunk_size,
                  model_names=(model_name,))
  keys = ApiKeys(config.api_keys)
  rates = RateLimiter(config.rate_limit, config.rate_burst)
  parsers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix='parse')

  def refusal(request: Request, openai: bool) -> Response | None:
    """401 without a valid key, 429 over the client's rate, 503 with the engine down."""
    shape = openai_error if openai else plain_error
    if not keys.allows(request.headers.get('authorization')):
      return _json_response(401, shape(BadRequest(
          'authorization', 'a valid API key is required: "Authorization: Bearer <key>"', 401)),
          headers={'www-authenticate': 'Bearer'})
    wait = rates.wait(_client(request))
    if wait:
      return _json_response(429, shape(BadRequest(
          'rate', f'over {config.rate_limit} requests a second from {_client(request)}; retry in '
          f'{wait:.1f} s', 429)), headers={'retry-after': str(max(1, math.ceil(wait)))})
    if not loop.alive:
      return _json_response(503, shape(BadRequest('engine', loop.error or 'the engine stopped',
                                                   503)))
    return None

  async def parse(request: Request, parser, openai: bool) -> Work | Response:
    refused = refusal(request, openai)
    if refused is not None:
      return refused
    try:
      body = await _read_body(request, config)
      return await asyncio.get_running_loop().run_in_executor(
          parsers, parser, body, tokenizer, limits)
    except BadRequest as e:
      shape = openai_error if openai else plain_error
      return _json_response(e.status, shape(e))

  def endpoint(parser, answer, *, openai: bool):
    """A request handler: `parser` reads the body into a `Work`, `answer(pending, send)` writes
    its response (the OpenAI endpoints name the served model in theirs)."""

    async def handle(request: Request) -> Response:
      try:
        work = await parse(request, parser, openai=openai)
      except ClientDisconnect:
        return Response(status_code=499)
      if isinstance(work, Response):
        return work
      if openai:
        work = dataclasses.replace(work, model=model_name)
      run = answer(work)
      return _Answer(loop, work, run, openai=openai, client=_client(request))

    return handle

  generate = endpoint(parse_generate, lambda work: (
      _stream_generate if work.stream else
      lambda pending, send: _answer_generate(pending, send, tokenizer)), openai=False)
  completions = endpoint(parse_completion, lambda work: (
      lambda pending, send: _completion(pending, send, tokenizer)), openai=True)
  chat = endpoint(parse_chat, lambda work: (
      lambda pending, send: _completion(pending, send, tokenizer, chat=True)), openai=True)

  async def health(request: Request) -> Response:
    stats = dict(loop.stats)
    if not loop.alive:
      stats.update(status='error', error=loop.error or 'the engine loop is not running')
      return _json_response(503, stats)
    return _json_response(200, stats)

  async def models(request: Request) -> Response:
    if not keys.allows(request.headers.get('authorization')):
      return _json_response(401, openai_error(BadRequest(
          'authorization', 'a valid API key is required: "Authorization: Bearer <key>"', 401)),
          headers={'www-authenticate': 'Bearer'})
    return _json_response(200, {'object': 'list', 'data': [
        {'id': model_name, 'object': 'model', 'created': 0, 'owned_by': 'hydrajax'}]})

  async def http_error(request: Request, exc: HTTPException) -> Response:
    field = 'method' if exc.status_code == 405 else 'path'
    return _json_response(exc.status_code, {
        'error': f'{exc.detail}: {request.method} {request.url.path}; try POST /v1/generate, '
                 f'POST /v1/completions, GET /v1/health or GET /v1/models', 'field': field})

  async def server_error(request: Request, exc: Exception) -> Response:
    return _json_response(500, {'error': f'internal error: {type(exc).__name__}: {exc}',
                                'field': 'server'})

  return Starlette(routes=[
      Route('/v1/generate', generate, methods=['POST']),
      Route('/v1/completions', completions, methods=['POST']),
      Route('/v1/chat/completions', chat, methods=['POST']),
      Route('/v1/health', health, methods=['GET']),
      Route('/v1/models', models, methods=['GET']),
  ], exception_handlers={HTTPException: http_error, Exception: server_error})


# ---- /v1/generate -----------------------------------------------------------------------------


async def _answer_generate(pending: _Pending, send, tokenizer: Tokenizer | None) -> None:
  work = pending.work
  n = work.params.n
  (job,) = pending.jobs
  outputs = [[] for _ in range(n)]
  logprobs = [[] for _ in range(n)]
  reasons: list[str | None] = [None] * n
  while not pending.all_done:
    got = await pending.next()
    if got is None:  # the client left: `close` cancels
      return
    _, item = got
    if isinstance(item, JobFailed):
      return await _send_error(send, _failed(item), openai=False)
    if isinstance(item, JobDone):
      continue
    for event in item:
      i = event.request_id - job.first_id
      if event.reason != 'cancelled':
        outputs[i].append(event.token)
        logprobs[i].append(finite(getattr(event, 'logprob', None)))
      if event.finished:
        reasons[i] = event.reason
  payload = {'outputs': outputs, 'finish_reasons': reasons,
             'shared_tokens': pending.shared_tokens}
  if getattr(work.params, 'logprobs', False):
    payload['logprobs'] = logprobs
  if tokenizer is not None:
    payload['texts'] = [tokenizer.decode(o) for o in outputs]
  await _send_json(send, 200, payload)


async def _stream_generate(pending: _Pending, send) -> None:
  (job,) = pending.jobs
  started = False
  while not pending.all_done:
    got = await pending.next()
    if got is None:
      return
    _, item = got
    if isinstance(item, JobFailed):
      if not started:
        return await _send_error(send, _failed(item), openai=False)
      await _chunk(send, _json(plain_error(_failed(item))) + b'\n')
      break
    if isinstance(item, JobDone):
      continue
    if not started:  # the status waits for the first token: a refusal is still a 400
      await _start(send, 200, 'application/x-ndjson')
      started = True
    lines = []
    for event in item:
      line = {'sample': event.request_id - job.first_id, 'token': event.token,
              'index': event.index, 'finished': event.finished, 'reason': event.reason}
      if getattr(event, 'logprob', None) is not None:
        line['logprob'] = finite(event.logprob)
      lines.append(_json(line) + b'\n')
    await _chunk(send, b''.join(lines))
  if not started:
    await _start(send, 200, 'application/x-ndjson')
  await _end(send)


# ---- /v1/completions --------------------------------------------------------------------------


async def _completion(pending: _Pending, send, tokenizer: Tokenizer | None, *,
                      chat: bool = False) -> None:
  """OpenAI's completions answer, or with `chat` its chat completions answer."""
  work = pending.work
  n = work.params.n
  choices = [Choice(tokenizer, stop_texts=work.stop_texts, stop_ids=work.stop_ids)
             for _ in range(n * len(work.prompts))]
  head = {'id': f'{"chatcmpl" if chat else "cmpl"}-{uuid.uuid4().hex}',
          'object': 'chat.completion.chunk' if chat and work.stream else
                    'chat.completion' if chat else 'text_completion',
          'created': int(time.time()), 'model': work.model}
  offsets = [0] * len(choices)
  started = False
  greeted = [False] * len(choices)  # chat: the first delta of a choice names the role

  def choice_json(k, text, start, end, reason):
    if chat:
      if not work.stream:
        return {'index': k, 'message': {'role': 'assistant', 'content': text},
                'logprobs': None, 'finish_reason': reason}
      delta = {'content': text} if text else {}
      if not greeted[k]:
        delta, greeted[k] = {'role': 'assistant', **delta}, True
      return {'index': k, 'delta': delta, 'logprobs': None, 'finish_reason': reason}
    logprobs = None
    if work.top_logprobs is not None:
      logprobs = choices[k].logprobs_json(start, end, offset=offsets[k], top=work.top_logprobs)
      offsets[k] += sum(len(t) for t in logprobs['tokens'])
    return {'text': text, 'index': k, 'logprobs': logprobs, 'finish_reason': reason,
            'token_ids': choices[k].tokens[start:end]}

  async def sse(payload):
    await _chunk(send, b'data: ' + _json(payload) + b'\n\n')

  while not pending.all_done:
    got = await pending.next()
    if got is None:
      return
    i, item = got
    if isinstance(item, JobFailed):
      if not started:
        return await _send_error(send, _failed(item), openai=True)
      await sse(openai_error(_failed(item)))
      break
    if isinstance(item, JobDone):
      continue
    job = pending.jobs[i]
    touched = []
    for event in item:
      k = i * n + event.request_id - job.first_id
      if choices[k].add(event):  # a stop the server applies: the engine can stop this sample
        pending.loop.cancel(job, [event.request_id])
      touched.append(k)
    if work.stream:
      if not started:
        await _start(send, 200, 'text/event-stream')
        started = True
      for k in dict.fromkeys(touched):
        text, start, end = choices[k].delta()
        if text or end > start or choices[k].finished:
          await sse({**head, 'choices': [choice_json(k, text, start, end,
                                                     choices[k].finish_reason)]})
  usage = {'prompt_tokens': sum(len(p) for p in work.prompts),
           'completion_tokens': sum(len(c.tokens) for c in choices)}
  usage['total_tokens'] = usage['prompt_tokens'] + usage['completion_tokens']
  if not work.stream:
    body = {**head, 'choices': [choice_json(k, c.text, 0, len(c.tokens), c.finish_reason)
                                for k, c in enumerate(choices)], 'usage': usage}
    return await _send_json(send, 200, body)
  if not started:
    await _start(send, 200, 'text/event-stream')
  if work.include_usage:
    await sse({**head, 'choices': [], 'usage': usage})
  await _chunk(send, b'data: [DONE]\n\n')
  await _end(send)


# ---- the server -------------------------------------------------------------------------------


class Server:
  """uvicorn serving the app over an engine thread, on a socket bound and listening from
  construction (a client that connects before uvicorn runs waits in the backlog, is not refused).

  `serve_forever()` blocks; `start()` serves from a background thread (tests,
  notebooks) and `shutdown()` stops both the server and the engine thread. With `warmup`
  the engine compiles its shape set while idle, serving meanwhile (`EngineLoop`);
  `on_warmup(done, total, seconds)` hears of each step. Serving beyond loopback without
  an API key logs a warning.
  """

  def __init__(self, engine: Engine, *, host: str = '127.0.0.1', port: int = 8000,
               tokenizer: Tokenizer | None = None, model_name: str = 'hydrajax',
               config: ServerConfig = ServerConfig(), log_level: str = 'warning',
               warmup: bool = False, on_warmup=None):
    warning = exposure_warning(host, ApiKeys(config.api_keys))
    if warning:
      logging.getLogger(__name__).warning(warning)
    self.loop = EngineLoop(engine, warmup=warmup, on_warmup=on_warmup).start()
    self.app = make_app(self.loop, tokenizer=tokenizer, model_name=model_name, config=config)
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    self.socket = socket.socket(family, socket.SOCK_STREAM)
    self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.socket.bind((host, port))
    self.socket.listen(config.backlog)  # the CLI announces the address before uvicorn runs
    self.host, self.port = host, self.socket.getsockname()[1]
    self.uvicorn = uvicorn.Server(uvicorn.Config(
        self.app, http=_protocol_class(config), backlog=config.backlog,
        timeout_keep_alive=config.keep_alive_s, lifespan='off', log_level=log_level,
        timeout_graceful_shutdown=config.graceful_shutdown_s, access_log=False))
    self._thread: threading.Thread | None = None

  def serve_forever(self) -> None:
    try:
      self.uvicorn.run(sockets=[self.socket])
    finally:
      self.loop.stop()

  def start(self) -> 'Server':
    self._thread = threading.Thread(target=self.serve_forever, name='http', daemon=True)
    self._thread.start()
    while not self.uvicorn.started and self._thread.is_alive():
      time.sleep(0.01)
    return self

  def shutdown(self) -> None:
    self.uvicorn.should_exit = True
    if self._thread is not None:
      self._thread.join()
    self.loop.stop()
    self.socket.close()


def make_server(engine: Engine, *, host: str = '127.0.0.1', port: int = 8000,
                tokenizer: Tokenizer | None = None, **kwargs) -> Server:
  """A `Server` (not yet serving: call `serve_forever` or `start`)."""
  return Server(engine, host=host, port=port, tokenizer=tokenizer, **kwargs)


DEFAULT_MODEL_NAME = 'SmolLM2-135M-Instruct'


def _engine_sizes() -> dict[str, int]:
  """Engine sizes: the flags where given, else sized for the backend. On a CPU a smaller
  batch and one prompt per prefill call keep the shape set (and its warm-up) small."""
  cpu = jax.default_backend() == 'cpu'
  defaults = ({'num_chunks': 128, 'max_batch': 8, 'max_sequence_length': 2048,
               'max_prefill_rows': 1} if cpu else
              {'num_chunks': 512, 'max_batch': 64, 'max_sequence_length': 4096,
               'max_prefill_rows': 8})
  given = {'num_chunks': _NUM_CHUNKS.value, 'max_batch': _MAX_BATCH.value,
           'max_sequence_length': _MAX_LEN.value, 'max_prefill_rows': _PREFILL_ROWS.value}
  return {k: given[k] if given[k] is not None else v for k, v in defaults.items()}


def _warmup_logger(start: float):
  def log(done: int, total: int, seconds: float) -> None:
    print(f'warm-up: {done}/{total} programs compiled ({seconds:.0f} s compiling, '
          f'{time.monotonic() - start:.0f} s since start){"; warm" if done == total else ""}',
          flush=True)
  return log


def main(argv):
  del argv
  start = time.monotonic()
  if _COMPILATION_CACHE.value:  # a later start loads the programs this one compiled
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(_COMPILATION_CACHE.value))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
  initialize_distributed(_DISTRIBUTED.value)
  mesh = parse_mesh(_MESH.value)  # errors before any work: unknown axes, too many devices
  if mesh is not None and mesh.shape.get('dp', 1) > 1 and _OVERLAP.value:
    raise app.UsageError(f'--mesh={_MESH.value} has dp > 1: --overlap_decode is not supported '
                         'with data parallelism (see EngineConfig.overlap_decode)')
  keys = tuple(k for k in (_API_KEY.value or os.environ.get(API_KEY_ENV, '')).split(',') if k)
  config = ServerConfig(max_connections=_MAX_CONNECTIONS.value, backlog=_BACKLOG.value,
                        max_connections_per_client=_MAX_CLIENT_CONNECTIONS.value,
                        api_keys=keys, rate_limit=_RATE_LIMIT.value)  # checked before work
  dtype = jnp.dtype(_DTYPE.value)
  if _CHECKPOINT.value:
    model, tokenizer = load_checkpoint(_CHECKPOINT.value, dtype=dtype, mesh=mesh)
    name = os.path.basename(_CHECKPOINT.value.rstrip('/'))
    name = name[:-len('.gguf')] if name.lower().endswith('.gguf') else name
  elif _MODEL.value:  # random weights, made straight into their shards with a mesh
    model = init_model(get_config(_MODEL.value), mesh=mesh, seed=0, dtype=dtype)
    tokenizer, name = None, _MODEL.value
  else:
    model, tokenizer = load_smollm2(dtype=dtype, mesh=mesh)
    name = DEFAULT_MODEL_NAME
  if _TOKENIZER.value:
    tokenizer = Tokenizer.from_file(_TOKENIZER.value)
  print(f'loaded {name} ({time.monotonic() - start:.0f} s after start)', flush=True)
  engine = Engine(model, EngineConfig(chunk_size=_CHUNK.value, overlap_decode=_OVERLAP.value,
                                      **_engine_sizes()))
  if _WARMUP.value:
    print(f'warm-up: compiling {engine.compiled_shape_budget()} while idle, serving meanwhile '
          f'(a request compiles what it needs on first use)', flush=True)
  server = make_server(engine, host=_HOST.value, port=_PORT.value, tokenizer=tokenizer,
                       model_name=name, config=config, warmup=_WARMUP.value,
                       on_warmup=_warmup_logger(start))
  print(f'serving {name} on http://{server.host}:{server.port} (POST /v1/chat/completions, '
        f'POST /v1/completions, POST /v1/generate, GET /v1/health, GET /v1/models) '
        f'{time.monotonic() - start:.0f} s after start', flush=True)
  server.serve_forever()


if __name__ == '__main__':
  _MODEL = flags.DEFINE_string('model', '', 'a model preset with random weights, e.g. tiny_gqa '
                               '(default: SmolLM2-135M-Instruct, fetched on first use)')
  _CHECKPOINT = flags.DEFINE_string('checkpoint', '', 'a .gguf file or a HF Llama folder '
                                    '(overrides --model)')
  _TOKENIZER = flags.DEFINE_string('tokenizer', '', 'tokenizer.json or its folder (for text)')
  _DTYPE = flags.DEFINE_string('dtype', 'float32', 'parameter dtype')
  _HOST = flags.DEFINE_string('host', '127.0.0.1', 'address to listen on (beyond loopback, '
                              'pass --api_key)')
  _PORT = flags.DEFINE_integer('port', 8000, 'port')
  _NUM_CHUNKS = flags.DEFINE_integer('num_chunks', None, 'KV pool chunks (default: 512 on an '
                                     'accelerator, 128 on a CPU)')
  _CHUNK = flags.DEFINE_integer('chunk_size', 64, 'tokens per chunk')
  _MAX_BATCH = flags.DEFINE_integer('max_batch', None, 'most live sequences (default: 64 on an '
                                    'accelerator, 8 on a CPU)')
  _MAX_LEN = flags.DEFINE_integer('max_sequence_length', None, 'longest prompt + generation '
                                  '(default: 4096 on an accelerator, 2048 on a CPU)')
  _PREFILL_ROWS = flags.DEFINE_integer('max_prefill_rows', None, 'most prompts in one prefill '
                                       'call (default: 8 on an accelerator, 1 on a CPU)')
  _OVERLAP = flags.DEFINE_boolean(
      'overlap_decode', False, 'dispatch decode step k+1 before reading step k (recommended without '
      'dp: a step then takes its device time; see EngineConfig.overlap_decode)')
  _MAX_CONNECTIONS = flags.DEFINE_integer('max_connections', 1024, 'open connections at most')
  _MAX_CLIENT_CONNECTIONS = flags.DEFINE_integer('max_connections_per_client', 128,
                                                 'open connections from one address at most')
  _BACKLOG = flags.DEFINE_integer('backlog', 2048, 'listen backlog')
  _API_KEY = flags.DEFINE_string('api_key', '', 'require "Authorization: Bearer <key>" (comma-'
                                 f'separated keys for several; default: ${API_KEY_ENV})')
  _RATE_LIMIT = flags.DEFINE_float('rate_limit', 0.0, 'requests a second one client address '
                                   'may send on average (bursts of 32); 0: no limit')
  _WARMUP = flags.DEFINE_boolean('warmup', True, 'compile every engine shape in the background '
                                 'while idle (requests are served meanwhile)')
  _COMPILATION_CACHE = flags.DEFINE_string(
      'compilation_cache', os.path.join(os.environ.get('HYDRAJAX_CACHE') or '~/.cache/hydrajax',
                                        'jax'),
      "where compiled programs are kept for later starts ('' : nowhere)")
  _MESH = flags.DEFINE_string('mesh', '', "device mesh, e.g. 'tp:2' or 'dp:2,tp:4' (tensor and "
                              "data parallel over the local devices; '' or 'none': one device); "
                              'see hydrajax/PARALLELISM.md')
  _DISTRIBUTED = flags.DEFINE_string('distributed', '', "multi-host start-up: 'auto' or "
                                     "'HOST:PORT,NUM_PROCESSES,PROCESS_ID'")
  command_line.run(main)
