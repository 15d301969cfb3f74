"""GGUF Llama files (llama.cpp's format) -> `Llama`, through llama.cpp's own reader.

`gguf.GGUFReader` maps the file; `gguf.quants.dequantize` turns each tensor
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, the K-quants, the IQ types: every
type that package dequantizes) into float32 in HF's [out, in] layout. Tensors
are renamed to their HF names and go through the HF loader's conversion
(`hf_loading.convert_hf_tensors`), so both formats make the same `Llama`:

  token_embd.weight            -> model.embed_tokens.weight
  output_norm.weight           -> model.norm.weight
  output.weight                -> lm_head.weight (absent: tied embeddings)
  blk.i.attn_norm / ffn_norm   -> model.layers.i.input_layernorm / post_attention_layernorm
  blk.i.attn_{q,k,v,output}    -> model.layers.i.self_attn.{q,k,v,o}_proj
  blk.i.ffn_{gate,up,down}     -> model.layers.i.mlp.{gate,up,down}_proj

llama.cpp's converter permutes the rows of Q and K within each head (its rope
rotates adjacent pairs; HF and we rotate halves): `unpermute_rope_rows` undoes
it. The config comes from the `llama.*` metadata (`gguf_config`).
"""

import os
from typing import Any, Callable

import gguf
import jax.numpy as jnp
import numpy as np
from absl import logging

from models import sharding_rules as sr
from models.config import LlamaConfig
from models.hf_loading import (CheckpointError, check_fuse_qkv, check_param_dtype,
                               convert_hf_tensors, expected_hf_shapes, model_from_params,
                               param_placer, with_qkv)
from models.llama import Llama

SUPPORTED_ARCHITECTURES = ('llama',)

_GLOBAL_NAMES = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}
_LAYER_NAMES = {
    'attn_norm.weight': 'input_layernorm.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight',
    'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight',
    'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
}


def hf_name(name: str) -> str | None:
  """The HF tensor name of a GGUF Llama tensor (None for a name this loader does not know)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  parts = name.split('.', 2)
  if len(parts) == 3 and parts[0] == 'blk' and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
    return f'model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}'
  return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order: within each head, rows (0, H/2, 1, H/2+1, ...) -> halves.

  llama.cpp's converter maps head rows [2, H/2] (pairs last) to [H/2, 2] order; this
  reshapes to [heads, H/2, 2, D] and swaps the two middle axes back.
  """
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f'{rows} rows do not split into {num_heads} heads of an even size')
  half = rows // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Reader(gguf.GGUFReader):
  """`GGUFReader` over the file's mapping seen as a plain ndarray.

  The reader parses every metadata value into its own slices of `data`, and a 49K-token
  vocabulary is hundreds of thousands of them: `np.memmap` runs Python hooks on each slice,
  which made opening SmolLM2's file take most of its load time. The mapping is the same
  (read-only, still paged in on demand); `filename` keeps the file's path.
  """

  @property
  def data(self) -> np.ndarray:
    return self._data

  @data.setter
  def data(self, value: np.memmap) -> None:
    self.filename = value.filename
    self._data = value.view(np.ndarray)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
  """`GGUFReader` on the file; a missing, truncated or non-GGUF file raises `CheckpointError`."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise CheckpointError(f'{path}: no such GGUF file')
  try:
    return _Reader(path)
  except Exception as e:  # the reader raises ValueError, struct errors, IndexError, ...
    raise CheckpointError(f'{path}: not a readable GGUF file (truncated or corrupt?): '
                          f'{type(e).__name__}: {e}') from None


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
  """A metadata value (numbers, strings, lists), or `default` when the file lacks the key."""
  field = reader.fields.get(key)
  if field is None:
    return default
  try:
    return field.contents()
  except Exception as e:
    raise CheckpointError(f'{reader.filename}: metadata {key} is unreadable: {e}') from None


def _required(reader: gguf.GGUFReader, key: str) -> Any:
  value = metadata(reader, key)
  if value is None:
    raise CheckpointError(f'{reader.filename}: metadata {key} is missing')
  return value


def config_from_reader(reader: gguf.GGUFReader, *, name: str = '') -> LlamaConfig:
  """The `LlamaConfig` of an open GGUF file (its `{arch}.*` metadata and tensors)."""
  file = reader.filename
  arch = _required(reader, 'general.architecture')
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(f'{file}: general.architecture is {arch!r}; only '
                          f'{SUPPORTED_ARCHITECTURES} GGUF files load')
  if metadata(reader, f'{arch}.rope.scaling.type', 'none') not in ('none', 'linear') or any(
      t.name == 'rope_freqs.weight' for t in reader.tensors):
    raise CheckpointError(f'{file}: rope frequency scaling (rope_freqs / {arch}.rope.scaling.*) '
                          'is not supported for GGUF files')
  if metadata(reader, f'{arch}.rope.scaling.factor', 1.0) != 1.0:
    raise CheckpointError(f'{file}: {arch}.rope.scaling.factor != 1 is not supported')
  heads = int(_required(reader, f'{arch}.attention.head_count'))
  dim = int(_required(reader, f'{arch}.embedding_length'))
  head_dim = int(metadata(reader, f'{arch}.attention.key_length', 0) or dim // heads)
  rope_dims = metadata(reader, f'{arch}.rope.dimension_count', head_dim)
  if int(rope_dims) != head_dim:
    raise CheckpointError(f'{file}: partial rope ({arch}.rope.dimension_count = {rope_dims}, '
                          f'head dim {head_dim}) is not supported')
  embed = next((t for t in reader.tensors if t.name == 'token_embd.weight'), None)
  if embed is None:
    raise CheckpointError(f'{file}: tensor token_embd.weight is missing')
  vocab = metadata(reader, f'{arch}.vocab_size')
  if vocab is None:
    vocab = int(embed.shape[-1])  # ggml order: [D, V]
  try:
    return LlamaConfig(
        vocab_size=int(vocab),
        dim=dim,
        num_layers=int(_required(reader, f'{arch}.block_count')),
        num_heads=heads,
        num_kv_heads=int(metadata(reader, f'{arch}.attention.head_count_kv', heads)),
        head_dim=head_dim,
        mlp_dim=int(_required(reader, f'{arch}.feed_forward_length')),
        norm_eps=float(_required(reader, f'{arch}.attention.layer_norm_rms_epsilon')),
        rope_theta=float(metadata(reader, f'{arch}.rope.freq_base', 10_000.0)),
        tie_embeddings=not any(t.name == 'output.weight' for t in reader.tensors),
        max_position_embeddings=int(metadata(reader, f'{arch}.context_length', 4096)),
        name=name or str(metadata(reader, 'general.name', '')),
    )
  except (TypeError, ValueError) as e:
    raise CheckpointError(f'{file}: bad model metadata: {e}') from None


def gguf_config(path: str | os.PathLike) -> LlamaConfig:
  """The `LlamaConfig` a GGUF Llama file declares (its metadata; no tensor is read)."""
  return config_from_reader(open_gguf(path))


def hf_tensor_reader(reader: gguf.GGUFReader, config: LlamaConfig) -> Callable[[str], np.ndarray]:
  """get(HF name) -> float32 [out, in] array, checked, with the rope rows in HF order."""
  file = reader.filename
  by_hf = {}
  for t in reader.tensors:
    name = hf_name(t.name)
    if name is None:
      raise CheckpointError(f'{file}: tensor {t.name} is not a Llama tensor this loader knows')
    by_hf[name] = t
  expected = expected_hf_shapes(config)
  missing = sorted(set(expected) - set(by_hf))
  if missing:
    raise CheckpointError(f'{file}: {len(missing)} tensors are missing, e.g. '
                          f'{[gguf_name(n) for n in missing[:4]]}')
  for name, want in expected.items():
    got = tuple(int(d) for d in reversed(by_hf[name].shape))  # ggml lists dims innermost first
    if got != want:
      raise CheckpointError(f'{file}: tensor {by_hf[name].name} has shape {got}, expected {want}')

  def get(name: str) -> np.ndarray:
    t = by_hf[name]
    try:
      x = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise CheckpointError(f'{file}: tensor {t.name} has type {t.tensor_type.name}, which the '
                            'gguf package cannot dequantize') from None
    except Exception as e:
      raise CheckpointError(f'{file}: cannot read tensor {t.name} (truncated or corrupt?): '
                            f'{type(e).__name__}: {e}') from None
    x = np.asarray(x, np.float32).reshape(expected[name])
    if not np.all(np.isfinite(x)):
      raise CheckpointError(f'{file}: tensor {t.name} holds NaN or inf values: refused')
    if name.endswith('self_attn.q_proj.weight'):
      x = unpermute_rope_rows(x, config.num_heads)
    elif name.endswith('self_attn.k_proj.weight'):
      x = unpermute_rope_rows(x, config.num_kv_heads)
    return x

  return get


def gguf_name(hf: str) -> str:
  """The GGUF name of a HF Llama tensor name (the inverse of `hf_name`)."""
  inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
  if hf in inverse:
    return inverse[hf]
  _, _, layer, rest = hf.split('.', 3)
  return f'blk.{layer}.' + {v: k for k, v in _LAYER_NAMES.items()}[rest]


def load_gguf(path: str | os.PathLike, *, dtype=jnp.float32, mesh=None,
              fuse_qkv: bool | None = None, config: LlamaConfig | None = None) -> Llama:
  """Loads a GGUF Llama file into a `Llama` (dequantized to float32, then cast to `dtype`).

  Tensors are dequantized one at a time; with `mesh` each goes straight into its
  shards (`models.sharding_rules`). A bad file raises `CheckpointError` naming the
  file and the tensor (truncated, unknown or missing tensors, wrong shapes, a type
  the gguf package cannot dequantize, NaN or inf).

  Args:
    path: the .gguf file.
    dtype: parameter dtype (float32, the default: outputs equal to transformers' float32
      model of the same file; bfloat16 or float16 halve the memory).
    mesh: a `jax.sharding.Mesh` with axes dp / tp (None: the default device).
    fuse_qkv: as `hf_loading.load_hf_checkpoint` (None: one q/k/v weight a layer wherever
      tp divides the kv heads).
    config: overrides the file's metadata.
  """
  check_param_dtype(dtype)
  check_fuse_qkv(fuse_qkv)
  reader = open_gguf(path)
  config = config or config_from_reader(reader)
  sr.check_mesh(config, mesh)
  get = hf_tensor_reader(reader, config)
  logging.info('load_gguf: %s (%s) as %s', path, config.name, jnp.dtype(dtype).name)
  params = convert_hf_tensors(get, config, dtype, place=param_placer(config, dtype, mesh))
  return with_qkv(model_from_params(config, params, dtype, mesh), fuse_qkv)


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
  """GGUF tensor name -> its stored type name (F32, Q4_1, ...), for reports."""
  return {t.name: t.tensor_type.name for t in open_gguf(path).tensors}

