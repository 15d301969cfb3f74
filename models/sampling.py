"""Next-token sampling: one implementation for `generate` and the engine.

`SamplingParams` says how a sequence is continued (validated at construction).
On the device, sampling is batched with per-row parameters (`SamplingRows`:
temperature, top-k, top-p, min-p per row), so one compiled step serves a batch
of mixed requests. The distribution of a row is, in this order:

1. logits / temperature (temperature 0: greedy, the argmax of the raw logits), computed as
   (logits - max) / temperature, so a tiny temperature tends to the argmax instead of
   overflowing;
2. top-k: tokens whose scaled logit is below the k-th largest are dropped;
3. top-p: of what is left, renormalized and sorted, a token is kept while the
   mass of strictly more likely tokens is below p (the least likely kept
   value is the cutoff; ties with it are kept);
4. min-p: tokens with probability below min_p * (the largest probability) are
   dropped (the largest is the same before and after 2-3).

Every filter is a threshold on the scaled logit, so ties are kept together.
Log-probs (of the chosen token and the top n) are those of the model:
`log_softmax` of the raw logits, whatever the filters.

Which of those steps a batch needs (`SamplingMode`: greedy, draw, or draw with top-k / top-p)
is known on the host when its rows are built, and rides in `SamplingRows` as static pytree
metadata: a jitted step then compiles only what the mode needs and holds no `lax.cond`, whose
predicate a GPU reads back on the host (the host would wait for the device at every dispatch,
and nothing would overlap). Rows built from traced arrays (mode None) decide on the device.

Random draws use one key per row, `fold_in(fold_in(key(seed), stream), index)`:
a row's draws depend only on its seed, its stream (a request or sequence id)
and the token's index, never on the batch around it.
"""

import collections.abc
import dataclasses
import enum
import math
import numbers
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.validation import token_ids

MAX_TOP_LOGPROBS = 20  # the most top_logprobs a request may ask for
SEED_LIMIT = 2**32  # seeds are in [0, SEED_LIMIT)
# Temperatures are in [0, MAX_TEMPERATURE] (the server's bound): above it the distribution is
# uniform to float32 precision anyway, and 1e39 would be inf on the device.
MAX_TEMPERATURE = 1e6


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a request (or every sequence of `generate`) is continued.

  Attributes:
    max_new_tokens: tokens to generate (fewer after a stop); `generate` takes its own.
    temperature: 0 is greedy; > 0 samples from softmax(logits / temperature), filtered; at
      most MAX_TEMPERATURE (1e6). A tiny temperature (1e-30) draws the argmax, its limit.
    top_k: keep the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose mass reaches p (1: all).
    min_p: drop tokens less likely than min_p times the most likely one (0: none).
    seed: the request's own seed in [0, 2**32): its draws are then the same in any
      engine and batch (None: the engine's or generate's seed, and the request id).
    stop_tokens: ids that end the request (the stop token is returned).
    stop_sequences: token-id sequences; the request ends when its output ends with one
      (the sequence is returned). Matched against generated tokens only.
    logprobs: return the model's log-prob of each chosen token.
    top_logprobs: also return the n most likely (token, log-prob) of each position
      (at most MAX_TOP_LOGPROBS; implies logprobs).
    n: samples of the prompt, each a request of its own (the engine; `generate` takes
      `num_samples`).
  """

  max_new_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  stop_tokens: tuple[int, ...] = ()
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  logprobs: bool = False
  top_logprobs: int = 0
  n: int = 1

  def __post_init__(self):
    def integer(name, low, high=None):
      value = getattr(self, name)
      if not _is_int(value):
        raise ValueError(f'{name} must be an integer, got {value!r}')
      if value < low or (high is not None and value > high):
        bound = f'in [{low}, {high}]' if high is not None else f'>= {low}'
        raise ValueError(f'{name} must be {bound}, got {value}')
      object.__setattr__(self, name, int(value))

    def real(name, low, high, *, open_low=False):
      value = getattr(self, name)
      if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f'{name} must be a finite number, got {value!r}')
      if value < low or value > high or (open_low and value == low):
        bound = f'({low}, {high}]' if open_low else f'[{low}, {high}]'
        raise ValueError(f'{name} must be in {bound}, got {value}')
      object.__setattr__(self, name, float(value))

    integer('max_new_tokens', 1)
    real('temperature', 0.0, MAX_TEMPERATURE)
    integer('top_k', 0)
    real('top_p', 0.0, 1.0, open_low=True)
    real('min_p', 0.0, 1.0)
    if self.seed is not None:
      integer('seed', 0, SEED_LIMIT - 1)
    object.__setattr__(self, 'stop_tokens', token_ids(self.stop_tokens, 'stop_tokens'))
    seqs = self.stop_sequences
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, collections.abc.Sequence):
      raise ValueError(f'stop_sequences must be a sequence of token-id sequences, got {seqs!r}')
    object.__setattr__(self, 'stop_sequences', tuple(
        token_ids(s, f'stop_sequences[{i}]', allow_empty=False) for i, s in enumerate(seqs)))
    if not isinstance(self.logprobs, (bool, np.bool_)):
      raise ValueError(f'logprobs must be True or False, got {self.logprobs!r}')
    object.__setattr__(self, 'logprobs', bool(self.logprobs))
    integer('top_logprobs', 0, MAX_TOP_LOGPROBS)
    integer('n', 1)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def wants_logprobs(self) -> bool:
    return self.logprobs or self.top_logprobs > 0

  def stops(self, output: Sequence[int]) -> bool:
    """Whether an output (generated tokens) ends with a stop token or a stop sequence."""
    if not output:
      return False
    if output[-1] in self.stop_tokens:
      return True
    return any(len(output) >= len(s) and tuple(output[-len(s):]) == s
               for s in self.stop_sequences)


class SamplingMode(enum.Enum):
  """What a batch's draw computes (static: each mode is its own compiled program)."""

  GREEDY = 'greedy'  # every row takes the argmax
  DRAW = 'draw'  # some row samples; none of those uses top-k or top-p (no sort)
  FILTER = 'filter'  # some sampling row uses top-k or top-p (the sorted cutoff)

  @classmethod
  def of(cls, temperature, top_k, top_p) -> 'SamplingMode':
    """The mode of host rows (numpy or lists of the per-row parameters)."""
    sampling = np.asarray(temperature) > 0
    if not sampling.any():
      return cls.GREEDY
    filtered = (np.asarray(top_k) > 0) | (np.asarray(top_p) < 1)
    return cls.FILTER if (sampling & filtered).any() else cls.DRAW

  def serves(self, needed: 'SamplingMode') -> bool:
    """Whether a step compiled in this mode draws a batch that needs `needed` (FILTER draws
    any batch, DRAW a greedy one too, GREEDY only greedy ones)."""
    order = (SamplingMode.GREEDY, SamplingMode.DRAW, SamplingMode.FILTER)
    return order.index(self) >= order.index(needed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
  """Per-row sampling parameters of a batch (host numpy or device arrays, all [B]).

  `mode` is static (part of the pytree's structure): `of` and `full` set it from the host
  values; None (rows from traced arrays) leaves the choice to the device.
  """

  temperature: Any  # [B] float32, 0: greedy
  top_k: Any  # [B] int32, 0: off
  top_p: Any  # [B] float32
  min_p: Any  # [B] float32
  mode: SamplingMode | None = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    if self.mode is not None and not isinstance(self.mode, SamplingMode):
      raise ValueError(f'mode must be a SamplingMode or None, got {self.mode!r}')
    host = all(isinstance(x, np.ndarray) for x in (self.temperature, self.top_k, self.top_p))
    if self.mode is not None and host:  # a mode that would drop some row's draw or filter
      needed = SamplingMode.of(self.temperature, self.top_k, self.top_p)
      if not self.mode.serves(needed):
        raise ValueError(f'mode {self.mode.name} cannot draw these rows, which need '
                         f'{needed.name} (or a mode above it)')

  @classmethod
  def of(cls, params: Sequence[SamplingParams], size: int | None = None) -> 'SamplingRows':
    """Host arrays of the rows' parameters, padded to `size` rows with greedy rows."""
    size = len(params) if size is None else size
    t, k = np.zeros(size, np.float32), np.zeros(size, np.int32)
    p, m = np.ones(size, np.float32), np.zeros(size, np.float32)
    if params:
      n = len(params)
      t[:n] = [x.temperature for x in params]
      k[:n] = [x.top_k for x in params]
      p[:n] = [x.top_p for x in params]
      m[:n] = [x.min_p for x in params]
    return cls(t, k, p, m, SamplingMode.of(t, k, p))

  @classmethod
  def full(cls, params: SamplingParams, size: int) -> 'SamplingRows':
    """Every row the same (device arrays; usable under jit with a static `params`)."""
    return cls(jnp.full((size,), params.temperature, jnp.float32),
               jnp.full((size,), params.top_k, jnp.int32),
               jnp.full((size,), params.top_p, jnp.float32),
               jnp.full((size,), params.min_p, jnp.float32),
               SamplingMode.of(params.temperature, params.top_k, params.top_p))


class Sampled(NamedTuple):
  """A batch's draws: tokens [B] int32, their log-probs [B], and the top n [B, n] (n may be 0)."""

  tokens: jax.Array
  logprobs: jax.Array
  top_tokens: jax.Array
  top_logprobs: jax.Array


# ---------------------------------------------------------------------------
# Keys


def row_keys(key: jax.Array, sequence_ids: jax.Array, step) -> jax.Array:
  """One key per row: fold_in(fold_in(key, sequence_id), step)."""
  return jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(key, s), step))(sequence_ids)


def request_keys(seeds: jax.Array, streams: jax.Array, indices: jax.Array) -> jax.Array:
  """One key per row: fold_in(fold_in(key(seed), stream), index); seeds [B] uint32.

  With the same seed, `row_keys(jax.random.key(seed), streams, index)` gives the same keys.
  """
  return jax.vmap(lambda s, r, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), i))(
      seeds, streams, indices)


# ---------------------------------------------------------------------------
# The distribution


def filtered_logits(logits: jax.Array, rows: SamplingRows) -> jax.Array:
  """logits [B, V] -> scaled logits [B, V] float32 ((logits - row max) / temperature), -inf
  where top-k, top-p or min-p drop.

  Rows with temperature 0 are scaled by 1 (they take the argmax anyway). The sort that
  top-k and top-p need runs only when some row uses them (`rows.mode` FILTER, or decided on
  the device when the mode is None).
  """
  t = jnp.asarray(rows.temperature, jnp.float32)
  top_k = jnp.asarray(rows.top_k, jnp.int32)
  top_p = jnp.asarray(rows.top_p, jnp.float32)
  min_p = jnp.asarray(rows.min_p, jnp.float32)
  x = logits.astype(jnp.float32)
  # Shifted so the max is 0 before the division: a tiny t sends the rest to -inf (the argmax,
  # its limit) instead of overflowing every logit to +-inf (NaN draws). t is kept normal: a
  # subnormal one may be flushed to 0 in the division (0 / 0).
  top = jnp.max(x, axis=-1, keepdims=True)
  scale = jnp.where(t > 0, jnp.maximum(t, np.finfo(np.float32).tiny), 1.0)
  x = (x - jnp.where(jnp.isfinite(top), top, 0)) / scale[:, None]
  v = x.shape[-1]
  top = jnp.max(x, axis=-1, keepdims=True)
  # min-p: p >= min_p * p_max  <=>  x >= x_max + log(min_p)
  floor = jnp.where(min_p > 0, top[:, 0] + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)

  def sorted_cutoff(x):
    ordered = jnp.sort(x, axis=-1)[:, ::-1]  # descending
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)  # [B, 1]
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)  # top-k, ties kept
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    # top_p = 1 keeps all (a float cumsum may pass 1 before the last tokens)
    within = (before < top_p[:, None]) | (top_p[:, None] >= 1)
    kept = jnp.where(within & (ordered > -jnp.inf), ordered, jnp.inf)
    return jnp.maximum(kth[:, 0], jnp.min(kept, axis=-1))

  def no_cutoff(x):
    return jnp.full(x.shape[:1], -jnp.inf, jnp.float32)

  if rows.mode is None:
    needs_sort = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1))
    cutoff = jax.lax.cond(needs_sort, sorted_cutoff, no_cutoff, x)
  else:
    cutoff = sorted_cutoff(x) if rows.mode is SamplingMode.FILTER else no_cutoff(x)
  return jnp.where(x >= jnp.maximum(cutoff, floor)[:, None], x, -jnp.inf)


def draw(logits: jax.Array, keys: jax.Array, rows: SamplingRows) -> jax.Array:
  """Tokens [B] int32 from logits [B, V]: argmax where temperature is 0, else a draw.

  The filtered distribution and the draws are computed only when some row samples
  (`rows.mode` not GREEDY, or decided on the device when the mode is None).
  """
  if logits.ndim != 2 or keys.shape[:1] != logits.shape[:1]:
    raise ValueError(f'logits must be [B, V] and keys [B], got {logits.shape} and {keys.shape}')
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  t = jnp.asarray(rows.temperature, jnp.float32)

  def drawn(logits):
    x = filtered_logits(logits, rows)
    tokens = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
    return jnp.where(t > 0, tokens, greedy)

  if rows.mode is None:
    return jax.lax.cond(jnp.any(t > 0), drawn, lambda _: greedy, logits)
  return greedy if rows.mode is SamplingMode.GREEDY else drawn(logits)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log p(token) under the model (log-softmax of the raw logits): [B, V], [B] -> [B]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def sample_batch(logits: jax.Array, keys: jax.Array, rows: SamplingRows, *,
                 top_logprobs: int = 0) -> Sampled:
  """Draws a token per row and its model log-prob, and the `top_logprobs` most likely tokens.

  logits [B, V]; keys [B]; rows: per-row parameters [B]; top_logprobs: static n.
  """
  tokens = draw(logits, keys, rows)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  if top_logprobs:
    top_values, top_ids = jax.lax.top_k(logp, top_logprobs)
  else:
    top_values = jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
  return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_values)


# ---------------------------------------------------------------------------
# Uniform parameters (one SamplingParams for every row)


def processed_logits(logits: jax.Array, config: SamplingParams) -> jax.Array:
  """logits [B, V] -> the sampling distribution's logits (-inf outside top-k/top-p/min-p)."""
  if config.greedy:
    raise ValueError('processed_logits needs temperature > 0 (greedy takes the argmax)')
  return filtered_logits(logits, SamplingRows.full(config, logits.shape[0]))


def sample(logits: jax.Array, keys: jax.Array, config: SamplingParams) -> jax.Array:
  """logits [B, V], keys [B] -> tokens [B] int32, every row with `config`."""
  return draw(logits, keys, SamplingRows.full(config, logits.shape[0]))
