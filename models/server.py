"""A small HTTP server over the continuous-batching `Engine` (standard library only).

One thread owns the engine and runs its iterations; HTTP handler threads only
talk to it through a queue, so the engine itself needs no locks.

Endpoints (JSON in, JSON out):

* `POST /v1/generate` with `{"prompt": [token ids]}` or `{"text": "..."}`
  (text needs a tokenizer), and optionally `max_new_tokens` (16),
  `temperature` (0: greedy), `n` (samples, 1), `stop_tokens` ([ids]; with a
  tokenizer its EOS ids are added) and `stream` (false).
  * Not streamed: `{"outputs": [[ids] per sample], "finish_reasons": [...],
    "texts": [...] (with a tokenizer), "shared_tokens": n}` once every sample is done.
  * Streamed: one JSON object per line (NDJSON) per token as it is made,
    `{"sample": i, "token": t, "index": k, "finished": bool, "reason": ...}`.
    A client that disconnects cancels its request.
* `GET /v1/health`: `{"running": sequences, "queued": requests, "kv_bytes_in_use": n}`.

Bad input (malformed JSON, a field of the wrong type or range, a prompt that
can never fit) gets status 400 and `{"error": "..."}` naming the field; the
engine never sees it.

Run: `python -m models.server --model=tiny_gqa --port=8000` (random weights),
or with `--checkpoint=<HF folder>` (and its tokenizer, for `text`).
"""

import dataclasses
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from models.engine import Engine, SamplingParams, TokenEvent
from models.tokenizer import Tokenizer

_MAX_BODY_BYTES = 16 * 2**20
_FIELDS = {'prompt', 'text', 'max_new_tokens', 'temperature', 'n', 'stop_tokens', 'stream'}


class BadRequest(ValueError):
  """A request the server refuses with status 400."""


@dataclasses.dataclass
class _Job:
  """One HTTP request: what to submit, and where its events go (None marks the end)."""

  prompt: list[int]
  params: SamplingParams
  events: 'queue.Queue[TokenEvent | Exception | None]'
  request_id: int | None = None
  shared_tokens: int = 0


def parse_request(body: bytes, tokenizer: Tokenizer | None) -> tuple[list[int], SamplingParams,
                                                                      bool]:
  """(prompt ids, sampling params, stream) from a /v1/generate body; raises BadRequest."""
  try:
    req = json.loads(body or b'{}')
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f'the body must be JSON: {e}') from None
  if not isinstance(req, dict):
    raise BadRequest('the body must be a JSON object')
  unknown = set(req) - _FIELDS
  if unknown:
    raise BadRequest(f'unknown fields {sorted(unknown)}; expected some of {sorted(_FIELDS)}')
  if ('prompt' in req) == ('text' in req):
    raise BadRequest('give exactly one of "prompt" (token ids) and "text"')
  if 'text' in req:
    if tokenizer is None:
      raise BadRequest('"text" needs a server started with a tokenizer; send "prompt" ids')
    if not isinstance(req['text'], str) or not req['text']:
      raise BadRequest('"text" must be a non-empty string')
    prompt = tokenizer.encode(req['text'])
  else:
    prompt = req['prompt']
    if (not isinstance(prompt, list) or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
      raise BadRequest('"prompt" must be a non-empty list of integer token ids')

  def integer(name, default, low):
    value = req.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise BadRequest(f'"{name}" must be an integer >= {low}, got {value!r}')
    return value

  temperature = req.get('temperature', 0.0)
  if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
    raise BadRequest(f'"temperature" must be a number >= 0, got {temperature!r}')
  stops = req.get('stop_tokens', [])
  if not isinstance(stops, list) or not all(isinstance(t, int) for t in stops):
    raise BadRequest('"stop_tokens" must be a list of integer token ids')
  if tokenizer is not None:
    stops = stops + [t for t in tokenizer.eos_ids if t not in stops]
  stream = req.get('stream', False)
  if not isinstance(stream, bool):
    raise BadRequest(f'"stream" must be true or false, got {stream!r}')
  params = SamplingParams(max_new_tokens=integer('max_new_tokens', 16, 1),
                          temperature=float(temperature), stop_tokens=tuple(stops),
                          n=integer('n', 1, 1))
  return prompt, params, stream


class EngineLoop:
  """Owns an `Engine` in one thread: takes jobs and cancellations, runs iterations."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._inbox: queue.Queue = queue.Queue()
    self._jobs: dict[int, _Job] = {}  # sample id -> its job
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name='engine-loop', daemon=True)
    self.stats = {'running': 0, 'queued': 0, 'kv_bytes_in_use': 0}
    self.error: Exception | None = None  # set if an engine iteration raised: the loop stops

  def start(self) -> 'EngineLoop':
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._inbox.put(None)
    self._thread.join()

  def submit(self, prompt: list[int], params: SamplingParams) -> _Job:
    """Queues a job; its `events` queue then yields TokenEvents, an Exception, or None (done)."""
    job = _Job(prompt, params, queue.Queue())
    if self.error is not None:
      job.events.put(self.error)
    else:
      self._inbox.put(('submit', job))
    return job

  def cancel(self, job: _Job) -> None:
    self._inbox.put(('cancel', job))

  def _take(self, item) -> None:
    kind, job = item
    engine = self.engine
    if kind == 'cancel':
      if job.request_id is not None:
        for rid in engine.samples(job.request_id):
          engine.cancel(rid)
      return
    try:
      job.request_id = engine.submit(job.prompt, job.params)
    except ValueError as e:  # can never fit, or a token id out of range
      job.events.put(BadRequest(str(e)))
      return
    for rid in engine.samples(job.request_id):
      self._jobs[rid] = job

  def _run(self) -> None:
    engine = self.engine
    while not self._stop.is_set():
      try:  # block only when idle
        item = self._inbox.get(timeout=None if not engine.has_work else 0)
        while item is not None:
          self._take(item)
          item = self._inbox.get_nowait()
      except queue.Empty:
        pass
      if not engine.has_work:
        continue
      try:
        events = engine.step()
      except Exception as e:  # the engine is broken: every waiting client hears it
        self.error = e
        for job in {id(j): j for j in self._jobs.values()}.values():
          job.events.put(e)
        self._jobs.clear()
        return
      for event in events:
        job = self._jobs.get(event.request_id)
        if job is None:
          continue
        job.events.put(event)
        if event.finished:
          del self._jobs[event.request_id]
          if not any(j is job for j in self._jobs.values()):
            job.shared_tokens = engine.requests[event.request_id].shared_tokens
            job.events.put(None)  # every sample of the job is done
      self.stats = {'running': engine.num_running, 'queued': engine.num_queued,
                    'kv_bytes_in_use': engine.kv_bytes_in_use()}


def make_server(engine: Engine, *, host: str = '127.0.0.1', port: int = 8000,
                tokenizer: Tokenizer | None = None) -> tuple[ThreadingHTTPServer, EngineLoop]:
  """An HTTP server (not yet serving: call `serve_forever`) and the started engine loop."""
  loop = EngineLoop(engine).start()

  class Handler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def log_message(self, *args):  # quiet: one line per request is too much under load
      pass

    def _send(self, status: int, payload: dict[str, Any]) -> None:
      body = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header('Content-Type', 'application/json')
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def do_GET(self):
      if self.path != '/v1/health':
        return self._send(404, {'error': f'no such path {self.path}; try /v1/health'})
      self._send(200, dict(loop.stats))

    def do_POST(self):
      if self.path != '/v1/generate':
        return self._send(404, {'error': f'no such path {self.path}; try /v1/generate'})
      length = int(self.headers.get('Content-Length') or 0)
      if length > _MAX_BODY_BYTES:
        return self._send(413, {'error': f'the body is over {_MAX_BODY_BYTES} bytes'})
      body = self.rfile.read(length)
      try:
        prompt, params, stream = parse_request(body, tokenizer)
      except BadRequest as e:
        return self._send(400, {'error': str(e)})
      job = loop.submit(prompt, params)
      if stream:
        return self._stream(job)
      outputs = [[] for _ in range(params.n)]
      reasons: list[str | None] = [None] * params.n
      while (event := job.events.get()) is not None:
        if isinstance(event, Exception):
          return self._send(400 if isinstance(event, BadRequest) else 500, {'error': str(event)})
        i = event.request_id - job.request_id
        if event.reason != 'cancelled':
          outputs[i].append(event.token)
        if event.finished:
          reasons[i] = event.reason
      payload = {'outputs': outputs, 'finish_reasons': reasons,
                 'shared_tokens': job.shared_tokens}
      if tokenizer is not None:
        payload['texts'] = [tokenizer.decode(o) for o in outputs]
      self._send(200, payload)

    def _stream(self, job: _Job) -> None:
      first = job.events.get()
      if isinstance(first, Exception):
        return self._send(400 if isinstance(first, BadRequest) else 500, {'error': str(first)})
      self.send_response(200)
      self.send_header('Content-Type', 'application/x-ndjson')
      self.send_header('Transfer-Encoding', 'chunked')
      self.end_headers()
      event = first
      try:
        while event is not None and not isinstance(event, Exception):
          line = json.dumps({'sample': event.request_id - job.request_id, 'token': event.token,
                             'index': event.index, 'finished': event.finished,
                             'reason': event.reason}).encode() + b'\n'
          self.wfile.write(b'%x\r\n%s\r\n' % (len(line), line))
          self.wfile.flush()
          event = job.events.get()
        self.wfile.write(b'0\r\n\r\n')
      except (BrokenPipeError, ConnectionResetError):  # the client left: free its sequences
        loop.cancel(job)

  server = ThreadingHTTPServer((host, port), Handler)
  server.daemon_threads = True
  return server, loop


def main(argv):
  del argv
  import jax.numpy as jnp
  from flax import nnx

  from models.config import get_config
  from models.engine import EngineConfig
  from models.hf_loading import load_hf_checkpoint
  from models.llama import Llama

  if _CHECKPOINT.value:
    model = load_hf_checkpoint(_CHECKPOINT.value, dtype=jnp.dtype(_DTYPE.value))
  else:
    model = Llama(get_config(_MODEL.value), rngs=nnx.Rngs(0), dtype=jnp.dtype(_DTYPE.value))
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
  server, loop = make_server(engine, host=_HOST.value, port=_PORT.value, tokenizer=tokenizer)
  print(f'serving {_CHECKPOINT.value or _MODEL.value} on http://{_HOST.value}:{_PORT.value} '
        f'(POST /v1/generate, GET /v1/health)', flush=True)
  try:
    server.serve_forever()
  finally:
    loop.stop()


if __name__ == '__main__':
  from absl import app, flags

  _MODEL = flags.DEFINE_string('model', 'tiny_gqa', 'model preset (random weights)')
  _CHECKPOINT = flags.DEFINE_string('checkpoint', '', 'HF Llama folder (overrides --model)')
  _TOKENIZER = flags.DEFINE_string('tokenizer', '', 'tokenizer.json or its folder (for "text")')
  _DTYPE = flags.DEFINE_string('dtype', 'float32', 'parameter dtype')
  _HOST = flags.DEFINE_string('host', '127.0.0.1', 'address to listen on')
  _PORT = flags.DEFINE_integer('port', 8000, 'port')
  _NUM_CHUNKS = flags.DEFINE_integer('num_chunks', 512, 'KV pool chunks')
  _CHUNK = flags.DEFINE_integer('chunk_size', 64, 'tokens per chunk')
  _MAX_BATCH = flags.DEFINE_integer('max_batch', 64, 'most live sequences')
  _MAX_LEN = flags.DEFINE_integer('max_sequence_length', 4096, 'longest prompt + generation')
  _OVERLAP = flags.DEFINE_boolean('overlap_decode', False, 'see EngineConfig.overlap_decode')
  app.run(main)
