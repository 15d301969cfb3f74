"""Compiling for TPU on a host without one: named topologies, compiled-program statistics.

libtpu (`pip install "jax[tpu]"`, or the bare `libtpu` wheel on the path) holds the TPU
compiler, and `jax.experimental.topologies` gives the devices of a named slice (`v5e:2x4`)
with no chip attached. A `jax.jit(f).lower(*structs).compile()` whose arguments are placed on
those devices (a `NamedSharding` of a mesh over them) then runs the real TPU compiler: XLA's
passes and the Mosaic compiler for every Pallas kernel. Run with `JAX_PLATFORMS=cpu` (the
default backend stays the CPU) and `TPU_SKIP_MDS_QUERY=1` (no cloud metadata lookup).

The statistics read back are the compiler's own: `memory_analysis()` (argument, output and
temporary bytes per chip), `cost_analysis()` (flops, bytes accessed, and `optimal_seconds`,
the compiler's time estimate) and the collectives of the optimized HLO text.
"""

import dataclasses
import functools
import re

import jax
import numpy as np
from jax.experimental import topologies


@dataclasses.dataclass(frozen=True)
class Chip:
  """Published per-chip figures (Cloud TPU system-architecture pages; `ROOFLINE.md`)."""

  hbm_bytes: int
  peak_bf16_flops: float  # per chip, every TensorCore
  hbm_bytes_per_s: float


CHIPS = {  # by the topology name's generation prefix
    'v5e': Chip(16 * 2**30, 197e12, 819e9),
    'v5p': Chip(95 * 2**30, 459e12, 2765e9),
    'v6e': Chip(32 * 2**30, 918e12, 1640e9),
}
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
                'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}


def generation(topology: str) -> str:
  """'v5e:2x4' -> 'v5e' (ValueError for a generation not in CHIPS)."""
  gen = topology.split(':')[0]
  if gen not in CHIPS:
    raise ValueError(f'topology must start with one of {sorted(CHIPS)}, got {topology!r}')
  return gen


@functools.cache
def devices(topology: str) -> tuple:
  """The TPU devices of a named slice, e.g. 'v5e:2x2', 'v5p:2x2x1', 'v6e:1x1'.

  One chip ('1x1') is one host of one chip; larger slices take the generation's default host.
  Raises RuntimeError without libtpu.
  """
  generation(topology)
  dims = topology.split(':')[1].split('x')
  kwargs = {}
  if all(d == '1' for d in dims):  # a single chip is not a multiple of the default 2x2 host
    kwargs['chips_per_host_bounds'] = (1, 1, 1)
  return tuple(topologies.get_topology_desc(topology_name=topology, platform='tpu',
                                            **kwargs).devices)


def libtpu_reason() -> str | None:
  """Why TPU programs cannot be compiled here (libtpu missing or failing), or None."""
  try:
    devices('v5e:2x2')
  except Exception as e:  # noqa: BLE001 (any failure of the plugin is the reason)
    return f'libtpu cannot make a TPU topology ({type(e).__name__}: {str(e)[:200]})'
  return None


def mesh(topology: str, shape: tuple[int, ...] = (1,), names: tuple[str, ...] = ('x',),
         ) -> jax.sharding.Mesh:
  """A mesh over the first prod(shape) devices of `topology` (automatic axes)."""
  count = int(np.prod(shape))
  found = devices(topology)
  if count > len(found):
    raise ValueError(f'mesh {dict(zip(names, shape))} needs {count} devices; {topology} has '
                     f'{len(found)}')
  return jax.sharding.Mesh(np.array(found[:count]).reshape(shape), names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def placed(tree, sharding):
  """Every array (or ShapeDtypeStruct) of `tree` as a struct placed with `sharding`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {'count', 'bytes'}} of the collectives in an optimized HLO module's text (async
  `-start` ops counted once; bytes: the result's, summed over the ops of a kind)."""
  found = {}
  for kind in COLLECTIVES:
    pattern = rf'= (\([^=]*?\)|\S+) {kind}(?:-start)?\('
    ops = re.findall(pattern, hlo_text)
    found[kind] = {'count': len(ops), 'bytes': sum(_shape_bytes(s) for s in ops)}
  return found


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in re.findall(r'([a-z]+\d*)\[([\d,]*)\]', shape):
    total += _DTYPE_BYTES.get(dtype, 0) * int(np.prod([int(d) for d in dims.split(',') if d]))
  return total


def _estimate(cost) -> float | None:
  """The compiler's time estimate in seconds; None where it gave none (a negative value)."""
  seconds = cost.get('optimal_seconds')
  return None if seconds is None or seconds < 0 else float(seconds)


def stats(compiled, topology: str) -> dict:
  """The compiler's numbers for one compiled program, per chip, with the chip's roofline."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  chip = CHIPS[generation(topology)]
  per_chip = {name: int(getattr(memory, f'{name}_size_in_bytes'))
              for name in ('argument', 'output', 'temp', 'alias', 'generated_code')}
  resident = per_chip['argument'] + per_chip['output'] - per_chip['alias'] + per_chip['temp']
  flops, moved = float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))
  return dict(
      bytes=per_chip, resident_bytes=resident, hbm_bytes=chip.hbm_bytes,
      fits_hbm=resident <= chip.hbm_bytes, flops=flops, bytes_accessed=moved,
      compiler_seconds=_estimate(cost),
      roofline_seconds=max(flops / chip.peak_bf16_flops, moved / chip.hbm_bytes_per_s),
      collectives=collectives(compiled.as_text()),
      mosaic_kernels=compiled.as_text().count('custom_call_target="tpu_custom_call"'),
  )
