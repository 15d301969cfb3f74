"""The tree-attention conformance suite on the Mosaic GPU kernels, through the public API.

`TestMosaicGpuInterpret` runs in Mosaic GPU interpret mode on any machine (few, small cases:
interpret mode is slow); `TestMosaicGpuCompiled` runs compiled on a Hopper GPU.
"""

import jax.numpy as jnp

import hydrajax as hj
from hydrajax import devices
from pallas_kernels.mosaic_gpu.paged_decode import PagedProblem
from pallas_kernels.mosaic_gpu.tree_attention import MosaicGpuConfig
from tests.tree_attention_conformance import Case, TreeAttentionConformance
from tests.tree_attention_conformance import pytest_generate_tests  # noqa: F401 (parametrizes)


class _MosaicGpu(TreeAttentionConformance):
  impl = hj.AttentionImpl.MOSAIC_GPU
  head_dim = 64
  page_size = 8
  dtypes = (jnp.bfloat16, jnp.float16)
  cases = (
      Case(970, 2, (4, 2), 1, dtype_index=0, max_len=40, max_rows=3),
      Case(971, 3, (2, 1), 2, dtype_index=1, max_len=24, max_rows=3),
      # No shared segment: the paged-decode kernel (MHA, MQA).
      Case(976, 2, (4, 4), 2, dtype_index=1, max_rows=3, shared=False),
      Case(977, 2, (4, 1), 1, dtype_index=0, max_rows=3, shared=False),
  )


class TestMosaicGpuInterpret(_MosaicGpu):
  interpret = True


class TestMosaicGpuCompiled(_MosaicGpu):
  interpret = False

  @classmethod
  def skip_reason(cls):
    return devices.hopper_reason()


class TestMosaicGpuTokenLanesInterpret(_MosaicGpu):
  """Token lanes (`private_token_lanes`: a private lane is 8/h tokens of h = min(K, 8) kv heads)
  over random forests in scattered 8-token pages; T*G = 64/h folded rows a query row (a
  frame), so every batch fits."""

  representative_cases = {
      'test_random_tree_matches_oracle': ('depth=2_gqa_N=32_K=8_T=2_dtype0_seed=972', 'depth=2_gqa_N=16_K=2_T=4_dtype1_seed=975'),
  }

  interpret = True
  cases = (
      Case(972, 2, (32, 8), 2, dtype_index=0, max_len=30, max_rows=3),  # G = 4, T = 2
      Case(973, 3, (64, 8), 1, dtype_index=1, max_len=24, max_rows=3),  # G = 8
      Case(974, 2, (32, 4), 2, dtype_index=0, max_len=30, max_rows=3),  # h = 4: G = 8, T = 2
      Case(975, 2, (16, 2), 4, dtype_index=1, max_len=24, max_rows=3),  # h = 2: G = 8, T = 4
  )

  @property
  def config(self):
    return MosaicGpuConfig(private_token_lanes=True)

  def test_the_cases_take_token_lanes(self):
    for case in self.cases:
      p = self.problem(case)
      assert self.prepare(p.plan.to_device(), p.q, p.k).prepared.problem.token_lanes


def test_unshared_cases_run_the_paged_kernel():
  for case in _MosaicGpu.cases:
    p = TestMosaicGpuInterpret().problem(case)
    plan = TestMosaicGpuInterpret().prepare(p.plan.to_device(), p.q, p.k)
    assert isinstance(plan.prepared.problem, PagedProblem) == (not case.shared), case.id


def test_interpret_mode_prepares_the_kernels_not_a_fallback():
  """A plan_tree layout of the conformance shapes resolves to the kernels (no silent XLA run)."""
  tree = hj.PromptNode(24, children=(hj.PromptNode(8, num_samples=2), hj.PromptNode(5)))
  plan = hj.plan_tree(tree, private_capacity=8, private_lengths=1)
  shapes = hj.AttentionShapes(num_rows=plan.num_rows, query_tokens=1, num_heads=4, num_kv_heads=2,
                              head_dim=64, kv_tokens=plan.kv_tokens, dtype=jnp.bfloat16)
  attn = hj.prepare_attention(plan.to_device(), shapes, impl='mosaic_gpu', interpret=True)
  assert attn.impl is hj.AttentionImpl.MOSAIC_GPU and attn.interpret
