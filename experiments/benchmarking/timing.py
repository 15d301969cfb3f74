"""Device timing of jitted JAX functions, with the L2 cache flushed between calls.

Method (why it is sound): one jitted program runs `fn` n times inside a
`lax.fori_loop`, and a second program runs the same loop without `fn`. Each
iteration of both first reads a flush buffer of `flush_bytes` (default 2x the
largest L2 in use, so the next call starts with a cold cache, as Hydragen's
benchmark does), then calls `fn`. The time per call is

    (wall(loop with fn, n) - wall(loop without fn, n)) / n,

so what is subtracted is everything but `fn`'s device work: the dispatch of
the program, the loop's own per-iteration cost and the flush. Within one
iteration the host has queued `fn`'s kernels while the flush ran, so launch
gaps are hidden as with CUDA-graph replay; what remains is device time. No
profiler is needed and the same code runs on CPU (for tests) and GPU.

Three details keep XLA from optimising the measurement away:
* every argument of `fn` passes through `lax.optimization_barrier` together
  with a value computed from the loop index and the flush, so nothing in `fn`
  is loop-invariant (no hoisting out of the loop) and `fn` runs after the flush;
* `fn`'s outputs are loop-carried, so they are materialised every iteration
  and not dead code; their initial zero fill happens in both programs;
* the loop count is a traced argument: one compile serves every n.

Known bias, small and documented: an output that a custom call (a Pallas
kernel) produces may be copied into the loop carry (output bytes only, e.g.
8 MB at B=1024 and 32 heads).
"""

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp

from experiments.benchmarking import gpu_clock

# H100/H200 have 50-60 MB of L2: twice the larger, as the method above asks.
GPU_FLUSH_BYTES = 128 * 2**20
CPU_FLUSH_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class Timing:
  """Device time of one call of a function.

  Attributes:
    median_s: median over repeats of the per-call time, seconds.
    samples_s: the per-call time of each repeat.
    iterations: calls per repeat (the loop count n).
    method: how it was measured.
    flush_bytes: bytes read between calls to flush the cache.
    clock: the SM clock and power cap while the timed repeats ran (`gpu_clock`'s summary;
      empty off NVIDIA GPUs). Ceilings are measured in short bursts at the full clock.
  """

  median_s: float
  samples_s: tuple[float, ...]
  iterations: int
  method: str
  flush_bytes: int
  clock: Mapping[str, float] = dataclasses.field(default_factory=dict)

  @property
  def median_us(self) -> float:
    return self.median_s * 1e6

  @property
  def spread(self) -> float:
    """(max - min) / median of the samples: how noisy the measurement was."""
    if self.median_s <= 0:
      return float('inf')
    return (max(self.samples_s) - min(self.samples_s)) / self.median_s


def default_flush_bytes() -> int:
  return GPU_FLUSH_BYTES if jax.default_backend() == 'gpu' else CPU_FLUSH_BYTES


def _make_loops(fn: Callable[..., Any]):
  """Two jitted programs (n, flush, args) -> carry: with and without fn."""

  def run(n, flush, args, with_fn: bool):
    outs0 = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args)
    )

    def body(i, carry):
      acc, outs = carry
      buf, _ = jax.lax.optimization_barrier((flush, i))
      flushed = jnp.sum(buf, dtype=jnp.float32)  # reads the whole buffer
      call_args, flushed = jax.lax.optimization_barrier((args, flushed))
      if with_fn:
        outs = fn(*call_args)
      return acc + flushed, outs

    return jax.lax.fori_loop(0, n, body, (jnp.float32(0), outs0))

  with_fn = jax.jit(lambda n, flush, args: run(n, flush, args, True))
  without_fn = jax.jit(lambda n, flush, args: run(n, flush, args, False))
  return with_fn, without_fn


def _wall(program, n, flush, args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(program(n, flush, args))
  return time.perf_counter() - start


def device_time(
    fn: Callable[..., Any],
    *args: Any,
    repeats: int = 5,
    target_s: float = 0.02,
    min_iters: int = 3,
    max_iters: int = 2000,
    flush_bytes: int | None = None,
) -> Timing:
  """Median device time of `fn(*args)` per call; see the module docstring.

  Args:
    fn: a JAX-traceable function of arrays / pytrees of arrays (jitted or not).
    *args: its arguments (device arrays or pytrees of them).
    repeats: timed repeats of the loop pair; the median is reported.
    target_s: aim for loops of about this long (sets n).
    min_iters, max_iters: bounds on n.
    flush_bytes: bytes read between calls; None picks 2x L2 on GPU, 8 MiB on CPU.

  Returns:
    A `Timing`. With a function much cheaper than the timer's noise a sample
    can be <= 0; nothing is clipped.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}')
  if not 1 <= min_iters <= max_iters:
    raise ValueError(f'need 1 <= min_iters <= max_iters, got {min_iters}, {max_iters}')
  flush_bytes = default_flush_bytes() if flush_bytes is None else flush_bytes
  flush = jnp.ones((max(1, flush_bytes // 4),), jnp.float32)
  with_fn, without_fn = _make_loops(fn)
  n0 = jnp.int32(min_iters)
  # Warm-up: compiles both programs and runs them once.
  _wall(with_fn, n0, flush, args)
  _wall(without_fn, n0, flush, args)
  # Calibrate n from one short run of each.
  per_call = max((_wall(with_fn, n0, flush, args) - _wall(without_fn, n0, flush, args)) / min_iters, 1e-7)
  loop_cost = _wall(without_fn, n0, flush, args) / min_iters
  n = int(min(max_iters, max(min_iters, target_s / (per_call + loop_cost))))
  samples = []
  with gpu_clock.ClockSampler.for_backend(jax.default_backend()) as clock:  # not the compiles
    for _ in range(repeats):
      t_fn = _wall(with_fn, jnp.int32(n), flush, args)
      t_empty = _wall(without_fn, jnp.int32(n), flush, args)
      samples.append((t_fn - t_empty) / n)
  return Timing(
      median_s=statistics.median(samples),
      samples_s=tuple(samples),
      iterations=n,
      method='fori_loop minus empty loop, L2 flushed by a read each call',
      flush_bytes=flush_bytes,
      clock=clock.summary(),
  )


def host_time(
    run: Callable[[], Any],
    *,
    sync: Callable[[Any], Any],
    flush: Callable[[], Any] | None = None,
    repeats: int = 20,
    warmup: int = 3,
) -> Timing:
  """Median wall time of `run()` for non-JAX callables (a last resort).

  Includes launch overhead; prefer `device_time`, or device events where the
  framework has them (the PyTorch peer uses CUDA events).
  """
  for _ in range(warmup):
    sync(run())
  samples = []
  with gpu_clock.ClockSampler.for_backend(jax.default_backend()) as clock:
    for _ in range(repeats):
      if flush is not None:
        sync(flush())
      start = time.perf_counter()
      sync(run())
      samples.append(time.perf_counter() - start)
  return Timing(
      median_s=statistics.median(samples),
      samples_s=tuple(samples),
      iterations=1,
      method='host wall clock per call',
      flush_bytes=0,
      clock=clock.summary(),
  )


def kernel_times(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[list]]:
  """Runs `fn(*args)` once (and waits); returns (its result, [[kernel name, total us, calls]]).

  CUPTI device timers, through the extension Mosaic GPU's profiler uses (GPU
  only), sorted by total time. For one call of a function that donates its
  arguments or changes state (a decode step, an engine iteration), so it
  cannot run twice.
  """
  # Private on purpose: the public `jax.experimental.mosaic.gpu.profiler.measure` (its CUPTI
  # mode uses this same extension) runs its function once more as a warm-up and jits it, which
  # a call that donates its state, or an engine iteration, cannot allow.
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
  except (ImportError, AttributeError) as e:
    raise RuntimeError(
        f'kernel_times needs the CUPTI hooks of jax {jax.__version__}\'s Mosaic GPU extension '
        '(a GPU jaxlib); they were not found') from e
  ext._cupti_init()
  try:
    result = jax.block_until_ready(fn(*args))
  finally:
    timings = ext._cupti_get_timings(True) or []
  by_name: dict[str, list] = {}
  for name, ms in timings:
    entry = by_name.setdefault(name, [name, 0.0, 0])
    entry[1] += ms * 1e3
    entry[2] += 1
  return result, sorted(([n, round(us, 1), c] for n, us, c in by_name.values()),
                        key=lambda e: -e[1])


def vjp_program(fn: Callable[..., Any], args: tuple, seed: int) -> tuple[Callable[..., Any], tuple]:
  """The jitted forward + backward of `fn` at `args`, and its arguments to time it with.

  The program is the VJP of all of fn's outputs into all of `args`; its first argument is
  standard-normal cotangents shaped like fn's outputs (drawn once from `seed`, as a loss would
  hand them over), then `args`. A `ones_like` made inside the timed function would be a
  broadcast that XLA writes out once per kernel reading it.
  """
  outs = jax.eval_shape(fn, *args)
  keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(outs))))
  cotangents = jax.tree.map(
      lambda o: jax.random.normal(next(keys), o.shape, jnp.float32).astype(o.dtype), outs)

  def run(cotangents, *args):
    _, vjp = jax.vjp(fn, *args)
    return vjp(cotangents)
  return jax.jit(run), (cotangents, *args)
