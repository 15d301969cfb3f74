"""Frozen kernel configs from 'name=value' items: the experiments' knob flags
(`--mosaic_gpu_knobs`, `experiments.mosaic_gpu.check_training --configs`) parse through here."""

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

Config = TypeVar('Config')


def config_from_knobs(cls: type[Config], knobs: Iterable[str]) -> Config:
  """`cls` (a dataclass) with the fields the items name; the others keep their defaults.

  Each item is 'name=value' with value true, false, none or an integer (blank items are
  skipped); `cls.__post_init__` then checks the values' ranges.
  """
  fields = {f.name for f in dataclasses.fields(cls)}
  values = {}
  for item in filter(None, (x.strip() for x in knobs)):
    name, sep, value = item.partition('=')
    if not sep or name not in fields:
      raise ValueError(f'knob {item!r} must be name=value with a name in {sorted(fields)}')
    lower = value.strip().lower()
    if lower in ('true', 'false', 'none'):
      values[name] = None if lower == 'none' else lower == 'true'
      continue
    try:
      values[name] = int(lower)
    except ValueError:
      raise ValueError(f'knob {name}={value!r}: true, false, none or an integer') from None
  return cls(**values)
