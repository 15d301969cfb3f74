"""Mosaic GPU tree attention at real models' head layouts, against the naive oracle (a GPU).

SmolLM2's 9 query / 3 kv heads at head dim 64, and 15/5, 12/4 at 64, 32/8 at 128: random
two-level trees (a prefix, two children with 1-8 samples each, private tails), T = 1 and 3,
bf16 and f16. A silent fallback to XLA is an error. One JSON line a case, then a summary:

  PYTHONPATH=. python3 -m experiments.mosaic_gpu.real_model_shapes [seed] > shapes.jsonl
"""

import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import hydrajax as hj

HEADS = ((9, 3, 64), (15, 5, 64), (12, 4, 64), (32, 8, 128))


def check(rng, n, k, h, t, dtype) -> dict:
  tree = hj.PromptNode(int(rng.integers(100, 900)), children=(
      hj.PromptNode(int(rng.integers(0, 300)), num_samples=int(rng.integers(1, 9))),
      hj.PromptNode(int(rng.integers(1, 300)), num_samples=int(rng.integers(1, 9)))))
  plan = hj.plan_tree(tree, private_capacity=64, private_lengths=int(rng.integers(t, 60)))
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  q = jax.random.normal(keys[0], (plan.num_rows, t, n, h), dtype)
  kc = jax.random.normal(keys[1], (plan.kv_tokens, k, h), dtype)
  vc = jax.random.normal(keys[2], (plan.kv_tokens, k, h), dtype)
  case = dict(n=n, k=k, h=h, t=t, dtype=jnp.dtype(dtype).name, rows=plan.num_rows)
  try:
    got = hj.tree_attention(q, kc, vc, plan.to_device(), impl='mosaic_gpu')
    ref = hj.naive_tree_attention(q, kc, vc, plan)
  except Exception as e:  # a refusal or a compile error is this case's result
    return dict(case, error=f'{type(e).__name__}: {e}'[:300], ok=False)
  out_err = float(jnp.max(jnp.abs(got.out.astype(jnp.float32) - ref.out.astype(jnp.float32))))
  lse_err = float(jnp.max(jnp.abs(got.lse - ref.lse)))
  return dict(case, out_err=out_err, lse_err=lse_err, ok=out_err < 3e-2 and lse_err < 1e-3)


def main(seed: int = 0) -> None:
  warnings.simplefilter('error', hj.AttentionFallbackWarning)
  rng = np.random.default_rng(seed)
  rows = []
  for n, k, h in HEADS:
    for dtype in (jnp.bfloat16, jnp.float16):
      for t in (1, 3):
        rows.append(check(rng, n, k, h, t, dtype))
        print(json.dumps(rows[-1]), flush=True)
  print(json.dumps(dict(summary=True, passed=sum(r['ok'] for r in rows), cases=len(rows))))


if __name__ == '__main__':
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
