"""The generation CLI on the tiny HF fixtures: greedy ids equal transformers', text through a
tokenizer, samples reproducible by seed, and the `python -m` entry end to end."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from models.generate_cli import run
from models.tokenizer import Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def char_tokenizer(folder) -> Tokenizer:
  """A character tokenizer with 97 ids (tiny_gqa's vocabulary): <unk> <s> </s>, then ' ' .. '}'."""
  from tokenizers import Tokenizer as HFTokenizer
  from tokenizers import decoders, models

  vocab = {'<unk>': 0, '<s>': 1, '</s>': 2} | {chr(c): 3 + i for i, c in enumerate(range(32, 126))}
  tok = HFTokenizer(models.BPE(vocab, merges=[], unk_token='<unk>'))
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(['<unk>', '<s>', '</s>'])
  tok.save(os.path.join(folder, 'tokenizer.json'))
  if not os.path.exists(os.path.join(folder, 'config.json')):
    with open(os.path.join(folder, 'config.json'), 'w') as f:
      json.dump({'bos_token_id': 1, 'eos_token_id': 2}, f)
  return Tokenizer.from_file(folder)


@pytest.fixture(scope='module')
def greedy():
  with open(os.path.join(FIXTURES, 'hf_tiny_gqa', 'greedy.json')) as f:
    return json.load(f)


def test_greedy_ids_equal_transformers(greedy):
  samples = run(os.path.join(FIXTURES, 'hf_tiny_gqa'), prompt_ids=greedy['prompts'],
                max_new_tokens=greedy['max_new_tokens'], impl='xla')
  assert [(s.prompt, s.sample) for s in samples] == [(i, 0) for i in range(len(greedy['prompts']))]
  assert [list(s.tokens) for s in samples] == greedy['greedy']
  assert all(s.text is None for s in samples)


def test_text_prompts_samples_and_seed(tmp_path):
  folder = tmp_path / 'ckpt'
  shutil.copytree(os.path.join(FIXTURES, 'hf_tiny_gqa'), folder)
  tok = char_tokenizer(folder)
  kwargs = {'prompts': ['shared prefix: one', 'shared prefix: two'], 'max_new_tokens': 5,
            'temperature': 0.9, 'num_samples': 2, 'seed': 3, 'impl': 'xla'}
  samples = run(str(folder), **kwargs)
  assert [(s.prompt, s.sample) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  for s in samples:
    assert 1 <= len(s.tokens) <= 5 and s.text == tok.decode(s.tokens)
    assert all(t != 2 for t in s.tokens[:-1])  # EOS (config.json) ends a sample
  assert run(str(folder), **kwargs) == samples  # the same seed, the same samples
  assert run(str(folder), **{**kwargs, 'seed': 4}) != samples
  with pytest.raises(ValueError, match='not both'):
    run(str(folder), prompts=['a'], prompt_ids=[[1]])
  with pytest.raises(ValueError, match='no tokenizer.json'):
    run(os.path.join(FIXTURES, 'hf_tiny_gqa'), prompts=['a'])
  with pytest.raises(ValueError, match=r'\[0, 97\)'):
    run(str(folder), prompt_ids=[[1, 97]])


def test_python_m_entry_prints_json(greedy):
  ids = ','.join(map(str, greedy['prompts'][0]))
  proc = subprocess.run(
      [sys.executable, '-m', 'models.generate_cli', f'--checkpoint={FIXTURES}/hf_tiny_gqa',
       f'--prompt_ids={ids}', f'--max_new_tokens={greedy["max_new_tokens"]}', '--impl=xla',
       '--json'],
      cwd=ROOT, env={**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'},
      capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{')]
  assert line['tokens'] == greedy['greedy'][0] and line['prompt'] == 0


@pytest.mark.parametrize('flags, words', [
    (['--checkpoint=/no/such/folder', '--prompt=hi'], '--checkpoint=/no/such/folder: does not'),
    ([f'--checkpoint={FIXTURES}/hf_tiny_gqa', '--prompt=hi'], 'error: no tokenizer.json'),
    ([f'--checkpoint={FIXTURES}/hf_tiny_gqa', '--prompt_ids=1,x'], 'comma-separated token ids'),
])
def test_bad_paths_and_ids_give_one_line_not_a_traceback(flags, words):
  proc = subprocess.run([sys.executable, '-m', 'models.generate_cli', *flags], cwd=ROOT,
                        env={**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'},
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode != 0 and words in proc.stderr, proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr


@pytest.mark.parametrize('command', ['models.generate_cli', 'models.server'])
def test_help_prints_the_flags_and_exits_0(command):
  proc = subprocess.run([sys.executable, '-m', command, '--help'], cwd=ROOT,
                        env={**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'},
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert '--checkpoint' in proc.stdout + proc.stderr
