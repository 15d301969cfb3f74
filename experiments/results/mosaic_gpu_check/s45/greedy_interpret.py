"""Session 45, on CPU (interpret mode): greedy decoding of a tiny random-weight GQA Llama (16/8 heads,
head dim 64, 2 layers, bf16; 4 prompts sharing 30 tokens, 2 samples each, 12 new tokens) with the
naive path, XLA, and the Mosaic GPU kernels with chunk lanes and with token lanes
(`private_token_lanes`), prefill by XLA. Tokens must be identical to naive decoding.

    PYTHONPATH=. python experiments/results/mosaic_gpu_check/s45/greedy_interpret.py 7  # about 20 minutes
"""
import dataclasses
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx
from models import generate as gen
from models.config import get_config
from models.llama import Llama
from pallas_kernels.mosaic_gpu.tree_attention import MosaicGpuConfig
seed = int(sys.argv[1])
cfg = dataclasses.replace(get_config('tiny_gqa'), num_heads=16, num_kv_heads=8, head_dim=64, dim=64, num_layers=2)
rng = np.random.default_rng(seed)
root = [list(rng.integers(1, 97, 30))]
prompts = [root[0] + list(rng.integers(1, 97, int(rng.integers(0, 6)))) for _ in range(4)]
out = {}
for name, impl, conf in (('naive', gen.NAIVE, None), ('xla', 'xla', None), ('chunk', 'mosaic_gpu', None), ('token', 'mosaic_gpu', MosaicGpuConfig(private_token_lanes=True))):
  model = Llama(cfg, rngs=nnx.Rngs(seed), dtype=jnp.bfloat16, attention_config=conf)
  t0 = time.time()
  r = gen.generate(model, prompts, num_samples=2, max_new_tokens=12, impl=impl, prefill_impl='xla' if impl != gen.NAIVE else None, interpret=impl == 'mosaic_gpu', return_logprobs=True)
  out[name] = r
  print(name, round(time.time() - t0, 1), r.tokens.tolist()[:2], flush=True)
same = {}
for name in ('xla', 'chunk', 'token'):
  same[name] = np.array_equal(out[name].tokens, out['naive'].tokens)
  print(name, 'identical to naive:', same[name], 'max |dlogprob|', float(np.max(np.abs(out[name].logprobs - out['naive'].logprobs))))
sys.exit(0 if all(same.values()) else 1)
