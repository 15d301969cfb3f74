"""Tokenization through a HF `tokenizer.json` (the `tokenizers` library).

BOS/EOS ids come from the folder's `config.json` (`bos_token_id`,
`eos_token_id`) or `tokenizer_config.json` (`bos_token`, `eos_token`), else
from the tokens `<s>`, `</s>`, `<|begin_of_text|>`, `<|end_of_text|>` when the
vocabulary holds them. The chat template (`apply_chat_template`) comes from
`chat_template.jinja` or tokenizer_config.json's `chat_template`; a GGUF file's
tokenizer (`models.gguf_tokenizer`) carries its own.
"""

import json
import os
from typing import Mapping, Sequence

import tokenizers

from models.chat_template import apply_chat_template

_BOS_NAMES = ('<s>', '<|begin_of_text|>')
_EOS_NAMES = ('</s>', '<|end_of_text|>', '<|eot_id|>')


def _token_string(value) -> str | None:
  if isinstance(value, dict):  # {"content": "<s>", ...}
    return value.get('content')
  return value


class Tokenizer:
  """Encode/decode with optional BOS, and the stop ids generation should use."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_id: int | None = None,
               eos_ids: Sequence[int] = (), chat_template: str | None = None):
    self.tokenizer = tokenizer
    self.bos_id = bos_id
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.chat_template = chat_template

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> 'Tokenizer':
    """From `tokenizer.json`, or a folder holding it (and optionally the configs)."""
    path = os.fspath(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, 'tokenizer.json') if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise ValueError(f'no tokenizer.json at {file}')
    tok = tokenizers.Tokenizer.from_file(file)
    bos, eos = _special_ids(folder, tok)
    return cls(tok, bos_id=bos, eos_ids=eos, chat_template=_chat_template(folder))

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def encode_batch(self, texts: Sequence[str], *, add_bos: bool = True) -> list[list[int]]:
    return [self.encode(t, add_bos=add_bos) for t in texts]

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    ids = [int(i) for i in ids if int(i) >= 0]  # generation pads finished rows with -1
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                          add_generation_prompt: bool = True) -> str:
    """The prompt text of chat `messages` ({"role", "content"} each) under the model's template.

    Encode the result with `add_bos=False`: chat templates write their own special tokens.
    """
    if self.chat_template is None:
      raise ValueError('this tokenizer has no chat template (its checkpoint ships none)')
    bos = None if self.bos_id is None else self.tokenizer.id_to_token(self.bos_id)
    eos = None if not self.eos_ids else self.tokenizer.id_to_token(self.eos_ids[0])
    return apply_chat_template(self.chat_template, messages,
                               add_generation_prompt=add_generation_prompt, bos_token=bos,
                               eos_token=eos)


def _special_ids(folder: str, tok: tokenizers.Tokenizer) -> tuple[int | None, tuple[int, ...]]:
  bos, eos = None, []
  config = os.path.join(folder, 'config.json')
  if os.path.exists(config):
    with open(config) as f:
      c = json.load(f)
    bos = c.get('bos_token_id')
    e = c.get('eos_token_id')
    eos = [] if e is None else (list(e) if isinstance(e, list) else [e])
  tok_config = os.path.join(folder, 'tokenizer_config.json')
  if os.path.exists(tok_config) and (bos is None or not eos):
    with open(tok_config) as f:
      c = json.load(f)
    if bos is None and _token_string(c.get('bos_token')) is not None:
      bos = tok.token_to_id(_token_string(c['bos_token']))
    if not eos and _token_string(c.get('eos_token')) is not None:
      found = tok.token_to_id(_token_string(c['eos_token']))
      eos = [] if found is None else [found]
  if bos is None:
    bos = next((tok.token_to_id(n) for n in _BOS_NAMES if tok.token_to_id(n) is not None), None)
  if not eos:
    eos = [tok.token_to_id(n) for n in _EOS_NAMES if tok.token_to_id(n) is not None]
  return bos, tuple(eos)


def _chat_template(folder: str) -> str | None:
  """tokenizer_config.json's `chat_template` (or chat_template.jinja), when the folder has one."""
  jinja = os.path.join(folder, 'chat_template.jinja')
  if os.path.exists(jinja):
    with open(jinja) as f:
      return f.read()
  tok_config = os.path.join(folder, 'tokenizer_config.json')
  if os.path.exists(tok_config):
    with open(tok_config) as f:
      template = json.load(f).get('chat_template')
    if isinstance(template, str):
      return template
  return None
