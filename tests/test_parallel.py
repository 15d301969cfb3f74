"""Head-sharded tree attention on fake CPU devices equals the unsharded result.

tests/conftest.py asks XLA for 8 host devices before jax starts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from hydrajax.attention.parallel import tree_attention_sharded
from tests.tree_attention_conformance import Case, assert_close, naive_tree_attention, random_problem

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason='needs 4 devices (tests/conftest.py sets XLA_FLAGS before jax)')

_PLAN = hj.plan_tree(
    hj.PromptNode(37, children=(hj.PromptNode(5, num_samples=3), hj.PromptNode(0, num_samples=2))),
    private_capacity=9, private_lengths=[1, 4, 9, 2, 3])


def _inputs(seed, n, k):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (_PLAN.num_rows, 1, n, 16))
  k_cache = jax.random.normal(kk, (_PLAN.kv_tokens, k, 16))
  v_cache = jax.random.normal(kv, (_PLAN.kv_tokens, k, 16))
  return q, k_cache, v_cache


# (N, K): GQA with K over tp; MHA; MQA; kv heads fewer than tp (each read by tp / K devices).
@pytest.mark.parametrize('n,k', [(8, 4), (8, 8), (4, 1), (8, 2)])
@pytest.mark.parametrize('axis_type', ['explicit', 'auto'])
def test_sharded_equals_oracle_on_four_fake_devices(n, k, axis_type):
  types = None if axis_type == 'explicit' else (jax.sharding.AxisType.Auto,)
  mesh = jax.make_mesh((4,), ('tp',), axis_types=types, devices=jax.devices()[:4])
  q, k_cache, v_cache = _inputs(n + k, n, k)
  layout = _PLAN.to_device()
  got = jax.jit(lambda q, k, v: tree_attention_sharded(q, k, v, layout, mesh=mesh, impl='xla'))(
      q, k_cache, v_cache)
  expected = hj.naive_tree_attention(q, k_cache, v_cache, _PLAN)
  np.testing.assert_allclose(got.out, expected.out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got.lse, expected.lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('tp,heads,t,dtype', [
    (2, (8, 2), 2, 'bfloat16'), (4, (8, 8), 3, 'float32'), (4, (4, 1), 1, 'bfloat16')])
def test_sharded_random_forests_match_the_oracle(tp, heads, t, dtype):
  # Fresh random forests (the conformance suite's generator: ragged pages, empty segments).
  seed = int(np.random.default_rng().integers(1 << 30))
  print(f'seed={seed}')  # shown on failure
  case = Case(seed, 3, heads, t, max_len=40, max_rows=4)
  p = random_problem(case, head_dim=16, dtype=jnp.dtype(dtype), page_size=8)
  mesh = jax.make_mesh((tp,), ('tp',), devices=jax.devices()[:tp])
  got = tree_attention_sharded(p.q, p.k, p.v, p.plan.to_device(), mesh=mesh, impl='xla')
  assert_close(got, naive_tree_attention(p.q, p.k, p.v, p.plan), p.q.dtype)


def test_heads_that_do_not_divide_raise():
  mesh = jax.make_mesh((4,), ('tp',), devices=jax.devices()[:4])
  q, k_cache, v_cache = _inputs(0, 2, 1)
  with pytest.raises(ValueError, match='N=2'):
    tree_attention_sharded(q, k_cache, v_cache, _PLAN.to_device(), mesh=mesh)
  q, k_cache, v_cache = _inputs(0, 12, 3)
  with pytest.raises(ValueError, match='kv heads K=3'):
    tree_attention_sharded(q, k_cache, v_cache, _PLAN.to_device(), mesh=mesh)
  with pytest.raises(ValueError, match="head_axis 'model'"):
    tree_attention_sharded(q, k_cache, v_cache, _PLAN.to_device(), mesh=mesh, head_axis='model')


def test_mosaic_gpu_kernels_trace_under_the_head_shard_map():
  """The kernels' pallas_calls pass shard_map's check_vma (lowered, not run: Mosaic GPU
  interpret mode fails on several fake devices, its barrier bookkeeping is per process)."""
  from jax.sharding import PartitionSpec as P
  from pallas_kernels.mosaic_gpu import tree_attention as mosaic

  plan = hj.plan_tree(hj.PromptNode(37, children=(hj.PromptNode(100, num_samples=2),
                                                  hj.PromptNode(0, num_samples=1))),
                      private_capacity=64, private_lengths=[3, 5, 2])
  q = jax.ShapeDtypeStruct((plan.num_rows, 1, 4, 64), jax.numpy.bfloat16)
  kv = jax.ShapeDtypeStruct((plan.kv_tokens, 2, 64), jax.numpy.bfloat16)
  layout = plan.to_device()
  mesh = jax.make_mesh((2,), ('tp',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  heads, kv_heads = P(None, None, 'tp', None), P(None, 'tp', None)
  fn = jax.shard_map(
      lambda q, k, v, lay: mosaic.tree_attention(q, k, v, lay, interpret=True), mesh=mesh,
      in_specs=(heads, kv_heads, kv_heads, jax.tree.map(lambda _: P(), layout)),
      out_specs=hj.PartialState(heads, P(None, None, 'tp')))
  lowered = jax.jit(fn).lower(q, kv, kv, layout)
  assert lowered.out_info.out.shape == q.shape

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_sharded_equals_oracle_on_four_fake_devices': ('explicit-8-2', 'auto-4-1', 'auto-8-8'),
}
