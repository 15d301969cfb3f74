"""Session 29: is the shared kernel held back by its K/V reads (L2 -> shared memory)?

The shared kernel's memory warpgroup refills each K/V slot once a step. Here the steady-state
refills are replaced by plain barrier arrivals (the first `steps` blocks are still copied, so
the slots hold finite values; results are wrong and not checked): if the kernel gets much
faster without the V refills (half the bytes), its 128-row programs wait on L2 bandwidth and
a cluster of two programs multicasting one copy would pay; if not, it is compute bound.
Times: CUPTI, the shared kernel alone, median of 5, inputs rotated (check_on_device)."""
import inspect
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import check_on_device as cod
from pallas_kernels.mosaic_gpu import segment_attention as sa

ORIGINAL = inspect.getsource(sa)
LOOP = '@pl.loop(0, jnp.maximum(it.num_blocks - steps, 0))'
COPY = 'plgpu.copy_gmem_to_smem({x}_ref.at[rows, kv_head], {x}_smem.at[slot], {x}_barriers.at[slot])'
ARRIVE = 'plgpu.barrier_arrive({x}_barriers.at[slot])'


def patched(skip):
  head, tail = ORIGINAL.split(LOOP)
  for x in skip:
    assert tail.count(COPY.format(x=x)) == 1
    tail = tail.replace(COPY.format(x=x), ARRIVE.format(x=x))
  return head + LOOP + tail


out = open(sys.argv[1], 'a')
for shape in ((256, 16384, 1, 32, 8), (1024, 16384, 1, 32, 8), (1024, 16384, 1, 32, 32)):
  plan, layout, q, kc, vc = cod.problem(*shape)
  sets = [(q, kc, vc)]
  for i in range(1, 3):
    p2, l2, qi, ki, vi = cod.problem(*shape, seed=i)
    sets.append((qi, ki, vi))
  for skip in ((), ('v',), ('k', 'v')):
    exec(compile(patched(skip), sa.__file__, 'exec'), sa.__dict__)
    jax.clear_caches()
    fn, prepared = cod.attend_fn(q, kc, layout, {})
    us, kernels = cod.cupti_us(lambda a, b, c: fn(a, b, c, prepared, jnp.int32(0)), sets)
    shared = sum(t for n, t in kernels.items() if n.startswith('shared_segment'))
    row = dict(shape=shape, skip_refills=list(skip), us=round(us, 1), shared_us=round(shared, 1))
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + '\n')
exec(compile(ORIGINAL, sa.__file__, 'exec'), sa.__dict__)
