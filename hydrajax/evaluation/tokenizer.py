"""A byte-level tokenizer: ids 0..255 are bytes, then BOS and EOS (vocab 258).

The interface of `models.tokenizer.Tokenizer` (encode with optional BOS, decode skipping
specials, `bos_id`, `eos_ids`, `vocab_size`), so generation and the experiments take either.
"""

from typing import Sequence


class ByteTokenizer:
  """UTF-8 bytes as tokens; decode replaces invalid byte sequences."""

  bos_id = 256
  eos_id = 257
  eos_ids = (257,)
  vocab_size = 258

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = list(text.encode('utf-8'))
    return [self.bos_id] + ids if add_bos else ids

  def encode_batch(self, texts: Sequence[str], *, add_bos: bool = True) -> list[list[int]]:
    return [self.encode(t, add_bos=add_bos) for t in texts]

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    data = bytearray()
    for i in ids:
      i = int(i)
      if 0 <= i < 256:
        data.append(i)
      elif i >= 256 and not skip_special_tokens:
        data += b'<s>' if i == self.bos_id else b'</s>'
    return data.decode('utf-8', 'replace')
