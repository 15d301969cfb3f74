"""The server's requests and answers, framework-free: `/v1/generate` and OpenAI's `/v1/completions`.

Parsing turns a request body into `Work` (prompts as token ids, `SamplingParams`,
what to stream and where to stop) or raises `BadRequest` naming the field.
Everything the engine would refuse later (ids outside the vocabulary, a prompt
that can never fit, a non-finite number) is refused here, so a request reaches
the engine only when it is well formed.

`Choice` follows one sample's tokens into what a client sees: text deltas
(held back while they might be the start of a stop string, or an incomplete
UTF-8 character), stops that the server applies (OpenAI `stop` strings and
token sequences), log-probs, and the finish reason.

Limits, each checked before the work it bounds (so what a request carries costs time
linear in its size, and the size is bounded): prompts of at most `max_sequence_length`
token ids, text prompts of at most `Limits.max_text_chars` characters (checked before
tokenizing), `max_prompts` prompts, `max_samples` samples (prompts x n) and `max_tokens`
tokens (each prompt plus n x its most new tokens) per request; `MAX_STOP_STRINGS` stops of
at most `MAX_STOP_CHARS` characters or `MAX_STOP_IDS` ids, `_MAX_STOP_TOKENS` stop tokens;
`MAX_MESSAGES` chat messages; a `model` that is not the served model's name is refused.

Sampling fields map onto `SamplingParams` (see INTERFACES B). A field the
installed `SamplingParams` does not have yet is refused with a 400 naming it
when a request sets it to anything but its default.
"""

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from models.engine import SamplingParams
from models.server_text import (
    MAX_STOP_CHARS, MAX_STOP_IDS, MAX_STOP_STRINGS, HoldBack, IncrementalText, StopFinder,
)
from models.tokenizer import Tokenizer

# Defaults of the agreed SamplingParams fields; a field missing from the installed class is
# accepted only at its default.
_AGREED_DEFAULTS = {'top_k': 0, 'top_p': 1.0, 'min_p': 0.0, 'seed': None, 'stop_sequences': (),
                    'logprobs': False, 'top_logprobs': 0}
_SEED_MODULUS = 2**32  # seeds are taken modulo this (jax keys take 32-bit seeds everywhere)
MAX_TOP_LOGPROBS = 5  # OpenAI's limit on `logprobs`
_MAX_STOPS = MAX_STOP_STRINGS
_MAX_STOP_TOKENS = 1024  # ids of /v1/generate's stop_tokens
TEXT_CHARS_PER_TOKEN = 32  # a text prompt over this many characters per possible token is refused
_MAX_MODEL_CHARS = 256
_INF_LOGPROB = -9999.0  # JSON has no -inf


def supported_params() -> frozenset[str]:
  """Fields of the installed `SamplingParams`."""
  return frozenset(f.name for f in dataclasses.fields(SamplingParams))


class BadRequest(ValueError):
  """A request the server refuses: its status (400 unless said) and the field at fault."""

  def __init__(self, field: str, message: str, status: int = 400):
    super().__init__(message)
    self.field = field
    self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the engine behind the server can take (checked before it sees a request)."""

  vocab_size: int
  max_sequence_length: int
  max_batch: int
  max_prompts: int = 64  # prompts in one /v1/completions request
  max_samples: int | None = None  # prompts x n of one request (None: max_batch)
  max_tokens: int | None = None  # sum over prompts of prompt + n x max tokens (None: no cap)
  model_names: tuple[str, ...] = ()  # what `model` may name (empty: anything, not echoed)

  @property
  def max_text_chars(self) -> int:
    """Longest text prompt, checked before tokenizing (tokens rarely hold over 32 characters)."""
    return TEXT_CHARS_PER_TOKEN * self.max_sequence_length


@dataclasses.dataclass(frozen=True)
class Work:
  """One HTTP request's work: a request to the engine per prompt, and how to answer."""

  prompts: tuple[tuple[int, ...], ...]
  params: SamplingParams
  stream: bool
  stop_texts: tuple[str, ...] = ()  # applied by the server on the decoded text
  stop_ids: tuple[tuple[int, ...], ...] = ()  # applied by the server on token ids
  top_logprobs: int | None = None  # OpenAI `logprobs` (None: not asked)
  include_usage: bool = False  # OpenAI stream_options.include_usage
  model: str | None = None


# ---- JSON and field checks --------------------------------------------------------------------


def load_json_object(body: bytes) -> dict[str, Any]:
  """The body as a JSON object; BadRequest naming `body` otherwise (never another exception)."""
  try:
    req = json.loads(body)
  except RecursionError:
    raise BadRequest('body', 'the body is JSON nested too deeply') from None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise BadRequest('body', f'the body must be JSON: {e}') from None
  if not isinstance(req, dict):
    raise BadRequest('body', 'the body must be a JSON object')
  return req


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _integer(req, name, default, low, high) -> int:
  value = req.get(name, default)
  if not _is_int(value) or not low <= value <= high:
    raise BadRequest(name, f'"{name}" must be an integer in [{low}, {high}], got {_show(value)}')
  return value


def _number(req, name, default, low, high, *, open_low=False) -> float:
  value = req.get(name, default)
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and (low < value if open_low else low <= value) and value <= high)
  if not ok:
    interval = f'{"(" if open_low else "["}{low}, {high}]'
    raise BadRequest(name, f'"{name}" must be a finite number in {interval}, got {_show(value)}')
  return float(value)


def _boolean(req, name, default) -> bool:
  value = req.get(name, default)
  if not isinstance(value, bool):
    raise BadRequest(name, f'"{name}" must be true or false, got {_show(value)}')
  return value


def _show(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def _text(value, name, max_chars: int) -> str:
  if not isinstance(value, str) or not value:
    raise BadRequest(name, f'"{name}" must be a non-empty string')
  if len(value) > max_chars:
    raise BadRequest(name, f'"{name}" has {len(value)} characters; at most {max_chars} are taken')
  try:
    value.encode('utf-8')
  except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON)
    raise BadRequest(name, f'"{name}" holds a lone UTF-16 surrogate: not text') from None
  return value


def _token_ids(value, name, vocab_size, max_len) -> tuple[int, ...]:
  if not isinstance(value, list) or not value:
    raise BadRequest(name, f'"{name}" must be a non-empty list of integer token ids')
  if len(value) > max_len:  # before looking at every id
    raise BadRequest(name, f'"{name}" has {len(value)} token ids; at most {max_len} are taken')
  if not all(_is_int(t) for t in value):
    raise BadRequest(name, f'"{name}" must be a non-empty list of integer token ids')
  bad = next((t for t in value if not 0 <= t < vocab_size), None)
  if bad is not None:
    raise BadRequest(name, f'"{name}" token ids must be in [0, {vocab_size}), got {_show(bad)}')
  return tuple(value)


def _check_room(prompts, limits, prompt_field) -> int:
  """Tokens the longest prompt leaves for generation (>= 1; BadRequest naming the prompt)."""
  room = limits.max_sequence_length - max(len(p) for p in prompts)
  if room < 1:
    raise BadRequest(prompt_field, f'a prompt of {max(len(p) for p in prompts)} tokens leaves no '
                     f'room under max_sequence_length={limits.max_sequence_length}')
  return room


def _check_fits(prompts, max_new_tokens, n, limits, *, length_field, n_field, prompt_field):
  room = _check_room(prompts, limits, prompt_field)
  if max_new_tokens > room:
    raise BadRequest(length_field, f'prompt ({limits.max_sequence_length - room}) + '
                     f'"{length_field}" ({max_new_tokens}) exceed max_sequence_length='
                     f'{limits.max_sequence_length}')
  if n > limits.max_batch:
    raise BadRequest(n_field, f'"{n_field}" ({n}) exceeds the engine\'s max_batch='
                     f'{limits.max_batch}')
  max_samples = limits.max_samples or limits.max_batch
  if n * len(prompts) > max_samples:
    raise BadRequest(n_field, f'{len(prompts)} prompts x "{n_field}" ({n}) = {n * len(prompts)} '
                     f'samples; at most {max_samples} per request')
  tokens = sum(len(p) + n * max_new_tokens for p in prompts)
  if limits.max_tokens is not None and tokens > limits.max_tokens:
    raise BadRequest(length_field, f'the request may hold {tokens} tokens (each prompt + "{n_field}"'
                     f' x "{length_field}"); at most {limits.max_tokens} per request')


def make_params(names: dict[str, str], **values) -> SamplingParams:
  """SamplingParams of engine-field values (`names`: engine field -> request field, in errors)."""
  have = supported_params()
  kwargs = {}
  for key, value in values.items():
    if key in have:
      kwargs[key] = value
    elif value != _AGREED_DEFAULTS.get(key, value):
      field = names.get(key, key)
      raise BadRequest(field, f'"{field}" is not supported by this engine build yet')
  try:
    return SamplingParams(**kwargs)
  except (ValueError, TypeError, OverflowError) as e:  # the engine's own checks
    field = next((names.get(k, k) for k in kwargs if k in str(e)), 'body')
    raise BadRequest(field, f'"{field}": {e}') from None


def _eos_stops(stop_tokens, tokenizer) -> tuple[int, ...]:
  if tokenizer is None:
    return tuple(stop_tokens)
  return tuple(stop_tokens) + tuple(t for t in tokenizer.eos_ids if t not in stop_tokens)


# ---- /v1/generate -----------------------------------------------------------------------------

GENERATE_FIELDS = frozenset({
    'prompt', 'text', 'max_new_tokens', 'temperature', 'top_k', 'top_p', 'min_p', 'seed', 'n',
    'stop_tokens', 'stop_sequences', 'logprobs', 'top_logprobs', 'stream'})


def parse_generate(body: bytes, tokenizer: Tokenizer | None, limits: Limits) -> Work:
  """A /v1/generate body -> Work (one prompt); raises BadRequest naming the field."""
  req = load_json_object(body or b'{}')
  unknown = sorted(set(req) - GENERATE_FIELDS)
  if unknown:
    raise BadRequest(unknown[0], f'unknown field "{unknown[0]}" (of {unknown}); expected some of '
                     f'{sorted(GENERATE_FIELDS)}')
  if ('prompt' in req) == ('text' in req):
    raise BadRequest('prompt', 'give exactly one of "prompt" (token ids) and "text"')
  if 'text' in req:
    if tokenizer is None:
      raise BadRequest('text', '"text" needs a server started with a tokenizer; send "prompt" ids')
  field = 'text' if 'text' in req else 'prompt'
  max_new_tokens = _integer(req, 'max_new_tokens', 16, 1, limits.max_sequence_length)
  n = _integer(req, 'n', 1, 1, limits.max_batch)
  stops = req.get('stop_tokens', [])
  if (not isinstance(stops, list) or len(stops) > _MAX_STOP_TOKENS
      or not all(_is_int(t) and 0 <= t < limits.vocab_size for t in stops)):
    raise BadRequest('stop_tokens', f'"stop_tokens" must be a list of at most {_MAX_STOP_TOKENS} '
                     f'token ids in [0, {limits.vocab_size})')
  sequences = _stop_id_lists(req.get('stop_sequences', []), 'stop_sequences', limits.vocab_size)
  if field == 'text':  # the size check comes before the tokenizer's work
    prompt = _encode(_text(req['text'], 'text', limits.max_text_chars), tokenizer, 'text', limits)
  else:
    prompt = _token_ids(req['prompt'], 'prompt', limits.vocab_size, limits.max_sequence_length)
  _check_fits([prompt], max_new_tokens, n, limits, length_field='max_new_tokens', n_field='n',
              prompt_field=field)
  seed = req.get('seed')
  if seed is not None:
    seed = _integer(req, 'seed', None, -2**63, 2**63 - 1) % _SEED_MODULUS
  params = make_params(
      {}, max_new_tokens=max_new_tokens, n=n,
      temperature=_number(req, 'temperature', 0.0, 0, 1e6),
      top_k=_integer(req, 'top_k', 0, 0, limits.vocab_size),
      top_p=_number(req, 'top_p', 1.0, 0, 1, open_low=True),
      min_p=_number(req, 'min_p', 0.0, 0, 1), seed=seed,
      stop_tokens=_eos_stops(stops, tokenizer), stop_sequences=sequences,
      logprobs=_boolean(req, 'logprobs', False),
      top_logprobs=_integer(req, 'top_logprobs', 0, 0, MAX_TOP_LOGPROBS))
  return Work(prompts=(prompt,), params=params, stream=_boolean(req, 'stream', False))


def _encode(text, tokenizer, field, limits) -> tuple[int, ...]:
  ids = tuple(tokenizer.encode(text))
  if not ids:
    raise BadRequest(field, f'"{field}" encodes to no tokens')
  if max(ids) >= limits.vocab_size:  # a tokenizer larger than the model
    raise BadRequest(field, f'"{field}" encodes to token ids outside the model\'s vocabulary '
                     f'[0, {limits.vocab_size})')
  return ids


def _stop_id_lists(value, name, vocab_size) -> tuple[tuple[int, ...], ...]:
  if not isinstance(value, list) or len(value) > _MAX_STOPS:
    raise BadRequest(name, f'"{name}" must be a list of at most {_MAX_STOPS} token-id lists')
  return tuple(_token_ids(s, name, vocab_size, MAX_STOP_IDS) for s in value)


# ---- /v1/completions (OpenAI) -----------------------------------------------------------------

COMPLETION_FIELDS = frozenset({
    'model', 'prompt', 'max_tokens', 'temperature', 'top_p', 'top_k', 'min_p', 'n', 'stream',
    'stream_options', 'logprobs', 'echo', 'stop', 'seed', 'best_of', 'presence_penalty',
    'frequency_penalty', 'logit_bias', 'suffix', 'user'})
# Fields accepted only at their OpenAI default (null counts as the default).
_UNSUPPORTED = {'echo': False, 'presence_penalty': 0, 'frequency_penalty': 0, 'logit_bias': {},
                'suffix': None}


def parse_completion(body: bytes, tokenizer: Tokenizer | None, limits: Limits) -> Work:
  """An OpenAI /v1/completions body -> Work; raises BadRequest naming the field."""
  req = load_json_object(body)
  unknown = sorted(set(req) - COMPLETION_FIELDS)
  if unknown:
    raise BadRequest(unknown[0], f'unknown field "{unknown[0]}" (of {unknown}); this server '
                     f'takes {sorted(COMPLETION_FIELDS)}')
  req = {k: v for k, v in req.items() if v is not None}  # OpenAI clients send null for unset
  for name, default in _UNSUPPORTED.items():
    if name in req and req[name] != default:
      raise BadRequest(name, f'"{name}" is not supported (only {json.dumps(default)})')
  model = check_model(req.get('model'), limits)
  if 'prompt' not in req:
    raise BadRequest('prompt', '"prompt" is required: text, token ids, or a list of either')
  work = _sampled_work(req, lambda: _completion_prompts(req['prompt'], tokenizer, limits),
                       tokenizer, limits, prompt_field='prompt', length_field='max_tokens')
  return dataclasses.replace(work, model=model)


def _sampled_work(req, prompts, tokenizer, limits, *, prompt_field, length_field) -> Work:
  """The OpenAI sampling fields of `req` (completions and chat) around `prompts()`, called
  after the cheap checks."""
  n = _integer(req, 'n', 1, 1, limits.max_batch)
  if 'best_of' in req and _integer(req, 'best_of', n, n, n) != n:
    raise BadRequest('best_of', '"best_of" must equal "n"')
  stop_texts, stop_ids = _completion_stops(req.get('stop', []), tokenizer, limits)
  prompts = prompts()
  room = _check_room(prompts, limits, prompt_field)
  max_tokens = _integer(req, length_field, 16, 1, room)
  _check_fits(prompts, max_tokens, n, limits, length_field=length_field, n_field='n',
              prompt_field=prompt_field)
  seed = req.get('seed')
  if seed is not None:
    seed = _integer(req, 'seed', None, -2**63, 2**63 - 1) % _SEED_MODULUS
  top = req.get('logprobs')
  if top is not None:
    top = _integer(req, 'logprobs', 0, 0, MAX_TOP_LOGPROBS)
  stream = _boolean(req, 'stream', False)
  include_usage = False
  if 'stream_options' in req:
    options = req['stream_options']
    if not stream or not isinstance(options, dict) or set(options) - {'include_usage'}:
      raise BadRequest('stream_options', '"stream_options" goes with "stream": true and takes '
                       '{"include_usage": bool}')
    include_usage = _boolean(options, 'include_usage', False)
  params = make_params(
      {'max_new_tokens': length_field, 'top_logprobs': 'logprobs', 'logprobs': 'logprobs'},
      max_new_tokens=max_tokens, n=n,
      temperature=_number(req, 'temperature', 1.0, 0, 1e6),
      top_p=_number(req, 'top_p', 1.0, 0, 1, open_low=True),
      top_k=_integer(req, 'top_k', 0, 0, limits.vocab_size),
      min_p=_number(req, 'min_p', 0.0, 0, 1), seed=seed,
      stop_tokens=_eos_stops((), tokenizer), logprobs=top is not None, top_logprobs=top or 0,
      # The server applies `stop` itself (`Choice`); the engine also stops early where it can.
      **({'stop_sequences': stop_ids} if 'stop_sequences' in supported_params() else {}))
  return Work(prompts=prompts, params=params, stream=stream, stop_texts=stop_texts,
              stop_ids=stop_ids, top_logprobs=top, include_usage=include_usage)


CHAT_FIELDS = frozenset({
    'model', 'messages', 'max_tokens', 'max_completion_tokens', 'temperature', 'top_p', 'top_k',
    'min_p', 'n', 'stream', 'stream_options', 'stop', 'seed', 'logprobs', 'presence_penalty',
    'frequency_penalty', 'logit_bias', 'user'})
_CHAT_ROLES = ('system', 'user', 'assistant')
MAX_MESSAGES = 256


def parse_chat(body: bytes, tokenizer: Tokenizer | None, limits: Limits) -> Work:
  """An OpenAI /v1/chat/completions body -> Work (the messages under the model's chat
  template); raises BadRequest naming the field."""
  req = load_json_object(body)
  unknown = sorted(set(req) - CHAT_FIELDS)
  if unknown:
    raise BadRequest(unknown[0], f'unknown field "{unknown[0]}" (of {unknown}); this server '
                     f'takes {sorted(CHAT_FIELDS)}')
  req = {k: v for k, v in req.items() if v is not None}
  for name, default in (*_UNSUPPORTED.items(), ('logprobs', False)):
    if name in req and req[name] != default:
      raise BadRequest(name, f'"{name}" is not supported here (only {json.dumps(default)})')
  req.pop('logprobs', None)
  req['model'] = check_model(req.get('model'), limits)
  if 'max_completion_tokens' in req:
    req['max_tokens'] = req.pop('max_completion_tokens')
  messages = req.get('messages')
  if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
    raise BadRequest('messages', f'"messages" must be a list of 1 to {MAX_MESSAGES} '
                     '{"role", "content"} objects')
  for i, m in enumerate(messages):
    if (not isinstance(m, dict) or set(m) - {'role', 'content', 'name'}
        or m.get('role') not in _CHAT_ROLES or not isinstance(m.get('content'), str)):
      raise BadRequest('messages', f'"messages"[{i}] must be {{"role": one of {_CHAT_ROLES}, '
                       f'"content": text}}')
  if sum(len(m['content']) for m in messages) > limits.max_text_chars:
    raise BadRequest('messages', f'the messages are over {limits.max_text_chars} characters')
  if tokenizer is None or getattr(tokenizer, 'chat_template', None) is None:
    raise BadRequest('messages', 'chat needs a server whose tokenizer has a chat template; use '
                     '/v1/completions')

  def prompt():
    try:
      text = tokenizer.apply_chat_template(
          [{'role': m['role'], 'content': m['content']} for m in messages])
    except ValueError as e:
      raise BadRequest('messages', f'the chat template refused the messages: {e}') from None
    ids = tuple(tokenizer.encode(text, add_bos=False))
    if max(ids) >= limits.vocab_size:
      raise BadRequest('messages', 'the messages encode to token ids outside the model\'s '
                       f'vocabulary [0, {limits.vocab_size})')
    return (ids,)

  work = _sampled_work(req, prompt, tokenizer, limits, prompt_field='messages',
                       length_field='max_tokens')
  return dataclasses.replace(work, model=req.get('model'))


def check_model(model, limits: Limits) -> str | None:
  """`model` if it names the served model (one of `limits.model_names`), else BadRequest."""
  if model is None:
    return None
  if not isinstance(model, str):
    raise BadRequest('model', '"model" must be a string')
  if limits.model_names and model not in limits.model_names:
    raise BadRequest('model', f'"model" {_show(model[:_MAX_MODEL_CHARS])} is not served here; '
                     f'this server serves {list(limits.model_names)}', 404)
  if len(model) > _MAX_MODEL_CHARS:
    raise BadRequest('model', f'"model" is over {_MAX_MODEL_CHARS} characters')
  return model


def _completion_prompts(value, tokenizer, limits) -> tuple[tuple[int, ...], ...]:
  def one(p):
    if isinstance(p, str):
      if tokenizer is None:
        raise BadRequest('prompt', 'text prompts need a server started with a tokenizer; send '
                         'token ids')
      return _encode(_text(p, 'prompt', limits.max_text_chars), tokenizer, 'prompt', limits)
    return _token_ids(p, 'prompt', limits.vocab_size, limits.max_sequence_length)

  if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])):
    return (one(value),)
  if not isinstance(value, list) or not value:
    raise BadRequest('prompt', '"prompt" must be text, token ids, or a non-empty list of either')
  if len(value) > limits.max_prompts:
    raise BadRequest('prompt', f'at most {limits.max_prompts} prompts per request, got '
                     f'{len(value)}')
  return tuple(one(p) for p in value)


def _completion_stops(value, tokenizer, limits):
  """OpenAI `stop`: a string, strings, token ids (one sequence) or token-id lists."""
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, list):
    raise BadRequest('stop', f'"stop" must be a string, a list of at most {_MAX_STOPS} strings '
                     f'or token-id lists, or one token-id list')
  if value and _is_int(value[0]):  # one token-id sequence
    value = [value]
  if len(value) > _MAX_STOPS:
    raise BadRequest('stop', f'"stop" holds {len(value)} stops; at most {_MAX_STOPS}')
  texts, ids = [], []
  for s in value:
    if isinstance(s, str):
      if tokenizer is None:
        raise BadRequest('stop', '"stop" strings need a server started with a tokenizer; send '
                         'token-id lists')
      texts.append(_text(s, 'stop', MAX_STOP_CHARS))
    else:
      ids.append(_token_ids(s, 'stop', limits.vocab_size, MAX_STOP_IDS))
  return tuple(texts), tuple(ids)


# ---- following a sample -----------------------------------------------------------------------


def finite(x: float | None) -> float | None:
  """A log-prob JSON can hold (-inf -> -9999.0)."""
  if x is None:
    return None
  x = float(x)
  return x if math.isfinite(x) else _INF_LOGPROB


class Choice:
  """One sample as a client sees it: tokens, text, log-probs, finish reason.

  `add` takes the sample's engine events in order and returns True when a stop
  that the server applies ends the sample early (the caller then cancels it in
  the engine; later events are ignored). Stop strings and stop sequences are
  cut from the output, as OpenAI does; the engine's stop tokens (EOS) stay in
  `tokens` (decoding skips special tokens). Per token it does work bounded by
  the stop limits, whatever the length of the text (see `models.server_text`).
  """

  def __init__(self, tokenizer: Tokenizer | None, *, stop_texts: Sequence[str] = (),
               stop_ids: Sequence[Sequence[int]] = ()):
    self.tokenizer = tokenizer
    self.stop_texts = tuple(stop_texts)
    self.stop_ids = tuple(tuple(s) for s in stop_ids)
    self.tokens: list[int] = []
    self.logprobs: list[float | None] = []
    self.top_logprobs: list[tuple[tuple[int, float], ...] | None] = []
    self.finish_reason: str | None = None
    self._decoded = IncrementalText(tokenizer) if tokenizer is not None else None
    self._stops = StopFinder(self.stop_texts)
    self._hold_back = HoldBack(self.stop_texts)
    self._cut: str | None = None  # the text up to a stop string, once found
    self._sent = 0  # characters of text already handed out by `delta`
    self._sent_tokens = 0

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  def add(self, event) -> bool:
    if self.finished:
      return False
    if event.token >= 0 and event.reason != 'cancelled':
      self.tokens.append(int(event.token))
      self.logprobs.append(getattr(event, 'logprob', None))
      self.top_logprobs.append(getattr(event, 'top_logprobs', None))
      if self._hits_stop(int(event.token), event.finished):
        self.finish_reason = 'stop'
        return not event.finished
    if event.finished:
      self.finish_reason = event.reason or 'stop'
      if self._decoded is not None and self._cut is None:
        self._decoded.flush()
    return False

  def _hits_stop(self, token: int, last: bool) -> bool:
    for seq in self.stop_ids:
      if len(self.tokens) >= len(seq) and tuple(self.tokens[-len(seq):]) == seq:
        del self.tokens[-len(seq):], self.logprobs[-len(seq):], self.top_logprobs[-len(seq):]
        return True
    if self._decoded is None:
      return False
    self._decoded.add(token)
    if last:
      self._decoded.flush()
    at = self._stops.find(self._decoded.text)
    if at is not None:
      self._cut = self._decoded.text[:at]
      return True
    return False

  @property
  def text(self) -> str:
    if self._cut is not None:
      return self._cut
    return self._decoded.text if self._decoded is not None else ''

  def delta(self) -> tuple[str, int, int]:
    """(new text that is safe to send, first and end index of the tokens not yet handed out)."""
    text = self.text
    end = len(text)
    if not self.finished:
      end -= self._hold_back(text)
    new = text[self._sent:end] if end > self._sent else ''
    self._sent = max(self._sent, end)
    start, self._sent_tokens = self._sent_tokens, len(self.tokens)
    return new, start, len(self.tokens)

  def token_text(self, token: int) -> str:
    if self.tokenizer is None:
      return f'token_id:{token}'
    return self.tokenizer.decode([token], skip_special_tokens=False)

  def logprobs_json(self, start: int = 0, end: int | None = None, *, offset: int = 0,
                    top: int = 0) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object for tokens [start, end)."""
    end = len(self.tokens) if end is None else end
    tokens = [self.token_text(t) for t in self.tokens[start:end]]
    offsets, at = [], offset
    for t in tokens:
      offsets.append(at)
      at += len(t)
    tops = None
    if top:
      tops = []
      for entry in self.top_logprobs[start:end]:
        tops.append({self.token_text(t): finite(lp) for t, lp in (entry or ())[:top]})
    return {'tokens': tokens, 'token_logprobs': [finite(x) for x in self.logprobs[start:end]],
            'top_logprobs': tops, 'text_offset': offsets}


def openai_error(err: BadRequest) -> dict[str, Any]:
  kind = 'invalid_request_error' if err.status < 500 else 'server_error'
  return {'error': {'message': str(err), 'type': kind, 'param': err.field, 'code': err.status}}


def plain_error(err: BadRequest) -> dict[str, Any]:
  return {'error': str(err), 'field': err.field}
