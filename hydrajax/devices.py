"""The one device check of the Pallas kernels: is this machine (or the abstract mesh's device)
the accelerator a kernel compiles for.

Under `jax.sharding.use_abstract_mesh` with a named device, that device decides, so a host
without the accelerator can lower for it (`jax.export` with platforms=['cuda'] or ['tpu']).
Interpret mode runs the kernels anywhere, so a reason never applies with `interpret=True`.
"""

import jax

HOPPER_KINDS = ('h100', 'h200', 'h800', 'gh200')
INTERPRET_HINT = 'pass interpret=True to run it in interpret mode'


def hopper_reason() -> str | None:
  """None on a Hopper GPU (compute capability 9.0), else why not.

  On a host with no GPU, under `jax.sharding.use_abstract_mesh` with a GPU device, that device
  decides (by its kind: an abstract device has no compute capability), as in `tpu_reason`: the
  host lowers for that GPU (`experiments.xla_programs`). A host with a GPU checks its own.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  if jax.default_backend() == 'gpu' or device is None:
    if jax.default_backend() != 'gpu':
      return f'needs a Hopper GPU, the default backend is {jax.default_backend()}'
    device = jax.devices()[0]
  elif device.platform not in ('gpu', 'cuda'):
    return f'needs a Hopper GPU, the mesh\'s device is {device.device_kind} ({device.platform})'
  capability = getattr(device, 'compute_capability', None)
  if capability is not None:
    if str(capability) not in ('9.0', '9.0a'):
      return (
          f'needs a Hopper GPU (compute capability 9.0), found {device.device_kind} ({capability})'
      )
    return None
  kind = device.device_kind.lower()
  if not any(name in kind for name in HOPPER_KINDS):
    return f'needs a Hopper GPU, found {device.device_kind}'
  return None


def is_hopper() -> bool:
  return hopper_reason() is None


def tpu_reason() -> str | None:
  """None on a TPU backend, or under `jax.sharding.use_abstract_mesh` with a TPU device.

  The second form lets a CPU host lower (e.g. `jax.export` with platforms=['tpu']) for a
  named TPU generation.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  platform = device.platform if device is not None else jax.default_backend()
  if platform == 'tpu':
    return None
  return f'Mosaic TPU kernels need a TPU (the default backend is {platform})'


def with_interpret_hint(reason: str | None, *, interpret: bool) -> str | None:
  """`reason` unless `interpret` (interpret mode runs anywhere), with the way around it."""
  if interpret or reason is None:
    return None
  return f'{reason}; {INTERPRET_HINT}'


def target_device(*arrays):
  """The device a kernel call compiles for: the abstract mesh's device where
  `jax.sharding.use_abstract_mesh` names one, else the device of the first concrete input
  array (not a tracer), else the default backend's first device."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  if device is not None:
    return device
  for x in arrays:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      return next(iter(x.sharding.device_set))
  return jax.devices()[0]
