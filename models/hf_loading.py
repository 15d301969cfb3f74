"""Hugging Face Llama checkpoints -> `Llama`, and orbax save/restore of converted params.

A HF folder holds `config.json` and either `model.safetensors` or shards
listed by `model.safetensors.index.json`. Tensors are read one at a time
(numpy, bf16 through ml_dtypes), transposed to our layouts, cast and stacked
over layers:

  model.embed_tokens.weight             [V, D]    -> embed [V, D]
  layers.i.self_attn.q_proj.weight      [N*H, D]  -> layers.wq [layers, D, N, H]
  layers.i.self_attn.{k,v}_proj.weight  [K*H, D]  -> layers.wkv [layers, D, 2, K, H] (k, v)
  layers.i.self_attn.o_proj.weight      [D, N*H]  -> layers.wo [layers, N, H, D]
  layers.i.mlp.{gate,up}_proj.weight    [F, D]    -> layers.w_gate, w_up [layers, D, F]
  layers.i.mlp.down_proj.weight         [D, F]    -> layers.w_down [layers, F, D]
  layers.i.{input,post_attention}_layernorm.weight -> layers.attn_norm, mlp_norm [layers, D]
  model.norm.weight                     [D]       -> final_norm
  lm_head.weight                        [V, D]    -> lm_head [D, V] (absent when tied)

HF's q/k projections are already in the rotate-half RoPE layout we use.
Missing, unexpected or mis-shaped tensors raise ValueError naming them; a
damaged folder raises `CheckpointError` naming the file (see
`load_hf_checkpoint`). With `mesh=`, parameters go straight into their shards.
"""

import contextlib
import json
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from safetensors import safe_open

from models import sharding_rules as sr
from models.config import LlamaConfig, load_hf_config
from models.llama import Llama

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # buffers some old checkpoints saved

# Per-layer HF tensor -> (our stacked parameter, converter from HF's array given the config).
_LAYER_TENSORS: dict[str, tuple[str, Callable[[np.ndarray, LlamaConfig], np.ndarray]]] = {
    'input_layernorm.weight': ('attn_norm', lambda w, c: w),
    'self_attn.q_proj.weight': ('wq', lambda w, c: w.T.reshape(c.dim, c.num_heads, c.head_dim)),
    'self_attn.o_proj.weight': ('wo', lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.dim)),
    'post_attention_layernorm.weight': ('mlp_norm', lambda w, c: w),
    'mlp.gate_proj.weight': ('w_gate', lambda w, c: w.T),
    'mlp.up_proj.weight': ('w_up', lambda w, c: w.T),
    'mlp.down_proj.weight': ('w_down', lambda w, c: w.T),
}
# HF's k_proj and v_proj -> one parameter [D, 2, K, H], k at 0 and v at 1 (`DecoderLayer.wkv`).
_KV_TENSORS = ('self_attn.k_proj.weight', 'self_attn.v_proj.weight')


def _kv_weight(get: Callable[[str], np.ndarray], layer: int, c: LlamaConfig) -> np.ndarray:
  kv = [get(f'model.layers.{layer}.{name}').T.reshape(c.dim, c.num_kv_heads, c.head_dim)
        for name in _KV_TENSORS]
  return np.stack(kv, axis=1)


def fuse_kv(layer: dict) -> dict:
  """A layer's parameters saved before K and V were one weight (`wk`, `wv`) -> with `wkv`."""
  if 'wk' not in layer:
    return layer
  layer = dict(layer)
  wk, wv = layer.pop('wk'), layer.pop('wv')
  stack = np.stack if isinstance(wk, np.ndarray) else jnp.stack
  layer['wkv'] = stack([wk, wv], axis=1)
  return layer


def expected_hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor a HF LlamaForCausalLM checkpoint of this config holds, with its shape."""
  c = config
  per_layer = {
      'input_layernorm.weight': (c.dim,),
      'self_attn.q_proj.weight': (c.num_heads * c.head_dim, c.dim),
      'self_attn.k_proj.weight': (c.num_kv_heads * c.head_dim, c.dim),
      'self_attn.v_proj.weight': (c.num_kv_heads * c.head_dim, c.dim),
      'self_attn.o_proj.weight': (c.dim, c.num_heads * c.head_dim),
      'post_attention_layernorm.weight': (c.dim,),
      'mlp.gate_proj.weight': (c.mlp_dim, c.dim),
      'mlp.up_proj.weight': (c.mlp_dim, c.dim),
      'mlp.down_proj.weight': (c.dim, c.mlp_dim),
  }
  shapes = {'model.embed_tokens.weight': (c.vocab_size, c.dim), 'model.norm.weight': (c.dim,)}
  for i in range(c.num_layers):
    shapes.update({f'model.layers.{i}.{k}': v for k, v in per_layer.items()})
  if not c.tie_embeddings:
    shapes['lm_head.weight'] = (c.vocab_size, c.dim)
  return shapes


class CheckpointError(ValueError):
  """A checkpoint folder that cannot be loaded; the message names the file and what is wrong."""


# Weights must be floating point (ml_dtypes' bfloat16 included); others are refused.
_FLOAT_DTYPES = ('F16', 'BF16', 'F32', 'F64')


def _read_json(file: str, what: str):
  try:
    with open(file) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f'{file}: {what} is not valid JSON ({e})') from None
  except UnicodeDecodeError as e:
    raise CheckpointError(f'{file}: {what} is not UTF-8 text ({e})') from None


def _inside(folder: str, file: str) -> bool:
  folder = os.path.realpath(folder)
  return os.path.commonpath([folder, os.path.realpath(file)]) == folder


def safetensors_files(path: str | os.PathLike) -> dict[str, str]:
  """Tensor name -> file, for a single-file or an index-sharded checkpoint folder."""
  path = os.fspath(path)
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    content = _read_json(index, 'the shard index')
    weight_map = content.get('weight_map') if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f'{index}: needs a non-empty "weight_map" object of tensor -> file')
    files = {}
    for name, file in weight_map.items():
      if not isinstance(file, str) or not file:
        raise CheckpointError(f'{index}: weight_map[{name!r}] must be a file name, got {file!r}')
      full = os.path.join(path, file)
      if os.path.isabs(file) or not _inside(path, full):
        raise CheckpointError(f'{index}: weight_map[{name!r}] = {file!r} points outside the '
                              f'checkpoint folder {path}: refused')
      files[name] = full
    for file in sorted(set(files.values())):
      if not os.path.exists(file):
        raise CheckpointError(
            f'{INDEX_FILE} lists {os.path.basename(file)}, which is not in {path}')
    return files
  single = os.path.join(path, SINGLE_FILE)
  if os.path.exists(single):
    with _safe_open(single) as f:
      return {name: single for name in f.keys()}
  raise CheckpointError(f'no {SINGLE_FILE} or {INDEX_FILE} in {path}')


@contextlib.contextmanager
def _safe_open(file: str):
  """safe_open whose errors (a truncated file, a bad header) name the file."""
  try:
    handle = safe_open(file, 'numpy')
  except Exception as e:  # safetensors raises its own SafetensorError and OSError
    raise CheckpointError(f'{file}: not a readable safetensors file (truncated or corrupt?): '
                          f'{e}') from None
  with handle as f:
    yield f


@contextlib.contextmanager
def _open_all(files: dict[str, str]) -> Iterator[tuple[Callable, Callable]]:
  """Yields (get: name -> array, shape_of: name -> shape) over all files of a checkpoint.

  Every tensor is checked: it must be in the file the index names, floating
  point, and (when read) finite; errors name the tensor and the file.
  """
  with contextlib.ExitStack() as stack:
    handles = {file: stack.enter_context(_safe_open(file)) for file in set(files.values())}
    keys = {file: set(h.keys()) for file, h in handles.items()}
    for name, file in files.items():
      if name not in keys[file]:
        raise CheckpointError(f'{INDEX_FILE} maps {name} to {os.path.basename(file)}, which '
                              'does not hold it (wrong shard)')

    def get(name):
      file = files[name]
      try:
        x = handles[file].get_tensor(name)
      except Exception as e:
        raise CheckpointError(f'{file}: cannot read tensor {name} (truncated or corrupt?): '
                              f'{e}') from None
      if not np.all(np.isfinite(x)):
        raise CheckpointError(f'{file}: tensor {name} holds NaN or inf values: refused')
      return x

    def shape_of(name):
      file = files[name]
      piece = handles[file].get_slice(name)
      dtype = piece.get_dtype()
      if dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f'{file}: tensor {name} has dtype {dtype}; weights must be '
                              f'floating point ({", ".join(_FLOAT_DTYPES)}): refused')
      return piece.get_shape()

    yield get, shape_of


def _check_names_and_shapes(files: dict[str, str], shapes_of: Callable[[str], tuple[int, ...]],
                            config: LlamaConfig) -> None:
  expected = expected_hf_shapes(config)
  present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
  if config.tie_embeddings:
    present.discard('lm_head.weight')  # some tied checkpoints store the alias; it is unused
  missing = sorted(set(expected) - present)
  extra = sorted(present - set(expected))
  if missing:
    raise ValueError(f'checkpoint is missing {len(missing)} tensors for {config.name or "config"}: '
                     f'{missing[:8]}{" ..." if len(missing) > 8 else ""}')
  if extra:
    raise ValueError(f'checkpoint has {len(extra)} unexpected tensors: '
                     f'{extra[:8]}{" ..." if len(extra) > 8 else ""}')
  for name, want in expected.items():
    got = tuple(shapes_of(name))
    if got != want:
      raise ValueError(f'tensor {name} has shape {got}, expected {want}')


def convert_hf_tensors(get: Callable[[str], np.ndarray], config: LlamaConfig, dtype,
                       place: Callable[[tuple, np.ndarray], object] | None = None) -> dict:
  """Our parameter tree (a pure dict in `dtype`) from HF tensors by name.

  `place(path, array)` receives each converted tensor as soon as it is made (path: its
  keys in the tree) and returns what the tree holds (default: the numpy array), so that
  a sharded load moves each tensor into its shards before reading the next.
  """
  np_dtype = np.dtype(jnp.dtype(dtype))
  place = place or (lambda path, x: x)
  cast = lambda path, x: place(path, np.asarray(x).astype(np_dtype))
  layers = {}
  for i in range(config.num_layers):
    layers[i] = {ours: cast(('layers', i, ours), convert(get(f'model.layers.{i}.{hf_name}'), config))
                 for hf_name, (ours, convert) in _LAYER_TENSORS.items()}
    layers[i]['wkv'] = cast(('layers', i, 'wkv'), _kv_weight(get, i, config))
  params = {
      'embed': cast(('embed',), get('model.embed_tokens.weight')),
      'layers': layers,
      'final_norm': cast(('final_norm',), get('model.norm.weight')),
  }
  if not config.tie_embeddings:
    params['lm_head'] = cast(('lm_head',), get('lm_head.weight').T)
  return params


def abstract_model(config: LlamaConfig, dtype, mesh=None) -> Llama:
  """A Llama with shape-only parameters (no memory, no random init)."""
  return nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype, mesh=mesh))


def param_shardings(config: LlamaConfig, dtype, mesh) -> dict:
  """Pure dict (like `nnx.to_pure_dict`) of every parameter's NamedSharding on `mesh`."""
  _, state = nnx.split(abstract_model(config, dtype, sr.auto_mesh(mesh)))
  return nnx.to_pure_dict(sr.param_shardings(state, sr.auto_mesh(mesh)))


def param_placer(config: LlamaConfig, dtype, mesh):
  """place(path, numpy array) -> the array in its shards (or on the default device)."""
  if mesh is None:
    return lambda path, x: jnp.asarray(x)
  shardings = param_shardings(config, dtype, mesh)

  def place(path, x):
    s = shardings
    for key in path:
      s = s[key]
    return jax.device_put(x, s)  # each device receives only its own slices

  return place


def model_from_params(config: LlamaConfig, params: dict, dtype, mesh=None) -> Llama:
  """A Llama whose parameters are `params` (a pure dict like `nnx.to_pure_dict(state)`).

  Arrays already placed (a sharded load) are kept as they are; numpy arrays are
  moved to the default device, or into their shards with `mesh`.
  """
  mesh = sr.auto_mesh(mesh)
  graphdef, state = nnx.split(abstract_model(config, dtype, mesh))
  want = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), nnx.to_pure_dict(state))
  got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), params)
  if want != got:
    raise ValueError(f'parameter tree does not match the model: expected {want}, got {got}')
  if mesh is not None:
    shardings = param_shardings(config, dtype, mesh)
    params = jax.tree.map(
        lambda x, s: x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s),
        params, shardings)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  return nnx.merge(graphdef, state)


def load_hf_folder_config(path) -> LlamaConfig:
  """config.json, with errors that name the file (bad JSON, missing or bad fields)."""
  path = os.fspath(path)
  file = os.path.join(path, 'config.json') if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise CheckpointError(f'no config.json at {file}')
  hf = _read_json(file, 'the model config')
  if not isinstance(hf, dict):
    raise CheckpointError(f'{file}: must hold a JSON object, got {type(hf).__name__}')
  try:
    return load_hf_config(path)
  except KeyError as e:
    raise CheckpointError(f'{file}: missing field {e}') from None
  except (TypeError, ValueError) as e:
    raise CheckpointError(f'{file}: {e}') from None


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype=jnp.bfloat16, config: LlamaConfig | None = None,
    mesh=None, fuse_qkv: bool | None = None,
) -> Llama:
  """Loads a HF Llama folder (config.json + safetensors, single or sharded) into a `Llama`.

  Tensors are read one at a time; with `mesh` each is moved straight into its
  shards (the rules of `models.sharding_rules`), so the whole model is never on
  one device. Bad folders raise `CheckpointError` (a ValueError) naming the
  file: truncated or corrupt safetensors, bad JSON, an index naming a missing
  or wrong shard or a file outside the folder, non-float or non-finite weights.

  Args:
    path: the folder.
    dtype: parameter dtype (bfloat16, float16 or float32; tensors are cast on load). The
      default is bfloat16, the dtype Llama checkpoints are released in and the one the Mosaic
      GPU kernels run; outputs equal to transformers' float32 outputs need dtype=float32. The
      chosen dtype and the checkpoint's own (`torch_dtype` in config.json) are logged.
    config: overrides the folder's config.json.
    mesh: a `jax.sharding.Mesh` with axes dp / tp (None: the default device).
    fuse_qkv: one q/k/v weight a layer (`Llama.fuse_qkv`, the faster decode step from batch
      64 on); None (the default): fused wherever tp divides the kv heads, else wq and wkv apart;
      True: fused (ValueError where tp does not divide them); False: apart (`save_params`
      writes them apart either way).
  """
  check_param_dtype(dtype)
  check_fuse_qkv(fuse_qkv)
  config = config or load_hf_folder_config(path)
  sr.check_mesh(config, mesh)
  files = safetensors_files(path)
  logging.info('load_hf_checkpoint: %s as %s (checkpoint stored as %s); pass dtype=float32 for '
               "outputs equal to transformers' float32", path, jnp.dtype(dtype).name,
               _stored_dtype(path))
  with _open_all(files) as (get, shape_of):
    _check_names_and_shapes(files, shape_of, config)
    params = convert_hf_tensors(get, config, dtype, place=param_placer(config, dtype, mesh))
  return with_qkv(model_from_params(config, params, dtype, mesh), fuse_qkv)


def check_param_dtype(dtype) -> None:
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                              jnp.dtype(jnp.float16)):
    raise ValueError(f'dtype must be bfloat16, float16 or float32, got {dtype}')


def check_fuse_qkv(fuse_qkv) -> None:
  if fuse_qkv not in (None, True, False):
    raise ValueError(f'fuse_qkv must be None, True or False, got {fuse_qkv!r}')


def with_qkv(model: Llama, fuse_qkv: bool | None) -> Llama:
  """The loaded model with its q/k/v weights as `fuse_qkv` asks (see `load_hf_checkpoint`)."""
  return model if fuse_qkv is False else model.fuse_qkv(required=bool(fuse_qkv))


def _stored_dtype(path) -> str:
  """config.json's `torch_dtype` (or `dtype`), for the log line; 'unknown' when absent."""
  try:
    with open(os.path.join(path, 'config.json')) as f:
      raw = json.load(f)
  except (OSError, ValueError):
    return 'unknown'
  return str(raw.get('torch_dtype') or raw.get('dtype') or 'unknown')
