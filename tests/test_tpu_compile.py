"""The TPU compiler (libtpu, no TPU attached) compiles every Mosaic TPU kernel and a sharded
Llama step through the public entry points, for TPU v5e and v6e (and each generation's default
block sizes on its own chip, v5p included).

`make test-tpu` puts the libtpu wheel on the path and runs this file with JAX_PLATFORMS=cpu
(the CPU stays the default backend; `pallas_kernels.tpu.aot`). Without libtpu the module is
skipped, with the reason.

Each kernel case compiles `hj.tree_attention(impl='mosaic_tpu')` (the inference private and
shared kernels) or the gradient of `prefill_attention(impl='mosaic_tpu')` (the training
forward, dK/dV and dQ kernels) on one chip, at small shapes, in bf16 and f32; head dim 64 packs
two kv heads a 128-lane block. The model case compiles one Llama-2 7B decode step (abstract
parameters, no weights) for a v5e 2x4 slice at tp=8 and counts its collectives.
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

import hydrajax as hj
from experiments import tpu_programs
from models import sharding_rules as sr
from models.config import get_config
from pallas_kernels.tpu import aot
from pallas_kernels.tpu import tree_attention as tpu
from pallas_kernels.tpu.block_sizes import BLOCK_SIZES_BY_GENERATION

if importlib.util.find_spec('libtpu') is None:
  pytest.skip('libtpu cannot be imported (`make test-tpu` installs it and runs this file)',
              allow_module_level=True)
if os.environ.get('JAX_PLATFORMS') != 'cpu':
  pytest.skip('run with JAX_PLATFORMS=cpu (`make test-tpu`): libtpu must not become the default '
              'backend of a host without a TPU', allow_module_level=True)

CHIPS = ['v5e:1x1', 'v6e:1x1']
ONE_CHIP = {'v5e': 'v5e:1x1', 'v5p': 'v5p:2x2x1', 'v6e': 'v6e:1x1'}  # v5p: the first of 4
DTYPES = [jnp.bfloat16, jnp.float32]


def _mosaic_kernels(compiled) -> int:
  return compiled.as_text().count('custom_call_target="tpu_custom_call"')


@pytest.mark.parametrize('chip', CHIPS)
@pytest.mark.parametrize('dtype,head_dim', [(jnp.bfloat16, 128), (jnp.float32, 128),
                                            (jnp.bfloat16, 64)], ids=['bf16', 'f32', 'bf16_h64'])
def test_tree_attention_compiles(chip, dtype, head_dim):
  """The private and the shared kernel, for a prefix shared by 16 rows and GQA 8/2."""
  compiled = tpu_programs.tree_attention_kernels(chip, batch=16, prefix=300, heads=8, kv_heads=2,
                                            head_dim=head_dim, dtype=dtype)
  assert _mosaic_kernels(compiled) == 2
  assert aot.stats(compiled, chip)['fits_hbm']


@pytest.mark.parametrize('chip', CHIPS)
@pytest.mark.parametrize('dtype', DTYPES, ids=['bf16', 'f32'])
def test_training_kernels_compile(chip, dtype):
  """The gradient of the prefill attention: the prompt's causal part, the completions' prompt
  segment and their own causal part, each a forward, a dK/dV and a dQ kernel."""
  compiled = tpu_programs.training_kernels(chip, prompt=256, group=2, completion=128, heads=4,
                                      kv_heads=2, head_dim=128, dtype=dtype)
  assert _mosaic_kernels(compiled) == 9


@pytest.mark.parametrize('generation', sorted(BLOCK_SIZES_BY_GENERATION))
def test_block_sizes_table_entry_compiles_for_its_chip(generation):
  """With no config, the kernels take the entry of the abstract mesh's chip; its blocks
  compile at their full size: 32 rows of T = block_rows / 64 tokens, 8/4 heads (G = 2, so a
  row tile of block_rows query rows; 4 kv heads fill 512 lanes) over a prefix of one kv
  block, in bf16."""
  chip, entry = ONE_CHIP[generation], BLOCK_SIZES_BY_GENERATION[generation]
  with jax.sharding.use_abstract_mesh(aot.mesh(chip).abstract_mesh):
    assert tpu.default_config() is entry
  compiled = tpu_programs.tree_attention_kernels(
      chip, batch=32, prefix=entry.block_kv, heads=8, kv_heads=4, head_dim=128,
      query_tokens=entry.block_rows // 64)
  assert _mosaic_kernels(compiled) == 2


def test_head_dim_64_mqa_compiles():
  """One kv head of 64: the block is the whole (64-lane) row of the buffer."""
  compiled = tpu_programs.tree_attention_kernels('v5e:1x1', batch=8, prefix=200, heads=4,
                                            kv_heads=1, head_dim=64)
  assert _mosaic_kernels(compiled) == 2


def test_7b_decode_step_on_8_chips_has_one_all_reduce_per_projection():
  """Llama-2 7B, tp=8 over a v5e 2x4 slice (two hosts of 4 chips): the attention of every layer
  runs the two Mosaic kernels per chip; wo and w_down are followed by one all-reduce each, and
  the vocab-parallel embedding lookup by one more; nothing else communicates."""
  config = get_config('llama2_7b')
  mesh = aot.mesh('v5e:2x4', (8,), (sr.TP,))
  plan = tpu_programs.decode_plan(32, 1024)
  compiled = tpu_programs.model_step(config, mesh, rows=plan.num_rows, query_tokens=1, plan=plan)
  stats = aot.stats(compiled, 'v5e:2x4')
  counts = {kind: c['count'] for kind, c in stats['collectives'].items()}
  assert counts == {'all-reduce': 2 * config.num_layers + 1, 'all-gather': 0,
                    'reduce-scatter': 0, 'all-to-all': 0, 'collective-permute': 0}, counts
  assert stats['mosaic_kernels'] == 2 * config.num_layers
  # Each chip holds an eighth of the weights (~13.5 GB in bf16) and fits its 16 GiB.
  assert stats['bytes']['argument'] < 2.5 * 2**30 and stats['fits_hbm']
