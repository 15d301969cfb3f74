"""The roofline floor: measured ceilings, and byte/FLOP counts of attention.

floor = max(bytes that must move once / copy bandwidth, FLOPs / matmul rate).
Both ceilings are measured on the device in the same run as the benchmark
(datasheet numbers are leads only): the copy bandwidth counts bytes read plus
bytes written of a large elementwise device copy; the matmul rate is a large
bf16 matrix product on random data (zeros run faster than real data).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from experiments.benchmarking.timing import device_time


@dataclasses.dataclass(frozen=True)
class Cost:
  """Minimum device-memory traffic and arithmetic of one operation."""

  bytes: float
  flops: float

  def floor_s(self, ceilings: 'Ceilings') -> float:
    return floor(self.bytes, self.flops, ceilings.copy_bandwidth, ceilings.matmul_rate)


@dataclasses.dataclass(frozen=True)
class Ceilings:
  """Measured device ceilings.

  Attributes:
    copy_bandwidth: bytes/s, read + written, the best of the copy variants.
    matmul_rate: FLOP/s of a bf16 matrix product.
    details: every measurement behind them (for the JSONL record).
  """

  copy_bandwidth: float
  matmul_rate: float
  details: dict[str, Any] = dataclasses.field(default_factory=dict)

  def with_copy_bandwidth(self, bandwidth: float, source: str) -> 'Ceilings':
    """The same ceilings with a higher copy bandwidth measured elsewhere (e.g. PyTorch)."""
    if bandwidth <= self.copy_bandwidth:
      return self
    details = dict(self.details, copy_bandwidth_source=source)
    return Ceilings(bandwidth, self.matmul_rate, details)

  def record(self) -> dict[str, Any]:
    """The JSONL record of a run's ceilings (kind 'ceilings')."""
    return dict(kind='ceilings', copy_bandwidth=self.copy_bandwidth,
                matmul_rate=self.matmul_rate, details=self.details)


def floor(bytes_: float, flops: float, bandwidth: float, rate: float) -> float:
  """Roofline floor in seconds: max(bytes / bandwidth, flops / rate)."""
  if bandwidth <= 0 or rate <= 0:
    raise ValueError(f'bandwidth and rate must be > 0, got {bandwidth}, {rate}')
  if bytes_ < 0 or flops < 0:
    raise ValueError(f'bytes and flops must be >= 0, got {bytes_}, {flops}')
  return max(bytes_ / bandwidth, flops / rate)


def _visible_keys(prefix: int, suffix: int, query_len: int) -> int:
  """Keys visible to a row's T query tokens summed over the T tokens (causal in the suffix)."""
  # Query token t (0-based) sees prefix + suffix - T + t + 1 tokens.
  return query_len * (prefix + suffix) - query_len * (query_len - 1) // 2


def _attention_cost(batch, prefix, suffix, num_q_heads, num_kv_heads, head_dim, query_len,
                    dtype_bytes, prefix_reads) -> Cost:
  _check_shape(batch, prefix, suffix, num_q_heads, num_kv_heads, head_dim, query_len)
  kv_token = 2 * num_kv_heads * head_dim * dtype_bytes  # K and V of one token
  q_and_out = 2 * batch * query_len * num_q_heads * head_dim * dtype_bytes
  bytes_ = prefix_reads * prefix * kv_token + batch * suffix * kv_token + q_and_out
  flops = 4 * batch * num_q_heads * head_dim * _visible_keys(prefix, suffix, query_len)
  return Cost(float(bytes_), float(flops))


def shared_prefix_cost(
    batch: int,
    prefix: int,
    suffix: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    query_len: int = 1,
    dtype_bytes: int = 2,
) -> Cost:
  """Attention of B rows over one shared P-token prefix plus an S-token suffix each.

  Bytes: the prefix K and V read once, each row's suffix K and V, q read and
  out written (the LSE, optional for the caller, is not counted). FLOPs: two
  matrix products (QK^T and PV) over every visible key, 2 FLOPs per MAC.
  """
  return _attention_cost(batch, prefix, suffix, num_q_heads, num_kv_heads, head_dim, query_len,
                         dtype_bytes, prefix_reads=1)


def per_sequence_cost(
    batch: int,
    prefix: int,
    suffix: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    query_len: int = 1,
    dtype_bytes: int = 2,
) -> Cost:
  """The same attention when every row reads its own copy of the prefix."""
  return _attention_cost(batch, prefix, suffix, num_q_heads, num_kv_heads, head_dim, query_len,
                         dtype_bytes, prefix_reads=batch)


def _check_shape(batch, prefix, suffix, num_q_heads, num_kv_heads, head_dim, query_len):
  if batch < 1 or head_dim < 1 or prefix < 0:
    raise ValueError(f'need batch >= 1, head_dim >= 1, prefix >= 0; got {batch}, {head_dim}, {prefix}')
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f'num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})')
  if not 1 <= query_len <= suffix:
    raise ValueError(f'need 1 <= query_len ({query_len}) <= suffix ({suffix})')


def measure_copy_bandwidth(
    nbytes: int = 2**31, *, max_doublings: int = 4, **timing_kw
) -> tuple[float, dict[str, float]]:
  """Best bytes/s (read + written) over a few elementwise copies of `nbytes`.

  A size too small to time against the timer's noise is doubled, up to
  `max_doublings` times. Returns (bandwidth, {variant: bandwidth}).
  """
  for _ in range(max_doublings + 1):
    n = max(1, nbytes // 4)
    x32 = jax.random.bits(jax.random.key(11), (n,), jnp.uint32)
    xbf = jax.random.normal(jax.random.key(12), (2 * n,), jnp.bfloat16)
    variants = {
        'uint32 x+1': (lambda x: x + jnp.uint32(1), x32),
        'bf16 x*2': (lambda x: x * jnp.bfloat16(2), xbf),
    }
    found = {}
    for name, (fn, x) in variants.items():
      t = device_time(fn, x, **timing_kw)
      found[name] = 2 * x.nbytes / t.median_s if t.median_s > 0 else 0.0
    if max(found.values()) > 0:
      return max(found.values()), found
    nbytes *= 2
  raise RuntimeError(f'copies of up to {nbytes // 2} bytes too fast to time; use a larger size')


def measure_matmul_rate(
    size: int = 8192, dtype=jnp.bfloat16, *, max_doublings: int = 2, **timing_kw
) -> float:
  """FLOP/s of a [size, size] x [size, size] product on random data (size doubled if untimeable)."""
  for _ in range(max_doublings + 1):
    a = jax.random.normal(jax.random.key(13), (size, size), dtype)
    b = jax.random.normal(jax.random.key(14), (size, size), dtype)
    t = device_time(jnp.matmul, a, b, **timing_kw)
    if t.median_s > 0:
      return 2 * size**3 / t.median_s
    size *= 2
  raise RuntimeError(f'matmul of size up to {size // 2} too fast to time; use a larger size')


def measure_backend_ceilings() -> Ceilings:
  """`measure_ceilings` at full size on an accelerator, at a CPU smoke's sizes on the CPU."""
  if jax.default_backend() == 'cpu':
    return measure_ceilings(copy_bytes=2**24, matmul_size=512, repeats=1)
  return measure_ceilings()


def measure_ceilings(copy_bytes: int = 2**31, matmul_size: int = 8192, **timing_kw) -> Ceilings:
  """Measures both ceilings now, on the default device."""
  bandwidth, copies = measure_copy_bandwidth(copy_bytes, **timing_kw)
  rate = measure_matmul_rate(matmul_size, **timing_kw)
  details = {
      'copy_bytes': copy_bytes,
      'copy_bandwidth_by_variant': copies,
      'copy_bandwidth_source': 'jax elementwise copy',
      'matmul_size': matmul_size,
      'matmul_dtype': 'bfloat16',
  }
  return Ceilings(bandwidth, rate, details)
