"""Generation from a local checkpoint (a GGUF file or a HF Llama folder), from the command line.

  python -m models.generate_cli --checkpoint=<HF folder or FILE.gguf> --prompt="Once upon a time" \\
      [--prompt="..."] [--max_new_tokens=32] [--temperature=0.8] [--top_p=0.95] \\
      [--num_samples=2] [--seed=0] [--dtype=float32] [--json]

Prompts are text (encoded with the GGUF file's tokenizer or the folder's tokenizer.json, or
--tokenizer) or token ids
(--prompt_ids=1,2,3, repeatable; for a folder without a tokenizer). Several prompts share their
common prefix: it is prefilled once (`models.generate.generate`). Generation stops at the
tokenizer's EOS ids (else the config's `eos_token_id`) or after --max_new_tokens. Prints each
sample's text (or ids), or with --json one JSON object per sample.

float32 (the default here) gives the same greedy tokens as transformers' float32 model; bfloat16
halves the memory of a large checkpoint on an accelerator.
"""

import dataclasses
import json
import os
from collections.abc import Sequence

import jax.numpy as jnp
from absl import flags

from hydrajax import command_line
from models.generate import generate
from models.checkpoint import is_gguf, load_checkpoint
from models.sampling import SamplingParams
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Sample:
  """One generated sequence."""

  prompt: int  # index of its prompt
  sample: int  # index among its prompt's samples
  tokens: tuple[int, ...]  # generated ids, the stop token included
  text: str | None  # decoded (special tokens skipped), with a tokenizer


def _eos_from_config(checkpoint: str) -> tuple[int, ...]:
  path = os.path.join(checkpoint, 'config.json')
  if not os.path.exists(path):
    return ()
  with open(path) as f:
    eos = json.load(f).get('eos_token_id')
  return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def run(checkpoint: str, *, prompts: Sequence[str] = (), prompt_ids: Sequence[Sequence[int]] = (),
        tokenizer: str | None = None, max_new_tokens: int = 32, temperature: float = 0.0,
        top_k: int = 0, top_p: float = 1.0, num_samples: int = 1, seed: int = 0,
        dtype: str = 'float32', impl: str = 'auto') -> list[Sample]:
  """Loads the checkpoint and generates; samples ordered by (prompt, sample)."""
  if bool(prompts) == bool(prompt_ids):
    raise ValueError('give prompts as text (--prompt) or as token ids (--prompt_ids), not both')
  tok = None
  if tokenizer or (prompts and not is_gguf(checkpoint)):
    tok = Tokenizer.from_file(tokenizer or checkpoint)  # ValueError naming the missing file
  model, own_tokenizer = load_checkpoint(checkpoint, dtype=jnp.dtype(dtype))
  if tok is None and is_gguf(checkpoint):
    tok = own_tokenizer  # a GGUF file carries its tokenizer
  ids = [tok.encode(p) for p in prompts] if prompts else [list(p) for p in prompt_ids]
  vocab = model.config.vocab_size
  for i, p in enumerate(ids):
    if not p or min(p) < 0 or max(p) >= vocab:
      raise ValueError(f'prompt {i} must be non-empty token ids in [0, {vocab}), got {p[:8]}...')
  stops = tok.eos_ids if tok is not None else _eos_from_config(checkpoint)
  out = generate(model, ids, max_new_tokens=max_new_tokens, num_samples=num_samples,
                 sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                 seed=seed, stop_tokens=stops, impl=impl)
  samples = []
  for r in range(out.tokens.shape[0]):
    tokens = tuple(int(t) for t in out.tokens[r, :int(out.lengths[r])])
    samples.append(Sample(int(out.prompt_ids[r]), int(out.sample_ids[r]), tokens,
                          tok.decode(tokens) if tok is not None else None))
  return samples


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f'error: unexpected arguments {argv[1:]}; prompts go in --prompt or '
                     '--prompt_ids')
  try:
    samples = _run_from_flags()
  except ValueError as e:  # bad arguments: their message, not a traceback
    raise SystemExit(f'error: {e}') from None
  for s in samples:
    if _JSON.value:
      print(json.dumps(dataclasses.asdict(s)))
    else:
      shown = s.text if s.text is not None else ' '.join(map(str, s.tokens))
      print(f'--- prompt {s.prompt}, sample {s.sample}:\n{shown}')


def _run_from_flags() -> list[Sample]:
  return run(
      _CHECKPOINT.value, prompts=_PROMPT.value or (),
      prompt_ids=[[int(t) for t in p.split(',')] for p in _PROMPT_IDS.value or ()],
      tokenizer=_TOKENIZER.value or None, max_new_tokens=_MAX_NEW_TOKENS.value,
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
      num_samples=_NUM_SAMPLES.value, seed=_SEED.value, dtype=_DTYPE.value, impl=_IMPL.value)


if __name__ == '__main__':
  _CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'a .gguf file or a HF Llama folder',
                                    required=True)
  _PROMPT = flags.DEFINE_multi_string('prompt', None, 'a text prompt (repeat for several)')
  _PROMPT_IDS = flags.DEFINE_multi_string('prompt_ids', None, 'a prompt as ids: 1,2,3 (repeat)')
  _TOKENIZER = flags.DEFINE_string('tokenizer', '', 'tokenizer.json or its folder (default: '
                                   'the checkpoint folder)')
  _MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 32, 'tokens per sample at most')
  _TEMPERATURE = flags.DEFINE_float('temperature', 0.0, '0: greedy')
  _TOP_K = flags.DEFINE_integer('top_k', 0, 'keep the k most likely tokens (0: all)')
  _TOP_P = flags.DEFINE_float('top_p', 1.0, 'nucleus sampling mass (1: all)')
  _NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'samples per prompt')
  _SEED = flags.DEFINE_integer('seed', 0, 'sampling seed')
  _DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16', 'float16'],
                             'parameter dtype')
  _IMPL = flags.DEFINE_string('impl', 'auto', 'attention implementation (auto, xla, ...)')
  _JSON = flags.DEFINE_boolean('json', False, 'one JSON object per sample')
  flags.register_validator('checkpoint', lambda p: p is None or os.path.exists(p),
                           message='does not exist')
  flags.register_validator('tokenizer', lambda p: not p or os.path.exists(p),
                           message='no such file or folder')
  flags.register_validator(
      'prompt_ids', lambda ps: all(t.strip().isdigit() for p in ps or () for t in p.split(',')),
      message='each must be comma-separated token ids >= 0, e.g. 1,2,3')
  for name in ('max_new_tokens', 'num_samples'):
    flags.register_validator(name, lambda v: v >= 1, message='must be >= 1')
  command_line.run(main)
