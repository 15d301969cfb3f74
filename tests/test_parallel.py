"""Head-sharded tree attention on fake CPU devices equals the unsharded result."""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import hydrajax as hj
    from hydrajax.parallel import tree_attention_sharded
    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ('tp',), axis_types=(jax.sharding.AxisType.Auto,))
    tree = hj.PromptNode(37, children=(hj.PromptNode(5, num_samples=3), hj.PromptNode(0, num_samples=2)))
    plan = hj.plan_tree(tree, private_capacity=9, private_lengths=[1, 4, 9, 2, 3])
    for seed, (n, k) in enumerate([(8, 4), (8, 8), (4, 1)]):
      kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
      q = jax.random.normal(kq, (plan.num_rows, 1, n, 16))
      k_cache = jax.random.normal(kk, (plan.kv_tokens, k, 16))
      v_cache = jax.random.normal(kv, (plan.kv_tokens, k, 16))
      layout = plan.to_device()
      got = jax.jit(lambda q, k, v: tree_attention_sharded(q, k, v, layout, mesh=mesh, impl='xla'))(q, k_cache, v_cache)
      expected = hj.naive_tree_attention(q, k_cache, v_cache, plan)
      np.testing.assert_allclose(got.out, expected.out, atol=2e-5, rtol=2e-5)
      np.testing.assert_allclose(got.lse, expected.lse, atol=2e-5, rtol=2e-5)
    try:
      tree_attention_sharded(q[:, :, :2], k_cache[:, :1], v_cache[:, :1], layout, mesh=mesh)
    except ValueError as e:
      assert 'N=2' in str(e), e
    else:
      raise AssertionError('expected a ValueError for N=2 over 4 devices')
    print('sharded ok')
    """
)


def test_sharded_equals_oracle_on_four_fake_devices():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4', JAX_PLATFORMS='cpu')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, '-c', _SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'sharded ok' in result.stdout
