"""Does a program holding a Mosaic GPU kernel make the host wait at dispatch? Each program runs
~10 ms of matmuls; variants add (a) nothing, (b) jax's attention_mgpu kernel, (c) hydrajax tree
attention (mosaic_gpu), (d) the same with impl=xla. Dispatched 12 times without readback; the
per-call host time is printed (a waiting launch shows up as ~the step's device time)."""
import json, time
import jax, jax.numpy as jnp, numpy as np
import hydrajax as hj
from jax.experimental.pallas.ops.gpu import attention_mgpu

w = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16) * 1e-3)
x0 = jnp.ones((2048, 8192), jnp.bfloat16)
tree = hj.PromptNode(4096, children=(hj.PromptNode(300, num_samples=64),))
plan = hj.plan_tree(tree, private_capacity=64, private_lengths=1)
layout = plan.to_device()
q = jnp.ones((plan.num_rows, 1, 32, 128), jnp.bfloat16)
kc = jnp.ones((plan.kv_tokens, 8, 128), jnp.bfloat16)
vc = jnp.ones((plan.kv_tokens, 8, 128), jnp.bfloat16)
aq = jnp.ones((2, 512, 8, 128), jnp.float16)
ak = jnp.ones((2, 512, 8, 128), jnp.float16)
cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)


def heavy(y):
  for _ in range(16):
    y = jnp.tanh(y @ w)
  return y


def make(variant):
  def step(y):
    y = heavy(y)
    s = y[0, 0].astype(jnp.float32)
    if variant == 'mgpu_example':
      s += attention_mgpu.attention(aq * y[0, 0].astype(jnp.float16), ak, ak, cfg)[0, 0, 0, 0].astype(jnp.float32)
    elif variant in ('tree_mosaic', 'tree_xla'):
      impl = 'mosaic_gpu' if variant == 'tree_mosaic' else 'xla'
      out, _ = hj.tree_attention(q * y[0, 0], kc, vc, layout, impl=impl)
      s += out[0, 0, 0, 0].astype(jnp.float32)
    return y, s
  return jax.jit(step)


for variant in ('matmul_only', 'mgpu_example', 'tree_mosaic', 'tree_xla', 'matmul_only'):
  f = make(variant)
  y, s = f(x0); jax.block_until_ready(s)
  t0 = time.perf_counter(); y1, s1 = f(y); jax.block_until_ready(s1)
  one = (time.perf_counter() - t0) * 1e3
  times = []
  for _ in range(12):
    t0 = time.perf_counter(); y, s = f(y); times.append((time.perf_counter() - t0) * 1e3)
  jax.block_until_ready(s)
  print(json.dumps({'variant': variant, 'one_step_ms': round(one, 2),
                    'dispatch_ms': [round(t, 2) for t in times]}), flush=True)
