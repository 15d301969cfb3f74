"""The package's metadata agrees with itself: ranges, the GPU image lock, license, py.typed."""

import importlib.metadata
import pathlib
import tomllib

import pytest

specifiers = pytest.importorskip('packaging.specifiers')
requirements = pytest.importorskip('packaging.requirements')

ROOT = pathlib.Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
LOCK = ROOT / 'requirements' / 'gpu-image.txt'
JAX_STACK = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint')


def _ranges() -> dict[str, specifiers.SpecifierSet]:
  reqs = [requirements.Requirement(r) for r in PROJECT['dependencies']]
  return {r.name: r.specifier for r in reqs}


def _lock() -> dict[str, str]:
  pins = {}
  for line in LOCK.read_text().splitlines():
    line = line.split('#')[0].strip()
    if line:
      name, version = line.split('==')
      pins[name.strip()] = version.strip()
  return pins


def test_the_lock_pins_the_jax_stack_inside_the_ranges():
  ranges, pins = _ranges(), _lock()
  assert set(pins) == set(JAX_STACK)
  for name, version in pins.items():
    if name in ranges:  # jaxlib comes with jax
      assert version in ranges[name], f'{name}=={version} is outside pyproject\'s {ranges[name]}'
  assert pins['jaxlib'] == pins['jax']


def test_ranges_are_bounded_and_admit_a_newer_jax_than_the_lock():
  ranges, pins = _ranges(), _lock()
  for name in ('jax', 'flax', 'optax', 'orbax-checkpoint'):
    assert any(s.operator == '<' for s in ranges[name]), f'{name}: no upper bound'
  assert '0.12.0' in ranges['jax'] and pins['jax'] != '0.12.0'


def test_accelerator_extras_follow_jax():
  extras = PROJECT['optional-dependencies']
  jax_range = str(_ranges()['jax'])
  for extra in ('cuda12', 'cuda13', 'tpu'):
    (req,) = (requirements.Requirement(r) for r in extras[extra])
    assert (req.name, req.extras, str(req.specifier)) == ('jax', {extra}, jax_range)


def test_installed_jax_stack_is_inside_the_ranges():
  """Whatever environment runs the suite (`make test`, `make test-newest`) is a supported one."""
  ranges = _ranges()
  for name in ('jax', 'flax', 'optax', 'orbax-checkpoint'):
    try:
      version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pytest.skip(f'{name} is not installed as a distribution')
    assert version in ranges[name], f'installed {name} {version} is outside {ranges[name]}'


def test_license_and_typing_markers():
  assert PROJECT['license'] == 'Apache-2.0' and PROJECT['license-files'] == ['LICENSE']
  text = (ROOT / 'LICENSE').read_text()
  assert 'Apache License' in text and 'Version 2.0, January 2004' in text
  data = tomllib.loads((ROOT / 'pyproject.toml').read_text())['tool']['setuptools']['package-data']
  for package in ('hydrajax', 'pallas_kernels', 'models'):
    assert (ROOT / package / 'py.typed').exists() and 'py.typed' in data[package]
