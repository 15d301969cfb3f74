"""Device-side helpers of the chunk pool: its size, and copy on write of KV slots."""

import functools

import jax
import jax.numpy as jnp


def pool_bytes(num_chunks: int, chunk_size: int, num_layers: int, num_kv_heads: int,
               head_dim: int, itemsize: int = 2) -> int:
  """Bytes of the K and V pools of every layer."""
  return 2 * num_layers * num_chunks * chunk_size * num_kv_heads * head_dim * itemsize


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_slots(
    k: jax.Array,  # [..., L, K, H]
    v: jax.Array,  # [..., L, K, H]
    src: jax.Array,  # [M] int32
    dst: jax.Array,  # [M] int32; an index >= L is dropped (padding)
) -> tuple[jax.Array, jax.Array]:
  """Copies the KV of tokens `src` to slots `dst` in every layer (the buffers are donated).

  Every source is read before any destination is written, so one call may
  write a slot that another of its copies reads (an iteration's copies, when a
  later insert evicted and reused a cached chunk an earlier one copies from).
  """
  if k.ndim < 3 or k.shape != v.shape:
    raise ValueError(f'k and v must be [..., L, K, H] of one shape, got {k.shape} and {v.shape}')
  if src.shape != dst.shape or src.ndim != 1:
    raise ValueError(f'src and dst must be [M], got {src.shape} and {dst.shape}')
  src = jnp.clip(src, 0, k.shape[-3] - 1)
  k = k.at[..., dst, :, :].set(jnp.take(k, src, axis=-3), mode='drop')
  v = v.at[..., dst, :, :].set(jnp.take(v, src, axis=-3), mode='drop')
  return k, v
