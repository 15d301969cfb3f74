"""Converted parameters saved and restored with orbax, with the model's config beside them.

`save_params` writes a loaded (or trained) `Llama` once; `restore_params` reads it back,
straight into its shards with a mesh, far faster than converting a checkpoint again.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from models import sharding_rules as sr
from models.hf_loading import (
    abstract_model, check_fuse_qkv, fuse_kv, model_from_params, param_shardings, with_qkv)
from models.config import from_hf_dict
from models.llama import Llama, split_qkv


_CONFIG_FILE = 'llama_config.json'
_PARAMS_DIR = 'params'


def save_params(model: Llama, directory: str | os.PathLike) -> None:
  """Saves converted parameters with orbax, and the config next to them (a model after
  `fuse_qkv` as wq and wkv: one checkpoint layout)."""
  directory = os.path.abspath(os.fspath(directory))
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, _CONFIG_FILE), 'w') as f:
    json.dump(dict(hf=model.config.to_hf_dict(), name=model.config.name,
                   dtype=jnp.dtype(model.dtype).name), f, indent=1)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params['layers'] = {i: _unfused(layer, model.config.num_heads)
                      for i, layer in params['layers'].items()}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(directory, _PARAMS_DIR), params, force=True)
  checkpointer.wait_until_finished()


def _unfused(layer: dict, num_heads: int) -> dict:
  """A layer's parameters with `wqkv` (`Llama.fuse_qkv`) as wq and wkv."""
  if 'wqkv' not in layer:
    return layer
  layer = dict(layer)
  layer['wq'], layer['wkv'] = split_qkv(layer.pop('wqkv'), num_heads)
  return layer


def _saved_with_separate_kv(checkpointer, path: str) -> bool:
  """Whether the checkpoint predates the fused K/V weight (its layers hold `wk` and `wv`)."""
  metadata = checkpointer.metadata(path)
  tree = getattr(metadata, 'item_metadata', metadata)
  names = {getattr(keys[-1], 'key', None) for keys, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
  return 'wk' in names


def _split_kv(layer: dict) -> dict:
  """A layer's restore target with `wkv` [D, 2, K, H] as the `wk`, `wv` [D, K, H] it was saved as."""
  layer = dict(layer)
  wkv = layer.pop('wkv')
  shape = wkv.shape[:1] + wkv.shape[2:]
  sharding = getattr(wkv, 'sharding', None)
  if sharding is not None:  # the same spec without the pair axis
    spec = tuple(sharding.spec) + (None,) * (len(wkv.shape) - len(sharding.spec))
    sharding = sr.named_sharding(sharding.mesh, (spec[0], *spec[2:]))
  one = jax.ShapeDtypeStruct(shape, wkv.dtype, sharding=sharding)
  layer['wk'], layer['wv'] = one, one
  return layer


def restore_params(directory: str | os.PathLike, *, dtype=None, mesh=None,
                   fuse_qkv: bool | None = None) -> Llama:
  """Restores a `Llama` written by `save_params` (in its saved dtype unless `dtype` is given).

  With `mesh`, orbax restores every parameter straight into its shards. `fuse_qkv` as in
  `load_hf_checkpoint` (None: one q/k/v weight a layer wherever tp divides the kv heads).
  """
  check_fuse_qkv(fuse_qkv)
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(directory):
    raise ValueError(f'{directory} does not exist (or is not a folder): restore_params takes the '
                     'folder save_params wrote')
  config_file = os.path.join(directory, _CONFIG_FILE)
  if not os.path.exists(config_file):
    raise ValueError(f'no {_CONFIG_FILE} in {directory}: not written by save_params')
  with open(config_file) as f:
    saved = json.load(f)
  config = dataclasses.replace(from_hf_dict(saved['hf']), name=saved.get('name', ''))
  saved_dtype = jnp.dtype(saved['dtype'])
  mesh = sr.auto_mesh(mesh)
  sr.check_mesh(config, mesh)
  graphdef, state = nnx.split(abstract_model(config, saved_dtype))
  target = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, state), nnx.Param))
  if mesh is not None:  # abstract arrays carrying their target sharding
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          target, param_shardings(config, saved_dtype, mesh))
  path = os.path.join(directory, _PARAMS_DIR)
  checkpointer = ocp.StandardCheckpointer()
  if _saved_with_separate_kv(checkpointer, path):
    target['layers'] = {i: _split_kv(layer) for i, layer in target['layers'].items()}
  restored = checkpointer.restore(path, target)
  restored['layers'] = {i: fuse_kv(layer) for i, layer in restored['layers'].items()}
  dtype = saved_dtype if dtype is None else jnp.dtype(dtype)
  restored = jax.tree.map(lambda x: x.astype(dtype), restored)  # keeps the sharding
  return with_qkv(model_from_params(config, restored, dtype, mesh), fuse_qkv)
