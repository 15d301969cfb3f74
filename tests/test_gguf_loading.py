"""GGUF loading on tiny files written here: the same `Llama` as the HF loader, and bad files.

The tiny HF fixtures are written as GGUF files the way llama.cpp's converter writes them
(Q and K rows permuted for its rope, ggml names), in F32 (parameters equal the HF
loader's exactly) and F16; truncated, damaged or incomplete files raise
`CheckpointError` naming the file and the tensor. (The real model: test_smollm2.py.)
"""

import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from models.chat_template import SMOLLM2_TEMPLATE
from models.checkpoint import checkpoint_config, load_checkpoint
from models.config import load_hf_config
from models.gguf_loading import gguf_config, gguf_name, load_gguf
from models.gguf_to_hf import convert
from models.gguf_tokenizer import tokenizer_from_gguf
from models.hf_loading import CheckpointError, load_hf_checkpoint, safetensors_files
from models.tokenizer import Tokenizer

def _gpt2_byte(b: int) -> str:
  """GPT-2's printable spelling of byte b (`bytes_to_unicode`)."""
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  if b in printable:
    return chr(b)
  return chr(256 + [x for x in range(256) if x not in printable].index(b))

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's `permute` (convert_hf_to_gguf.py): halves -> interleaved pairs per head."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _hf_tensors(folder: str) -> dict[str, np.ndarray]:
  tensors = {}
  for name, file in safetensors_files(folder).items():
    with safe_open(file, 'numpy') as f:
      tensors[name] = f.get_tensor(name)
  return tensors


def _byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
  """`size` byte-level tokens (bytes 32.. as GPT-2 spells them, one merge 'a b', 3 specials)."""
  tokens = [_gpt2_byte(b) for b in range(32, 32 + size - 4)] + ['ab']
  return tokens + ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], ['a b']


def write_gguf(path, folder: str, *, dtype=np.float32, drop: str = '', poison: str = '',
               tokenizer: bool = False):
  """The HF folder as a GGUF file (`drop`: leave that HF tensor out; `poison`: NaN in it;
  `tokenizer`: with a byte-level tokenizer and SmolLM2's chat template)."""
  c = load_hf_config(folder)
  w = gguf.GGUFWriter(os.fspath(path), 'llama')
  if tokenizer:
    tokens, merges = _byte_level_vocab(c.vocab_size)
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre('smollm')
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(SMOLLM2_TEMPLATE)
  w.add_block_count(c.num_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.dim)
  w.add_feed_forward_length(c.mlp_dim)
  w.add_head_count(c.num_heads)
  w.add_head_count_kv(c.num_kv_heads)
  w.add_layer_norm_rms_eps(c.norm_eps)
  w.add_rope_freq_base(c.rope_theta)
  w.add_vocab_size(c.vocab_size)
  for name, x in sorted(_hf_tensors(folder).items()):
    if name == drop:
      continue
    x = np.asarray(x, np.float32)
    if name.endswith('q_proj.weight'):
      x = _permute(x, c.num_heads)
    elif name.endswith('k_proj.weight'):
      x = _permute(x, c.num_kv_heads)
    if name == poison:
      x = x.copy()
      x.flat[3] = np.nan
    w.add_tensor(gguf_name(name), x.astype(dtype) if x.ndim == 2 else x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize('name', ['tiny_gqa', 'tiny_mha'])
def test_f32_file_loads_the_hf_loaders_model(tmp_path, name):
  folder = os.path.join(FIXTURES, f'hf_{name}')
  path = write_gguf(tmp_path / f'{name}.gguf', folder)
  shape = lambda c: (c.vocab_size, c.dim, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.mlp_dim, c.rope_theta, c.tie_embeddings, np.float32(c.norm_eps))
  assert shape(gguf_config(path)) == shape(checkpoint_config(folder))
  want = load_hf_checkpoint(folder, dtype=jnp.float32, fuse_qkv=False)
  got = load_gguf(path, fuse_qkv=False)
  np.testing.assert_equal(jax_tree_numpy(_params(got)), jax_tree_numpy(_params(want)))


def jax_tree_numpy(tree):
  return {k: jax_tree_numpy(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


def test_f16_file_loads_within_f16_rounding(tmp_path):
  folder = os.path.join(FIXTURES, 'hf_tiny_gqa')
  path = write_gguf(tmp_path / 'f16.gguf', folder, dtype=np.float16)
  want = jax_tree_numpy(_params(load_hf_checkpoint(folder, dtype=jnp.float32, fuse_qkv=False)))
  got = jax_tree_numpy(_params(load_gguf(path, fuse_qkv=False)))
  for key in ('embed', 'final_norm'):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-3, atol=1e-4)
  for layer in want['layers']:
    for key in want['layers'][layer]:
      np.testing.assert_allclose(got['layers'][layer][key], want['layers'][layer][key],
                                 rtol=1e-3, atol=1e-4)


def test_load_checkpoint_routes_by_suffix(tmp_path):
  folder = os.path.join(FIXTURES, 'hf_tiny_gqa')
  path = write_gguf(tmp_path / 'tiny.gguf', folder)
  model, tokenizer = load_checkpoint(folder)
  assert tokenizer is None and model.config.num_kv_heads == 2
  with pytest.raises(CheckpointError, match='tokenizer.ggml.model'):  # weights but no tokenizer
    load_checkpoint(path)
  with pytest.raises(CheckpointError, match='not a .gguf file or a HF checkpoint folder'):
    load_checkpoint(tmp_path / 'nothing.bin')


def test_bad_files_name_the_file_and_tensor(tmp_path):
  folder = os.path.join(FIXTURES, 'hf_tiny_gqa')
  missing = write_gguf(tmp_path / 'missing.gguf', folder, drop='model.layers.1.mlp.up_proj.weight')
  with pytest.raises(CheckpointError, match=r'missing\.gguf.*blk\.1\.ffn_up\.weight'):
    load_gguf(missing)
  nan = write_gguf(tmp_path / 'nan.gguf', folder, poison='model.layers.0.self_attn.k_proj.weight')
  with pytest.raises(CheckpointError, match=r'nan\.gguf: tensor blk\.0\.attn_k\.weight holds NaN'):
    load_gguf(nan)
  good = write_gguf(tmp_path / 'good.gguf', folder)
  data = good.read_bytes()
  truncated = tmp_path / 'truncated.gguf'
  truncated.write_bytes(data[:len(data) - 1000])
  with pytest.raises(CheckpointError, match='truncated.gguf'):
    load_gguf(truncated)
  with pytest.raises(ValueError, match='dtype must be'):
    load_gguf(good, dtype=jnp.int8)


def test_gguf_to_hf_round_trips(tmp_path):
  """The converted folder loads (weights and tokenizer) as the GGUF file does."""
  folder = os.path.join(FIXTURES, 'hf_tiny_gqa')
  path = write_gguf(tmp_path / 'tiny.gguf', folder, tokenizer=True)
  convert(path, tmp_path / 'hf')
  np.testing.assert_equal(
      jax_tree_numpy(_params(load_hf_checkpoint(tmp_path / 'hf', dtype=jnp.float32,
                                                fuse_qkv=False))),
      jax_tree_numpy(_params(load_gguf(path, fuse_qkv=False))))
  ours, converted = tokenizer_from_gguf(path), Tokenizer.from_file(tmp_path / 'hf')
  text = '<|im_start|>abc d 123!<|im_end|>'
  assert converted.encode(text) == ours.encode(text) == [95, 93, 67, 0, 68, 0, 17, 18, 19, 1, 96]
  assert converted.bos_id is None and converted.eos_ids == ours.eos_ids == (96,)
  messages = [{'role': 'user', 'content': 'hi'}]
  assert converted.apply_chat_template(messages) == ours.apply_chat_template(messages)
