"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), one key per row.

Row keys are `fold_in(fold_in(seed_key, sequence_id), step)`, so a sequence's
random draws do not depend on its row in the batch: the tree path and the
naive path sample the same tokens from the same logits.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick the next token.

  Attributes:
    temperature: 0 is greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {self.top_k}')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def processed_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """logits [B, V] float32 -> the sampling distribution's logits (-inf outside top-k/top-p)."""
  x = logits.astype(jnp.float32) / config.temperature
  if config.top_k and config.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, config.top_k)[0][..., -1:]  # [B, 1]
    x = jnp.where(x < kth, -jnp.inf, x)
  if config.top_p < 1:
    ordered = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    kept = jnp.where(before < config.top_p, ordered, jnp.inf)
    cutoff = jnp.min(kept, axis=-1, keepdims=True)  # the least likely kept logit
    x = jnp.where(x < cutoff, -jnp.inf, x)
  return x


def row_keys(key: jax.Array, sequence_ids: jax.Array, step) -> jax.Array:
  """One key per row: fold_in(fold_in(key, sequence_id), step)."""
  return jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(key, s), step))(sequence_ids)


def sample(logits: jax.Array, keys: jax.Array, config: SamplingConfig) -> jax.Array:
  """logits [B, V], keys [B] -> tokens [B] int32."""
  if logits.ndim != 2 or keys.shape[:1] != logits.shape[:1]:
    raise ValueError(f'logits must be [B, V] and keys [B], got {logits.shape} and {keys.shape}')
  if config.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = processed_logits(logits, config)
  return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log p(token) under the model (log-softmax of the raw logits): [B, V], [B] -> [B]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
