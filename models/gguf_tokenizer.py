"""The tokenizer a GGUF file carries (its `tokenizer.ggml.*` metadata) as a `Tokenizer`.

Byte-level BPE files (`tokenizer.ggml.model = gpt2`, as SmolLM2, Llama 3 and
Qwen ship) become a `tokenizers` BPE over the file's tokens and merges, with
GPT-2's byte-level pre-tokenizer and decoder, and every control token (token
type 3) as a special token, as transformers' GGUF converter builds it. Files
whose pre-tokenizer (`tokenizer.ggml.pre`) splits digits one by one before the
byte-level split (smollm, starcoder, refact, ...: llama.cpp's `\\p{N}` rule, as
the original tokenizer.json's `Digits(individual_digits=True)`) get that split
too. BOS is prepended only where the file says so (`add_bos_token`); EOS (and
EOT, when given) are the stop ids; the chat template comes along.
"""

import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from models.gguf_loading import metadata, open_gguf
from models.hf_loading import CheckpointError
from models.tokenizer import Tokenizer

# llama.cpp pre-tokenizers that split every digit apart before GPT-2's regex.
DIGIT_SPLITTING_PRE = ('smollm', 'starcoder', 'refact', 'command-r', 'codeshell', 'exaone',
                       'minerva-7b')
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int] | None, *,
                   split_digits: bool) -> tokenizers.Tokenizer:
  """A `tokenizers` byte-level BPE tokenizer from GGUF-style vocabulary lists."""
  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = [tuple(m.split(' ', 1)) for m in merges]
  tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                        use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level]) if split_digits else byte_level)
  tok.decoder = decoders.ByteLevel()
  if token_types is not None:
    special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(token_types) if t == _CONTROL]
    added = [tokenizers.AddedToken(tokens[i], special=False, normalized=False)
             for i, t in enumerate(token_types) if t == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
  return tok


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
  """The `Tokenizer` (with its BOS/EOS ids and chat template) stored in a GGUF file.

  `bos_id` is None where the file says not to prepend BOS (`tokenizer.ggml.add_bos_token`
  false, as SmolLM2's), so `encode` adds nothing then.
  """
  reader = open_gguf(path)
  file = reader.filename
  kind = metadata(reader, 'tokenizer.ggml.model')
  if kind != 'gpt2':
    raise CheckpointError(f'{file}: tokenizer.ggml.model is {kind!r}; only byte-level BPE '
                          "('gpt2') GGUF tokenizers are supported")
  tokens = metadata(reader, 'tokenizer.ggml.tokens')
  merges = metadata(reader, 'tokenizer.ggml.merges')
  if not tokens or not merges:
    raise CheckpointError(f'{file}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing')
  types = metadata(reader, 'tokenizer.ggml.token_type')
  if types is not None and len(types) != len(tokens):
    raise CheckpointError(f'{file}: tokenizer.ggml.token_type has {len(types)} entries for '
                          f'{len(tokens)} tokens')
  pre = metadata(reader, 'tokenizer.ggml.pre', 'default')
  tok = byte_level_bpe(tokens, merges, types, split_digits=pre in DIGIT_SPLITTING_PRE)
  bos = metadata(reader, 'tokenizer.ggml.bos_token_id')
  add_bos = metadata(reader, 'tokenizer.ggml.add_bos_token', bos is not None)
  stops = [metadata(reader, f'tokenizer.ggml.{k}_token_id') for k in ('eos', 'eot')]
  stops = [int(s) for s in dict.fromkeys(stops) if s is not None]
  for name, i in [('bos', bos)] + [('eos/eot', s) for s in stops]:
    if i is not None and not 0 <= int(i) < len(tokens):
      raise CheckpointError(f'{file}: tokenizer.ggml.{name}_token_id {i} is outside the '
                            f'{len(tokens)} tokens')
  return Tokenizer(tok, bos_id=int(bos) if add_bos and bos is not None else None, eos_ids=stops,
                   chat_template=metadata(reader, 'tokenizer.chat_template'))
