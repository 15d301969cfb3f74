"""Rollouts for the GRPO toy: sampling completions, a small arithmetic task and its reward.

The sampler is deliberately simple (a full causal forward per new token over a
fixed [B, P + T] buffer, no KV cache): toy completions are a few tokens long.
Real rollouts belong to `models.engine`.

Arithmetic task: prompt `<bos> a + b =` with digits a, b in [0, max_operand];
the target completion is the decimal digits of a + b then `<eos>`. The reward
is the fraction of target positions matched, plus 1 when the whole target is
matched exactly (dense enough for a randomly initialised model to climb).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.attention.training import prefill_layout as pl
from models.kv_cache import DenseKVCache

PAD, BOS, PLUS, EQUALS, EOS = 0, 1, 2, 3, 4
DIGIT0 = 5
VOCAB_SIZE = DIGIT0 + 10


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Sums of two digits; completions of `completion_length` tokens (answer digits + eos)."""

  max_operand: int = 9
  completion_length: int = 3

  def __post_init__(self):
    if not 0 <= self.max_operand <= 9:
      raise ValueError(f'max_operand must be in [0, 9], got {self.max_operand}')
    if self.completion_length < len(str(2 * self.max_operand)) + 1:
      raise ValueError(f'completion_length={self.completion_length} cannot hold the answer and eos')

  def prompts(self, rng: np.random.Generator, num: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompts [num, 5] int32, operands [num, 2])."""
    ops = rng.integers(0, self.max_operand + 1, (num, 2))
    tokens = np.stack([np.full(num, BOS), DIGIT0 + ops[:, 0], np.full(num, PLUS),
                       DIGIT0 + ops[:, 1], np.full(num, EQUALS)], axis=1)
    return tokens.astype(np.int32), ops

  def target(self, a: int, b: int) -> list[int]:
    return [DIGIT0 + int(d) for d in str(a + b)] + [EOS]

  def rewards(self, completions: np.ndarray, ops: np.ndarray, group_size: int) -> np.ndarray:
    """completions [Bp * G, T] -> rewards [Bp, G] float32."""
    out = np.zeros(completions.shape[0], np.float32)
    for r, row in enumerate(completions):
      target = self.target(*ops[r // group_size])
      hits = sum(int(row[i] == x) for i, x in enumerate(target))
      out[r] = hits / len(target) + float(hits == len(target))
    return out.reshape(-1, group_size)


def completion_mask(completions: np.ndarray) -> np.ndarray:
  """[B, T] float32: 1 up to and including the first eos (everything when there is none)."""
  is_eos = completions == EOS
  before = np.cumsum(is_eos, axis=1) - is_eos  # eos tokens strictly before each position
  return (before == 0).astype(np.float32)


def sample_completions(model, prompts, prompt_lengths, group_size: int, length: int, key,
                       temperature: float = 1.0) -> jax.Array:
  """Samples G completions of `length` tokens per prompt: [Bp * G, length] int32."""
  bp, p = prompts.shape
  b = bp * group_size
  tokens = pl.unshared_sequences(prompts, jnp.zeros((b, length), jnp.int32), prompt_lengths,
                                 group_size)
  starts = jnp.repeat(prompt_lengths, group_size)  # [B]: position of the first new token
  positions = jnp.broadcast_to(jnp.arange(p + length, dtype=jnp.int32)[None, :], tokens.shape)
  cache = DenseKVCache.zeros(model.config, b, p + length, dtype=model.dtype)
  rows = jnp.arange(b)

  def step(j, carry):
    tokens, out = carry
    logits, _ = model.forward_naive(tokens, positions, cache)
    logits = logits[rows, starts + j - 1] / temperature  # [B, V]
    new = jax.random.categorical(jax.random.fold_in(key, j), logits).astype(jnp.int32)
    return tokens.at[rows, starts + j].set(new), out.at[:, j].set(new)

  _, out = jax.lax.fori_loop(0, length, step, (tokens, jnp.zeros((b, length), jnp.int32)))
  return out
