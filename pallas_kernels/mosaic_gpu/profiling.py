"""The kernels' compiler parameters, and Mosaic GPU's in-kernel profiler switched on from the
environment.

With `HYDRAJAX_MOSAIC_GPU_PROFILE_DIR=/some/dir` set when a kernel is built (traced), every
`jax.named_scope` region inside it is timed per warpgroup with the SM's clock, and each launch
writes a Chrome trace (`*.json`, for perfetto or chrome://tracing) to that folder;
`summarize` turns traces into time per region. It is a debugging aid: each region costs a few
cycles, and the event buffer takes shared memory (`HYDRAJAX_MOSAIC_GPU_PROFILE_SPACE` regions a
warpgroup, default 512, 8 KiB), which can lower occupancy. Without the variable the kernels are
built exactly as before (named scopes alone emit nothing).
"""

import collections
import json
import os

import jax.experimental.pallas.mosaic_gpu as plgpu

PROFILE_DIR = 'HYDRAJAX_MOSAIC_GPU_PROFILE_DIR'
PROFILE_SPACE = 'HYDRAJAX_MOSAIC_GPU_PROFILE_SPACE'


def compiler_params(**overrides) -> plgpu.CompilerParams:
  """The kernels' compiler parameters (fast approximate exp/reciprocal; lane semantics: arrays
  are a warpgroup's, with explicit layouts), with the profiler on when PROFILE_DIR is set.

  overrides: other `plgpu.CompilerParams` fields (the shared kernel reserves no reduction
  scratch: its row reductions stay within a warp, and 192-token kv steps need those 2 KiB)."""
  kwargs = dict(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane, **overrides)
  path = os.environ.get(PROFILE_DIR)
  if path:
    os.makedirs(path, exist_ok=True)
    kwargs.update(profile_dir=path, profile_space=int(os.environ.get(PROFILE_SPACE, 512)),
                  profile_bounds_check=True)  # a full buffer truncates the trace, not the kernel
  return plgpu.CompilerParams(**kwargs)


def summarize(trace_path: str) -> dict[str, dict[str, float]]:
  """Per region name: count, total_us, mean_us (summed over warpgroups), and per_program_us
  (total over the traced warpgroups, i.e. the mean time one warpgroup spends in it)."""
  with open(trace_path) as f:
    events = json.load(f)['traceEvents']
  open_at: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
  count: dict[str, int] = collections.Counter()
  total: dict[str, float] = collections.defaultdict(float)
  traces = set()
  for e in events:
    key = (e['tid'], e['name'])
    traces.add(e['tid'])
    if e['ph'] == 'B':
      open_at[key].append(e['ts'])
    elif open_at[key]:
      count[e['name']] += 1
      total[e['name']] += e['ts'] - open_at[key].pop()
  n = max(1, len(traces))
  return {name: dict(count=count[name], total_us=total[name],
                     mean_us=total[name] / count[name], per_program_us=total[name] / n)
          for name in sorted(count)}
