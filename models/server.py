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
* `GET /v1/models`, and `GET /v1/health`: 200 `{"status": "ok", "running": ...,
  "queued": ..., "kv_bytes_in_use": ...}`, or 503 with `"error"` if the engine stopped.

Every error is a JSON body with a 4xx/5xx status naming the field at fault
(`{"error": "...", "field": ...}`; OpenAI's `{"error": {"message", "param", ...}}`
on /v1/completions), transport errors included (a bad `Content-Length`, a body
over the limit or too slow, too many connections). A client that leaves,
before or during its answer, streamed or not, cancels its request. If the
engine stops, health says so and requests fail at once with 503.

Run: `python -m models.server --model=tiny_gqa --port=8000` (random weights),
or with `--checkpoint=<HF folder>` (and its tokenizer, for text).
"""

import asyncio
import dataclasses
import json
import socket
import threading
import time
import uuid
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from models.engine import Engine
from models.server_api import (
    BadRequest, Choice, Limits, Work, finite, openai_error, parse_completion, parse_generate,
    plain_error,
)
from models.server_engine import EngineDown, EngineLoop, Job, JobDone, JobFailed
from models.tokenizer import Tokenizer

@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Transport limits.

  Attributes:
    max_body_bytes: largest request body (413 above).
    body_timeout_s: a request body must arrive within this (408 after).
    header_timeout_s: a connection must send a request's headers within this of opening, or
      of its previous answer (408 after; the connection is closed).
    keep_alive_s: idle keep-alive connections close after this.
    max_connections: open connections; one more gets 503 and is closed.
    backlog: the listen queue (connections the kernel holds before they are accepted).
    max_prompts: prompts in one /v1/completions request.
    graceful_shutdown_s: what shutdown waits for answers in flight.
  """

  max_body_bytes: int = 16 * 2**20
  body_timeout_s: float = 30.0
  header_timeout_s: float = 10.0
  keep_alive_s: float = 5.0
  max_connections: int = 1024
  backlog: int = 2048
  max_prompts: int = 64
  graceful_shutdown_s: float = 5.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if not getattr(self, f.name) > 0:
        raise ValueError(f'ServerConfig.{f.name} must be > 0, got {getattr(self, f.name)}')


def _json(payload: dict[str, Any]) -> bytes:
  return json.dumps(payload, allow_nan=False).encode()


def _json_response(status: int, payload: dict[str, Any]) -> Response:
  return Response(_json(payload), status, media_type='application/json')


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


def _protocol_class(config: ServerConfig) -> type:
  """uvicorn's h11 protocol with JSON transport errors, a header deadline and a connection cap."""

  class Protocol(H11Protocol):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      size = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
      self.conn = _RecordingConnection(h11.SERVER, size)
      self._deadline: asyncio.TimerHandle | None = None

    _refused = False

    def connection_made(self, transport):
      super().connection_made(transport)
      if len(self.connections) > config.max_connections:
        # Answer at once, then drain what the client still sends for a moment: closing with
        # unread data would reset the connection and lose the answer.
        self._refused = True
        transport.write(_raw_response(503, 'Service Unavailable', {
            'error': f'over {config.max_connections} open connections; retry later',
            'field': 'connection'}))
        if transport.can_write_eof():
          transport.write_eof()
        self.loop.call_later(1.0, transport.close)
        return
      self._arm_deadline()

    def data_received(self, data):
      if not self._refused:
        super().data_received(data)

    def connection_lost(self, exc):
      if self._deadline is not None:
        self._deadline.cancel()
      super().connection_lost(exc)

    def on_response_complete(self):
      super().on_response_complete()
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

  def __init__(self, loop: EngineLoop, work: Work, receive):
    self.loop = loop
    self.work = work
    self.aloop = asyncio.get_running_loop()
    self.queue: asyncio.Queue = asyncio.Queue()
    self.jobs = [Job(p, work.params, self._deliverer(i)) for i, p in enumerate(work.prompts)]
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

  def __init__(self, loop: EngineLoop, work: Work, run, *, openai: bool):
    self.engine_loop, self.work, self.run, self.openai = loop, work, run, openai

  async def __call__(self, scope, receive, send):
    pending = _Pending(self.engine_loop, self.work, receive)
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


def make_app(loop: EngineLoop, *, tokenizer: Tokenizer | None = None, model_name: str = 'hydrajax',
             config: ServerConfig = ServerConfig()) -> Starlette:
  """The ASGI application over a started `EngineLoop`."""
  mc = loop.engine.model.config
  ec = loop.engine.config
  limits = Limits(vocab_size=mc.vocab_size, max_sequence_length=ec.max_sequence_length,
                  max_batch=ec.max_batch, max_prompts=config.max_prompts)

  async def parse(request: Request, parser, openai: bool) -> Work | Response:
    shape = openai_error if openai else plain_error
    if not loop.alive:
      return _json_response(503, shape(BadRequest('engine', loop.error or 'the engine stopped',
                                                   503)))
    try:
      return parser(await _read_body(request, config), tokenizer, limits)
    except BadRequest as e:
      return _json_response(e.status, shape(e))

  async def generate(request: Request) -> Response:
    try:
      work = await parse(request, parse_generate, openai=False)
    except ClientDisconnect:
      return Response(status_code=499)
    if isinstance(work, Response):
      return work
    if work.stream:
      return _Answer(loop, work, _stream_generate, openai=False)
    return _Answer(loop, work, lambda pending, send: _answer_generate(pending, send, tokenizer),
                   openai=False)

  async def completions(request: Request) -> Response:
    try:
      work = await parse(request, parse_completion, openai=True)
    except ClientDisconnect:
      return Response(status_code=499)
    if isinstance(work, Response):
      return work
    work = dataclasses.replace(work, model=work.model or model_name)
    return _Answer(loop, work, lambda pending, send: _completion(pending, send, tokenizer),
                   openai=True)

  async def health(request: Request) -> Response:
    stats = dict(loop.stats)
    if not loop.alive:
      stats.update(status='error', error=loop.error or 'the engine loop is not running')
      return _json_response(503, stats)
    return _json_response(200, stats)

  async def models(request: Request) -> Response:
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


async def _completion(pending: _Pending, send, tokenizer: Tokenizer | None) -> None:
  work = pending.work
  n = work.params.n
  choices = [Choice(tokenizer, stop_texts=work.stop_texts, stop_ids=work.stop_ids)
             for _ in range(n * len(work.prompts))]
  head = {'id': f'cmpl-{uuid.uuid4().hex}', 'object': 'text_completion',
          'created': int(time.time()), 'model': work.model}
  offsets = [0] * len(choices)
  started = False

  def choice_json(k, text, start, end, reason):
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
  notebooks) and `shutdown()` stops both the server and the engine thread.
  """

  def __init__(self, engine: Engine, *, host: str = '127.0.0.1', port: int = 8000,
               tokenizer: Tokenizer | None = None, model_name: str = 'hydrajax',
               config: ServerConfig = ServerConfig(), log_level: str = 'warning'):
    self.loop = EngineLoop(engine).start()
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


def main(argv):
  del argv
  import jax.numpy as jnp

  from absl import app

  from hydrajax.attention.parallel import initialize_distributed, parse_mesh
  from models import sharding_rules as sr
  from models.config import get_config
  from models.engine import EngineConfig
  from models.hf_loading import load_hf_checkpoint

  initialize_distributed(_DISTRIBUTED.value)
  mesh = parse_mesh(_MESH.value)  # errors before any work: unknown axes, too many devices
  if mesh is not None and mesh.shape.get('dp', 1) > 1 and _OVERLAP.value:
    raise app.UsageError(f'--mesh={_MESH.value} has dp > 1: --overlap_decode is not supported '
                         'with data parallelism (see EngineConfig.overlap_decode)')
  dtype = jnp.dtype(_DTYPE.value)
  if _CHECKPOINT.value:
    model = load_hf_checkpoint(_CHECKPOINT.value, dtype=dtype, mesh=mesh)
  else:  # made straight into its shards with a mesh
    model = sr.init_model(get_config(_MODEL.value), mesh=mesh, seed=0, dtype=dtype)
  tokenizer = None
  if _TOKENIZER.value or _CHECKPOINT.value:
    try:
      tokenizer = Tokenizer.from_file(_TOKENIZER.value or _CHECKPOINT.value)
    except ValueError:
      if _TOKENIZER.value:
        raise
  engine = Engine(model, EngineConfig(
      num_chunks=_NUM_CHUNKS.value, chunk_size=_CHUNK.value, max_batch=_MAX_BATCH.value,
      max_sequence_length=_MAX_LEN.value, overlap_decode=_OVERLAP.value))
  name = _CHECKPOINT.value.rstrip('/').split('/')[-1] if _CHECKPOINT.value else _MODEL.value
  if _WARMUP.value and hasattr(engine, 'warmup'):  # every compiled shape before the first request
    print(f'compiling {engine.compiled_shape_budget()}', flush=True)
    engine.warmup()
  server = make_server(engine, host=_HOST.value, port=_PORT.value, tokenizer=tokenizer,
                       model_name=name, config=ServerConfig(
                           max_connections=_MAX_CONNECTIONS.value, backlog=_BACKLOG.value))
  print(f'serving {name} on http://{server.host}:{server.port} (POST /v1/generate, '
        f'POST /v1/completions, GET /v1/health)', flush=True)
  server.serve_forever()


if __name__ == '__main__':
  from absl import app, flags

  _MODEL = flags.DEFINE_string('model', 'tiny_gqa', 'model preset (random weights)')
  _CHECKPOINT = flags.DEFINE_string('checkpoint', '', 'HF Llama folder (overrides --model)')
  _TOKENIZER = flags.DEFINE_string('tokenizer', '', 'tokenizer.json or its folder (for text)')
  _DTYPE = flags.DEFINE_string('dtype', 'float32', 'parameter dtype')
  _HOST = flags.DEFINE_string('host', '127.0.0.1', 'address to listen on')
  _PORT = flags.DEFINE_integer('port', 8000, 'port')
  _NUM_CHUNKS = flags.DEFINE_integer('num_chunks', 512, 'KV pool chunks')
  _CHUNK = flags.DEFINE_integer('chunk_size', 64, 'tokens per chunk')
  _MAX_BATCH = flags.DEFINE_integer('max_batch', 64, 'most live sequences')
  _MAX_LEN = flags.DEFINE_integer('max_sequence_length', 4096, 'longest prompt + generation')
  _OVERLAP = flags.DEFINE_boolean(
      'overlap_decode', False, 'dispatch decode step k+1 before reading step k (recommended without '
      'dp: on an H200 a step then takes its device time; see EngineConfig.overlap_decode)')
  _MAX_CONNECTIONS = flags.DEFINE_integer('max_connections', 1024, 'open connections at most')
  _BACKLOG = flags.DEFINE_integer('backlog', 2048, 'listen backlog')
  _WARMUP = flags.DEFINE_boolean('warmup', True, 'compile every engine shape before serving')
  _MESH = flags.DEFINE_string('mesh', '', "device mesh, e.g. 'tp:2' or 'dp:2,tp:4' (tensor and "
                              "data parallel over the local devices; '' or 'none': one device); "
                              'see hydrajax/PARALLELISM.md')
  _DISTRIBUTED = flags.DEFINE_string('distributed', '', "multi-host start-up: 'auto' or "
                                     "'HOST:PORT,NUM_PROCESSES,PROCESS_ID'")
  app.run(main)
