"""The main job on its embedded default: shared-prefix vs naive attention.

    python -m experiments.demo                      # CPU default, < 2 minutes
    python -m experiments.demo --samples=16 --dtype=bfloat16

Builds a two-level sharing tree (a few-shot prompt -> problem statements ->
samples), prints it, runs exact tree attention (Hydragen) and the naive
per-sequence attention on the same random KV, and prints the max error, the
time of each and the KV memory saved.
"""

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import hydrajax as hj

_FEWSHOT = flags.DEFINE_integer('fewshot_tokens', 1024, 'Tokens of the shared few-shot prompt.')
_PROBLEMS = flags.DEFINE_list('problem_tokens', ['300', '180', '257', '90'], 'Tokens of each problem.')
_SAMPLES = flags.DEFINE_integer('samples', 8, 'Samples per problem.')
_GENERATED = flags.DEFINE_integer('generated_tokens', 40, 'Tokens each sample has generated so far.')
_HEADS = flags.DEFINE_string('heads', '32/8', 'Query heads / kv heads.')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 128, 'Head dim H.')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Input dtype.')
_IMPL = flags.DEFINE_enum('impl', 'auto', [i.value for i in hj.AttentionImpl], 'Implementation.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed calls per implementation (median).')


def _median_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv):
  del argv
  n, k = (int(x) for x in _HEADS.value.split('/'))
  h, dtype = _HEAD_DIM.value, jnp.dtype(_DTYPE.value)
  tree = hj.PromptNode(
      _FEWSHOT.value,
      label='few-shot prompt',
      children=tuple(
          hj.PromptNode(int(p), num_samples=_SAMPLES.value, label=f'problem {i}')
          for i, p in enumerate(_PROBLEMS.value)
      ),
  )
  generated = _GENERATED.value
  plan = hj.plan_tree(tree, private_capacity=generated, private_lengths=generated)
  print('Sharing tree:')
  print(hj.render_plan(plan))

  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (plan.num_rows, 1, n, h), dtype)
  k_cache = jax.random.normal(kk, (plan.kv_tokens, k, h), dtype)
  v_cache = jax.random.normal(kv, (plan.kv_tokens, k, h), dtype)
  layout = plan.to_device()
  impl, _ = hj.resolve(_IMPL.value, q, k_cache, v_cache, layout)

  # The baseline stores a copy of every sequence's context: [B, S, K, H].
  indices, lengths = (jnp.asarray(a) for a in plan.row_token_indices())
  k_rows, v_rows = k_cache[indices], v_cache[indices]
  naive = jax.jit(hj.naive_attention)
  tree_fn = jax.jit(lambda q, k_cache, v_cache: hj.tree_attention(q, k_cache, v_cache, layout, impl=impl))

  expected = naive(q, k_rows, v_rows, lengths)
  got = tree_fn(q, k_cache, v_cache)
  err_out = float(jnp.max(jnp.abs(got.out.astype(jnp.float32) - expected.out.astype(jnp.float32))))
  err_lse = float(jnp.max(jnp.abs(got.lse - expected.lse)))
  t_naive = _median_seconds(naive, q, k_rows, v_rows, lengths, repeats=_REPEATS.value)
  t_tree = _median_seconds(tree_fn, q, k_cache, v_cache, repeats=_REPEATS.value)

  kv_bytes = 2 * k * h * dtype.itemsize
  print(
      f'\nB={plan.num_rows} rows, heads {n}/{k}, head dim {h}, {dtype.name}, '
      f'backend {jax.default_backend()}, tree impl {impl.value}'
  )
  print(f'max |tree - naive|: out {err_out:.2e}, lse {err_lse:.2e}')
  print(f'naive attention over per-sequence copies: {t_naive * 1e3:8.2f} ms')
  print(f'tree attention (Hydragen, exact):         {t_tree * 1e3:8.2f} ms  ({t_naive / t_tree:.1f}x)')
  print(
      f'KV memory per layer: {plan.kv_tokens * kv_bytes / 2**20:.1f} MiB shared vs '
      f'{plan.unshared_tokens() * kv_bytes / 2**20:.1f} MiB with per-sequence copies'
  )
  tolerance = 1e-4 if dtype == jnp.float32 else 3e-2
  if not err_out <= tolerance:
    raise SystemExit(f'error {err_out} above tolerance {tolerance}')


if __name__ == '__main__':
  app.run(main)
