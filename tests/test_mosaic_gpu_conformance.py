"""The tree-attention conformance suite on the Mosaic GPU kernels.

`TestMosaicGpuInterpret` runs in Mosaic GPU interpret mode on any machine once the Mosaic GPU
backend implements the plan protocol itself (`prepare`/`attend`; until then dispatch reaches it
through a shim and the suite is skipped: NaN in unattended tokens still leaks there, issue 13).
`TestMosaicGpuCompiled` runs compiled on a Hopper GPU.
"""

import importlib

import jax.numpy as jnp

import hydrajax as hj
from hydrajax import dispatch
from tests.tree_attention_conformance import Case, TreeAttentionConformance
from tests.tree_attention_conformance import pytest_generate_tests  # noqa: F401 (parametrizes)


def _protocol_reason() -> str | None:
  try:
    module = importlib.import_module(dispatch._BACKEND_MODULES[hj.AttentionImpl.MOSAIC_GPU])
  except ImportError as e:
    return f'cannot import the Mosaic GPU backend: {e}'
  if not hasattr(module, 'prepare'):
    return 'the Mosaic GPU backend does not implement prepare/attend yet (dispatch shims it)'
  return None


class _MosaicGpu(TreeAttentionConformance):
  impl = hj.AttentionImpl.MOSAIC_GPU
  head_dim = 64
  page_size = 8
  dtypes = (jnp.bfloat16, jnp.float16)
  cases = (
      Case(970, 2, (4, 2), 1, dtype_index=0, max_len=40, max_rows=3),
      Case(971, 3, (2, 1), 2, dtype_index=1, max_len=20, max_rows=3),
  )


class TestMosaicGpuInterpret(_MosaicGpu):
  interpret = True

  @classmethod
  def skip_reason(cls):
    return _protocol_reason()


class TestMosaicGpuCompiled(_MosaicGpu):
  interpret = False

  @classmethod
  def skip_reason(cls):
    return dispatch.hopper_reason()
