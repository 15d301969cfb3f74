"""HF checkpoints: logits equal transformers' LlamaForCausalLM; loader errors; orbax; tokenizer.

The golden logits were made by HF's own implementation (PyTorch, CPU) with
tests/fixtures/make_hf_fixtures.py. Where torch and transformers import, the
comparison is also re-run live against the same saved checkpoints.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import hydrajax
from models import hf_loading, saved_params
from models.kv_cache import KVCache
from models.tokenizer import Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
NAMES = ('tiny_gqa', 'tiny_mha', 'tiny_llama3')  # GQA; MHA sharded; MQA + tied + Llama 3.1 RoPE


def _folder(name):
  return os.path.join(FIXTURES, f'hf_{name}')


def _logits(model, input_ids):
  """Our logits for whole sequences [B, S] (rows in private pages of size 1, impl=xla)."""
  b, s = input_ids.shape
  pages = tuple(tuple(range(r * s, (r + 1) * s)) for r in range(b))
  layout = hydrajax.SharingPlan(b, (), 1, pages, (s,) * b, b * s).to_device()
  cache = KVCache.zeros(model.config, b * s, model.dtype)
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  slots = jnp.asarray(np.array(pages, np.int32))
  return model(jnp.asarray(input_ids), positions, cache, slots, layout, impl='xla')[0]


@pytest.mark.parametrize('name', NAMES)
def test_logits_equal_hf_golden(name):
  golden = np.load(os.path.join(_folder(name), 'golden.npz'))
  model = hf_loading.load_hf_checkpoint(_folder(name), dtype=jnp.float32)
  got = np.asarray(_logits(model, golden['input_ids']))
  np.testing.assert_allclose(got, golden['logits'], rtol=1e-4, atol=1e-4)
  bf16 = hf_loading.load_hf_checkpoint(_folder(name), dtype=jnp.bfloat16)
  assert bf16.qkv_fused and bf16.layers[0].wqkv.get_value().dtype == jnp.bfloat16
  got = np.asarray(_logits(bf16, golden['input_ids']))
  err = np.linalg.norm(got - golden['logits']) / np.linalg.norm(golden['logits'])
  assert err < 5e-2


def test_logits_equal_hf_live():
  torch = pytest.importorskip('torch', reason='optional: live HF comparison needs torch')
  transformers = pytest.importorskip('transformers', reason='optional: needs transformers')
  for name in NAMES:
    hf = transformers.LlamaForCausalLM.from_pretrained(_folder(name), dtype=torch.float32).eval()
    ids = np.random.default_rng(7).integers(0, hf.config.vocab_size, (3, 9))
    with torch.no_grad():
      expected = hf(torch.from_numpy(ids)).logits.float().numpy()
    model = hf_loading.load_hf_checkpoint(_folder(name), dtype=jnp.float32)
    np.testing.assert_allclose(_logits(model, ids.astype(np.int32)), expected, rtol=1e-4,
                               atol=1e-4)


def _tensors(name):
  files = hf_loading.safetensors_files(_folder(name))
  with hf_loading._open_all(files) as (get, _):
    return {n: get(n) for n in files}


@pytest.fixture(scope='module')
def gqa_tensors():
  return _tensors('tiny_gqa')


def _write(tmp_path, tensors, config_from='tiny_gqa'):
  folder = tmp_path / 'ckpt'
  folder.mkdir()
  shutil.copy(os.path.join(_folder(config_from), 'config.json'), folder / 'config.json')
  save_file(tensors, str(folder / 'model.safetensors'))
  return folder


def test_single_file_equals_sharded(tmp_path):
  sharded = hf_loading.load_hf_checkpoint(_folder('tiny_mha'), dtype=jnp.float32)
  single = hf_loading.load_hf_checkpoint(_write(tmp_path, _tensors('tiny_mha'), 'tiny_mha'),
                                         dtype=jnp.float32)
  assert len(set(hf_loading.safetensors_files(_folder('tiny_mha')).values())) == 5
  for a, b in zip(jax.tree.leaves(nnx.state(sharded, nnx.Param)),
                  jax.tree.leaves(nnx.state(single, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_missing_tensor_raises(tmp_path, gqa_tensors):
  tensors = dict(gqa_tensors)
  del tensors['model.layers.1.mlp.up_proj.weight']
  with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.1\.mlp\.up_proj"):
    hf_loading.load_hf_checkpoint(_write(tmp_path, tensors))


def test_extra_tensor_raises(tmp_path, gqa_tensors):
  tensors = dict(gqa_tensors, **{'model.layers.2.self_attn.q_proj.weight': np.zeros((48, 48),
                                                                                  np.float32)})
  with pytest.raises(ValueError, match=r'unexpected tensors.*model\.layers\.2\.self_attn'):
    hf_loading.load_hf_checkpoint(_write(tmp_path, tensors))


def test_misshaped_tensor_raises(tmp_path, gqa_tensors):
  tensors = dict(gqa_tensors)
  tensors['model.layers.0.self_attn.k_proj.weight'] = np.zeros((24, 48), np.float32)
  with pytest.raises(ValueError, match=r'k_proj\.weight has shape \(24, 48\), expected \(16, 48\)'):
    hf_loading.load_hf_checkpoint(_write(tmp_path, tensors))


def test_missing_files_raise(tmp_path):
  folder = tmp_path / 'empty'
  folder.mkdir()
  with pytest.raises(ValueError, match='no model.safetensors'):
    hf_loading.safetensors_files(folder)
  with pytest.raises(ValueError, match='no config.json'):
    hf_loading.load_hf_checkpoint(folder)
  shutil.copytree(_folder('tiny_mha'), tmp_path / 'broken')
  os.remove(tmp_path / 'broken' / 'model-00003-of-00005.safetensors')
  with pytest.raises(ValueError, match='lists model-00003-of-00005'):
    hf_loading.safetensors_files(tmp_path / 'broken')


def test_ignored_buffers_and_tied_alias_load(tmp_path, gqa_tensors):
  tensors = dict(gqa_tensors, **{'model.layers.0.self_attn.rotary_emb.inv_freq':
                                 np.ones(4, np.float32)})
  model = hf_loading.load_hf_checkpoint(_write(tmp_path, tensors), dtype=jnp.float32)
  np.testing.assert_array_equal(model.embed.get_value(), gqa_tensors['model.embed_tokens.weight'])
  np.testing.assert_array_equal(model.lm_head.get_value(), gqa_tensors['lm_head.weight'].T)


def test_orbax_round_trip(tmp_path):
  model = hf_loading.load_hf_checkpoint(_folder('tiny_llama3'), dtype=jnp.float32)
  saved_params.save_params(model, tmp_path / 'saved')
  restored = saved_params.restore_params(tmp_path / 'saved')
  assert restored.config == model.config and restored.dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(restored, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  # Loaded and restored with one q/k/v weight a layer (the default), saved apart.
  apart = saved_params.restore_params(tmp_path / 'saved', fuse_qkv=False)
  assert model.qkv_fused and restored.qkv_fused and not apart.qkv_fused
  with pytest.raises(ValueError, match="fuse_qkv must be None, True or False, got 'yes'"):
    hf_loading.load_hf_checkpoint(_folder('tiny_llama3'), fuse_qkv='yes')
  as_bf16 = saved_params.restore_params(tmp_path / 'saved', dtype=jnp.bfloat16)
  w = model.layers[1].w_down.get_value()
  np.testing.assert_array_equal(as_bf16.layers[1].w_down.get_value(), w.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match='not written by save_params'):
    saved_params.restore_params(tmp_path)
  with pytest.raises(ValueError, match='does not exist'):
    saved_params.restore_params(tmp_path / 'missing')


def test_restore_fuses_the_separate_kv_weights_of_older_checkpoints(tmp_path):
  # Saved before K and V were one weight: layers hold `wk` and `wv` [D, K, H].
  import orbax.checkpoint as ocp

  model = hf_loading.load_hf_checkpoint(_folder('tiny_gqa'), dtype=jnp.float32, fuse_qkv=False)
  saved_params.save_params(model, tmp_path / 'saved')
  old = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  old['layers'] = {i: {**{k: v for k, v in layer.items() if k != 'wkv'},
                       'wk': layer['wkv'][:, 0], 'wv': layer['wkv'][:, 1]}
                   for i, layer in old['layers'].items()}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'saved' / 'params', old, force=True)
  checkpointer.wait_until_finished()
  restored = saved_params.restore_params(tmp_path / 'saved', fuse_qkv=False)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(restored, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  tensors = _tensors('tiny_gqa')
  k = tensors['model.layers.0.self_attn.k_proj.weight'].T.reshape(restored.layers[0].wkv.shape[0], -1)
  np.testing.assert_array_equal(restored.layers[0].wkv.get_value()[:, 0].reshape(k.shape), k)


def test_tokenizer_json(tmp_path):
  from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, decoders

  vocab = {'<unk>': 0, '<s>': 1, '</s>': 2, 'hello': 3, 'world': 4, 'shared': 5, 'prefix': 6}
  tok = HFTokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.decoder = decoders.WordPiece()
  tok.add_special_tokens(['<s>', '</s>'])
  tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'config.json').write_text(json.dumps({'bos_token_id': 1, 'eos_token_id': [2, 4]}))
  t = Tokenizer.from_file(tmp_path)
  assert t.encode('hello shared prefix') == [1, 3, 5, 6]
  assert t.encode('hello world', add_bos=False) == [3, 4]
  assert t.encode('hello zebra', add_bos=False) == [3, 0]
  assert t.bos_id == 1 and t.eos_ids == (2, 4) and t.vocab_size == 7
  assert t.decode([1, 3, 5, 2, -1, -1]) == 'hello shared'
  # Without config.json the special tokens are found by name.
  os.remove(tmp_path / 'config.json')
  t = Tokenizer.from_file(tmp_path / 'tokenizer.json')
  assert t.bos_id == 1 and t.eos_ids == (2,)
  with pytest.raises(ValueError, match='no tokenizer.json'):
    Tokenizer.from_file(tmp_path / 'nothing')


def test_load_says_which_dtype_it_loads(caplog):
  """The default is bfloat16; the log names it, the stored dtype, and how to match transformers."""
  with caplog.at_level('INFO'):
    model = hf_loading.load_hf_checkpoint(_folder('tiny_gqa'))
  assert jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype == jnp.bfloat16
  raw = json.load(open(os.path.join(_folder('tiny_gqa'), 'config.json')))
  stored = raw.get('torch_dtype') or raw.get('dtype')
  line = next(r.getMessage() for r in caplog.records if 'load_hf_checkpoint' in r.getMessage())
  assert 'as bfloat16' in line and f'stored as {stored or "unknown"}' in line
  assert 'dtype=float32' in line
