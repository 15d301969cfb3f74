"""Session 45, on CPU, as run (interpret mode, code at 9633dcf): token lanes against the oracle on
random forests with NaN in every unattended slot, seeds 100-120. Output: fuzz_seeds100_cpu.txt.
Seeds 100-113 passed; seed 114 drew a forest with no shared segment (plain paged decode, whose
problem has no token_lanes field), where this script itself stopped: its own bug, not a kernel result.

    PYTHONPATH=. python experiments/results/mosaic_gpu_check/s45/token_lanes_fuzz.py 100 21
"""
import sys, time
sys.path.insert(0, '.')
import jax.numpy as jnp, numpy as np
import hydrajax as hj
from tests.tree_attention_conformance import Case, random_problem, assert_close, naive_tree_attention, unattended_tokens
from pallas_kernels.mosaic_gpu.tree_attention import MosaicGpuConfig
cfg = MosaicGpuConfig(private_token_lanes=True, block_kv=64)
combos = [((8, 8), 1), ((16, 8), 4), ((32, 8), 2), ((64, 8), 1), ((16, 16), 1), ((32, 16), 2), ((24, 8), 2)]
seed0 = int(sys.argv[1]); n = int(sys.argv[2])
for i in range(n):
  seed = seed0 + i
  rng = np.random.default_rng(seed)
  heads, t = combos[seed % len(combos)]
  case = Case(seed, int(rng.integers(1, 4)), heads, t, max_len=int(rng.integers(21, 70)), max_rows=int(rng.integers(1, 9)), max_trees=3)
  dtype = (jnp.bfloat16, jnp.float16)[seed % 2]
  p = random_problem(case, head_dim=64, dtype=dtype, page_size=(8, 16)[seed % 2])
  plan = hj.prepare_attention(p.plan.to_device(), hj.AttentionShapes.of(p.q, p.k), impl='mosaic_gpu', config=cfg, interpret=True)
  tl = plan.prepared.problem.token_lanes
  mask = jnp.asarray(unattended_tokens(p.plan))[:, None, None]
  k, v = (jnp.where(mask, jnp.asarray(jnp.nan, x.dtype), x) for x in (p.k, p.v))
  t0 = time.time()
  got = hj.attend(p.q, k, v, plan.for_step())
  assert_close(got, naive_tree_attention(p.q, p.k, p.v, p.plan), dtype)
  print(seed, case.id, 'rows', p.plan.num_rows, 'token_lanes', tl, 'ok', round(time.time() - t0, 1), flush=True)
