"""The public entry point: which implementation runs, and what happens when a kernel cannot."""

import logging
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

import hydrajax as hj
from hydrajax import devices
from hydrajax.attention import dispatch
from tests.conftest import assert_states_close, naive_tree_attention, random_inputs

on_cpu = pytest.mark.skipif(jax.default_backend() != 'cpu', reason='checks the CPU choice')


@pytest.fixture(scope='module')
def problem():
  plan = hj.plan_tree(
      hj.PromptNode(11, children=(hj.PromptNode(6, num_samples=2), hj.PromptNode(0))),
      private_capacity=3,
      private_lengths=[1, 3, 2],
  )
  q, k_cache, v_cache = random_inputs(60, plan, 1, 4, 2, 8, jnp.float32)
  return plan, (q, k_cache, v_cache, plan.to_device())


XLA = sys.modules['hydrajax.attention.xla']  # the XLA backend module


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
  """Each test sees the once-per-reason fallback warnings afresh."""
  monkeypatch.setattr(dispatch, '_warned', set())


@pytest.mark.parametrize('impl', ['xla', hj.AttentionImpl.XLA], ids=['string', 'enum'])
def test_xla_resolves_to_xla(impl, problem):
  _, args = problem
  assert dispatch.resolve(impl, *args) == (hj.AttentionImpl.XLA, XLA)
  plan = hj.prepare_attention(args[3], hj.AttentionShapes.of(*args[:2]), impl=impl)
  assert plan.impl is hj.AttentionImpl.XLA and plan.config == hj.XlaConfig()


@on_cpu
def test_auto_on_cpu_picks_xla(problem):
  plan, args = problem
  assert dispatch.default_kernel() is None
  assert dispatch.resolve(hj.AttentionImpl.AUTO, *args) == (hj.AttentionImpl.XLA, XLA)
  assert dispatch.resolve('auto', *args)[0] is hj.AttentionImpl.XLA
  got = hj.tree_attention(*args)  # AUTO is the default
  assert_states_close(got, naive_tree_attention(*args[:3], plan))
  assert_states_close(got, hj.tree_attention_xla(*args), rtol=0, atol=0)


def test_unknown_impl_raises(problem):
  _, args = problem
  with pytest.raises(ValueError, match=r"impl must be an AttentionImpl or one of \['auto', 'xla', 'mosaic_gpu', 'mosaic_tpu'\], got 'cuda'"):
    hj.tree_attention(*args, impl='cuda')


@on_cpu
@pytest.mark.parametrize(
    'impl', [hj.AttentionImpl.MOSAIC_GPU, hj.AttentionImpl.MOSAIC_TPU], ids=lambda i: i.value
)
def test_explicit_kernel_that_cannot_run_raises(impl, problem):
  # On CPU the kernel needs interpret mode; an explicit choice never falls back silently, and
  # the message names the argument of the public function that runs it anyway.
  _, args = problem
  match = rf'impl={impl.name} does not support these inputs: .+pass interpret=True'
  with pytest.raises(ValueError, match=match):
    hj.tree_attention(*args, impl=impl)


def test_device_check_is_one_function():
  assert dispatch.device_reason(hj.AttentionImpl.XLA) is None
  for impl in (hj.AttentionImpl.MOSAIC_GPU, hj.AttentionImpl.MOSAIC_TPU):
    assert dispatch.device_reason(impl, interpret=True) is None
  assert devices.is_hopper() == (devices.hopper_reason() is None)
  if jax.default_backend() == 'cpu':
    assert 'Hopper' in devices.hopper_reason()
    assert 'need a TPU' in dispatch.device_reason(hj.AttentionImpl.MOSAIC_TPU)


@pytest.mark.parametrize('kind, platform, hopper', [
    ('NVIDIA H100 80GB HBM3', 'gpu', True), ('NVIDIA H200', 'gpu', True),
    ('NVIDIA A100-SXM4-80GB', 'gpu', False), ('TPU v5p', 'tpu', False),
], ids=['h100', 'h200', 'a100', 'tpu'])
def test_the_abstract_mesh_device_decides_the_hopper_check(kind, platform, hopper):
  # A host with no GPU lowers for one (experiments.xla_programs): the mesh's device decides.
  # A host with a GPU checks its own device, mesh or not.
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=132, platform=platform)
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  local = devices.hopper_reason()
  with jax.sharding.use_abstract_mesh(mesh):
    reason = devices.hopper_reason()
    kernel_reason = dispatch.device_reason(hj.AttentionImpl.MOSAIC_GPU)
  if jax.default_backend() == 'gpu':
    assert reason == local
    return
  assert (reason is None) == hopper == (kernel_reason is None)
  if not hopper:
    assert 'needs a Hopper GPU' in reason and kind in reason
  assert f'the default backend is {jax.default_backend()}' in local


def test_a_config_of_another_backend_is_refused_for_an_explicit_impl(problem):
  _, args = problem
  from pallas_kernels.tpu.tree_attention import BlockSizes

  with pytest.raises(ValueError, match='config must be a XlaConfig for impl=XLA, got BlockSizes'):
    hj.tree_attention(*args, impl='xla', config=BlockSizes())
  # With AUTO the config of a backend that was not chosen is ignored.
  plan = hj.prepare_attention(args[3], hj.AttentionShapes.of(*args[:2]), config=BlockSizes())
  assert plan.config == hj.XlaConfig() or plan.impl is hj.AttentionImpl.MOSAIC_TPU


def test_a_tuple_of_configs_gives_each_backend_its_own(problem):
  _, args = problem
  from pallas_kernels.tpu.tree_attention import BlockSizes

  shapes = hj.AttentionShapes.of(*args[:2])
  xla = hj.XlaConfig(kv_block=64)
  assert hj.prepare_attention(args[3], shapes, impl='xla', config=(BlockSizes(),)).config == (
      hj.XlaConfig())
  assert hj.prepare_attention(args[3], shapes, impl='xla', config=(BlockSizes(), xla)).config is xla


# The dispatch logic itself, with stand-in kernel modules (no accelerator needed).


def _fake_kernel(reason):
  module = types.ModuleType('fake_tree_attention_kernel')
  module.calls = []
  module.DEFAULT_CONFIG = hj.XlaConfig(kv_block=7)
  module.default_config = lambda *, interpret: module.DEFAULT_CONFIG
  module.unsupported_reason = lambda shapes, layout, *, interpret: reason
  module.prepare = XLA.prepare

  def attend(q, k_cache, v_cache, prepared, *, scale, **kwargs):
    module.calls.append(scale)
    return XLA.attend(q, k_cache, v_cache, prepared, scale=scale, **kwargs)

  module.attend = attend
  return module


@pytest.fixture
def fake_gpu(monkeypatch):
  """Makes MOSAIC_GPU the backend's kernel and points it at a stand-in module."""

  def install(reason):
    module = _fake_kernel(reason)
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, hj.AttentionImpl.MOSAIC_GPU, module)
    monkeypatch.setattr(dispatch, 'default_kernel', lambda: hj.AttentionImpl.MOSAIC_GPU)
    monkeypatch.setattr(devices, 'hopper_reason', lambda: None)  # a Hopper GPU, as it were
    return module

  return install


@pytest.mark.parametrize(
    'impl', [hj.AttentionImpl.AUTO, hj.AttentionImpl.MOSAIC_GPU], ids=['auto', 'explicit']
)
def test_a_kernel_that_supports_the_inputs_runs(impl, fake_gpu, problem):
  _, args = problem
  module = fake_gpu(None)
  assert dispatch.resolve(impl, *args) == (hj.AttentionImpl.MOSAIC_GPU, module)
  plan = hj.prepare_attention(args[3], hj.AttentionShapes.of(*args[:2]), impl=impl)
  assert plan.impl is hj.AttentionImpl.MOSAIC_GPU and plan.config == hj.XlaConfig(kv_block=7)
  out = hj.tree_attention(*args, impl=impl, scale=0.5)
  assert module.calls == [0.5]
  assert_states_close(out, hj.tree_attention_xla(*args, scale=0.5))


def test_auto_falls_back_to_xla_visibly(fake_gpu, problem, caplog):
  _, args = problem
  module = fake_gpu('head dim 8 is not supported')
  message = 'falling back to XLA from MOSAIC_GPU: head dim 8 is not supported'
  with caplog.at_level(logging.INFO, logger=dispatch.__name__):
    with pytest.warns(hj.AttentionFallbackWarning, match=message):
      assert dispatch.resolve('auto', *args) == (hj.AttentionImpl.XLA, XLA)
    with warnings.catch_warnings():
      warnings.simplefilter('error')  # once per reason: no second warning
      hj.tree_attention(*args)
      plan = hj.prepare_attention(args[3], hj.AttentionShapes.of(*args[:2]))
  assert plan.impl is hj.AttentionImpl.XLA  # which implementation runs
  assert module.calls == []
  assert message in caplog.text
  module.unsupported_reason = lambda shapes, layout, *, interpret: 'another reason'
  with pytest.warns(hj.AttentionFallbackWarning, match='another reason'):
    hj.tree_attention(*args)


def test_explicit_unsupported_kernel_raises_with_the_reason(fake_gpu, problem):
  _, args = problem
  fake_gpu('head dim 8 is not supported')
  match = 'impl=MOSAIC_GPU does not support these inputs: head dim 8 is not supported'
  with pytest.raises(ValueError, match=match):
    hj.tree_attention(*args, impl='mosaic_gpu')
