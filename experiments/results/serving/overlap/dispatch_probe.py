"""Why does an overlapped decode step's dispatch wait for the step before it? A jitted step of
about 15 ms that updates a donated buffer in place; the host dispatches N steps without reading
anything and times each call. Variants: donation on/off, small arguments as numpy or on device."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np

N = 12
w = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16))

def step(buf, x, small1, small2):
  y = x
  for _ in range(24):  # ~15 ms of matmuls
    y = jnp.tanh(y @ w)
  buf = buf.at[small1[0]].set(y[0, :8192].astype(buf.dtype))
  return buf, y, (small1 + small2).sum()

def run(donate, numpy_args, pre_put_every_step):
  f = jax.jit(step, donate_argnums=(0,) if donate else ())
  buf = jnp.zeros((4096, 8192), jnp.bfloat16)
  x = jnp.ones((2048, 8192), jnp.bfloat16)
  s1 = np.arange(256, dtype=np.int32); s2 = np.ones(256, np.int32)
  buf, y, _ = f(buf, x, s1, s2); jax.block_until_ready(buf)
  times = []
  for i in range(N):
    a1, a2 = (s1, s2)
    if not numpy_args:
      a1, a2 = jax.device_put(s1), jax.device_put(s2)
    t0 = time.perf_counter()
    buf, y, z = f(buf, y, a1, a2)
    times.append((time.perf_counter() - t0) * 1e3)
  t0 = time.perf_counter(); jax.block_until_ready((buf, y, z)); drain = (time.perf_counter() - t0) * 1e3
  t0 = time.perf_counter(); f(buf, y, s1, s2)[0].block_until_ready(); one = (time.perf_counter() - t0) * 1e3
  return dict(donate=donate, numpy_args=numpy_args, dispatch_ms=[round(t, 2) for t in times],
              drain_ms=round(drain, 1), one_step_ms=round(one, 1))

for donate in (True, False):
  for numpy_args in (True, False):
    print(json.dumps(run(donate, numpy_args, False)), flush=True)
