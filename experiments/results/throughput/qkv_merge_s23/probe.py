"""Does XLA still concatenate wq and wkv every step when the kv product asks for f32?

The q and kv projections share their input, so XLA's GPU pipeline merges them into one GEMM and
concatenates the two weights for it on every step (`wrapped_concatenate`, 1.7 ms of a 22.5 ms
CodeLlama-7B step at B=1024). Products whose outputs differ in type cannot be merged. This
probe compiles 4 layers' q/k/v projections (CodeLlama-7B shapes) both ways and prints, per
variant, whether the compiled program concatenates, its kernels (CUPTI) and whether k and v
are bitwise equal. Run: PYTHONPATH=. python3 experiments/results/throughput/qkv_merge_s23/probe.py
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.benchmarking import timing
from models.llama import apply_rope, inverse_frequencies, rms_norm

B, D, N, K, H, LAYERS = 1024, 4096, 32, 32, 128, 4


def qkv(y, wq, wkv, positions, inv_freq, f32_kv):
  q = apply_rope(jnp.einsum('btd,dnh->btnh', y, wq), positions, inv_freq)
  if f32_kv:
    kv = jnp.einsum('btd,dckh->btckh', y, wkv, preferred_element_type=jnp.float32).astype(y.dtype)
  else:
    kv = jnp.einsum('btd,dckh->btckh', y, wkv)
  return q, apply_rope(kv[:, :, 0], positions, inv_freq), kv[:, :, 1]


def step(x, norms, wqs, wkvs, positions, inv_freq, f32_kv):
  outs = []
  for i in range(LAYERS):
    y = rms_norm(x, norms[i], 1e-5)
    q, k, v = qkv(y, wqs[i], wkvs[i], positions, inv_freq, f32_kv)
    outs.append((q, k, v))
    x = x + q.reshape(x.shape)  # the next layer depends on this one
  return outs


def main():
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (B, 1, D), jnp.bfloat16)
  norms = jnp.ones((LAYERS, D), jnp.bfloat16)
  wqs = (jax.random.normal(keys[1], (LAYERS, D, N, H), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
  wkvs = (jax.random.normal(keys[2], (LAYERS, D, 2, K, H), jnp.float32) * D**-0.5).astype(
      jnp.bfloat16)
  positions = jnp.full((B, 1), 1000, jnp.int32)
  inv_freq = jnp.asarray(inverse_frequencies(H, 10000.0, None))
  results = {}
  for f32_kv in (False, True):
    fn = jax.jit(step, static_argnums=6)
    hlo = fn.lower(x, norms, wqs, wkvs, positions, inv_freq, f32_kv).compile().as_text()
    out = fn(x, norms, wqs, wkvs, positions, inv_freq, f32_kv)
    _, kernels = timing.kernel_times(lambda: fn(x, norms, wqs, wkvs, positions, inv_freq, f32_kv))
    results[f32_kv] = out
    print(json.dumps(dict(f32_kv=f32_kv, xla_flags=os.environ.get('XLA_FLAGS', ''),
                          concatenates=' concatenate(' in hlo,
                          kernel_us=sum(k[1] for k in kernels), kernels=kernels[:8])))
  same = [bool(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)))
          for a, b in zip(jax.tree.leaves(results[False]), jax.tree.leaves(results[True]))]
  print(json.dumps(dict(bitwise_equal=all(same))))


if __name__ == '__main__':
  main()
