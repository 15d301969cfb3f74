"""Does a traced pipeline length slow the training kernels' steps? (session 37, call 4)

Call 3: per kv step, the shared segment's forward (a static 64-step pipeline) ran at about 1.8
us, the causal and prefixed forwards (traced lengths) at 2.2-2.8 us. Times (CUPTI, ms), each
variant twice, interleaved:
  * the segment forward, 64K rows x 8K keys: static (as shipped) against the same count traced;
  * the causal forward and backward, 64 x 1K completions, paired tiles: traced (as shipped)
    against static (with full lengths every pair streams n + 1 blocks' worth, a constant).

  PYTHONPATH=. python3 experiments/results/train_prefixed_s37/static_grid_probe.py
"""
import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import training_attention as ta
from pallas_kernels.mosaic_gpu.check_training import cupti_ms

_kv_steps, _tiles_init = ta._kv_steps, ta._Tiles.__init__
STATIC = {}  # {'bk': kv block} when the paired causal grid is made static


def traced_kv_steps(kv_len, queries_end, causal_t, bk, s):
  if causal_t is None:  # the same count, traced (kv_len = S at run time)
    return jnp.minimum(s // bk, lax.div(kv_len + (bk - 1), jnp.int32(bk)))
  return _kv_steps(kv_len, queries_end, causal_t, bk, s)


def static_tiles_init(self, rows_per_tile, num_tiles, causal_t, paired, kv_steps):
  _tiles_init(self, rows_per_tile, num_tiles, causal_t, paired, kv_steps)
  if paired and STATIC:  # full lengths, n even: tiles p and n - 1 - p stream n + 1 tiles' worth
    assert num_tiles % 2 == 0 and rows_per_tile % STATIC['bk'] == 0
    self.steps = (num_tiles + 1) * rows_per_tile // STATIC['bk']


def draw(key, shape):
  return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def segment(variant):
  ta._kv_steps = traced_kv_steps if variant == 'traced' else _kv_steps
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = draw(keys[0], (65536, 32, 128)), draw(keys[1], (8192, 8, 128)), draw(keys[2], (8192, 8, 128))
  fn = jax.jit(lambda q, k, v: ta.segment_forward(q, k, v, 8192, scale=0.088))
  ms, _ = cupti_ms(fn, q, k, v)
  ta._kv_steps = _kv_steps
  return ms


def causal(variant):
  ta._Tiles.__init__ = static_tiles_init
  keys = jax.random.split(jax.random.key(1), 5)
  z, t = 64, 1024
  q, do = draw(keys[0], (z, t, 32, 128)), draw(keys[3], (z, t, 32, 128))
  k, v = draw(keys[1], (z, t, 8, 128)), draw(keys[2], (z, t, 8, 128))
  cfg = ta.TrainingKernelConfig()
  STATIC.clear()
  if variant == 'static':
    STATIC['bk'] = cfg.block_kv
  fwd = jax.jit(lambda q, k, v: ta.causal_forward(q, k, v, t, scale=0.088))
  out, lse = fwd(q, k, v)
  ms_fwd, _ = cupti_ms(fwd, q, k, v)
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
  if variant == 'static':
    STATIC['bk'] = cfg.block_kv_dq  # the dQ kernel's blocks (the dK/dV kernel is not paired)
  bwd = jax.jit(lambda *a: ta.causal_backward(*a, t, scale=0.088))
  ms_bwd, kernels = cupti_ms(bwd, q, k, v, do, lse, delta)
  dq_ms = sum(ms for name, ms in kernels.items() if 'dq_kernel' in name)
  STATIC.clear()
  ta._Tiles.__init__ = _tiles_init
  return ms_fwd, dq_ms


def main():
  print(jax.devices(), flush=True)
  for _ in range(2):
    for variant in ('static', 'traced'):
      print(f'segment forward 64K x 8K, {variant} grid: {segment(variant):.3f} ms', flush=True)
  for _ in range(2):
    for variant in ('traced', 'static'):
      fwd, dq = causal(variant)
      print(f'causal 64 x 1K, {variant} grid: forward {fwd:.3f} ms, dQ kernel {dq:.3f} ms',
            flush=True)


if __name__ == '__main__':
  main()
