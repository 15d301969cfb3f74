"""Rotary position embeddings (the rotate-half layout of HF Llama checkpoints).

Head dim H is split in two halves (x1, x2); position p rotates pair
(x1[i], x2[i]) by angle p * inv_freq[i]. `inv_freq` is theta^(-2i/H), with
Llama 3.1 scaling applied to long wavelengths when configured.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import Llama3RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None
) -> np.ndarray:
  """inv_freq [H // 2] float32, as HF computes it (float32, Llama 3.1 smoothing)."""
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
  if scaling is None:
    return inv_freq
  old = scaling.original_max_position_embeddings
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array,  # [B, T, N, H]
    positions: jax.Array,  # [B, T] int32
    inv_freq: jax.Array,  # [H // 2] float32
) -> jax.Array:
  """Rotates x at `positions`; cos/sin are computed in float32 and cast to x.dtype (as HF)."""
  if x.ndim != 4 or positions.shape != x.shape[:2]:
    raise ValueError(
        f'x must be [B, T, N, H] and positions [B, T], got {x.shape} and {positions.shape}')
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  cos = jnp.cos(angles).astype(x.dtype)
  sin = jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin
