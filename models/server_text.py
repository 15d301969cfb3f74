"""A sample's text as its tokens arrive, and the stop strings found in it, in linear time.

A server follows every streamed sample on its event loop, so what it does per token must
not grow with the text so far (a quadratic follower lets one client with long stop strings
stall every other). Here:

* `IncrementalText` decodes only a short window of recent tokens per token (the window
  holds tokens that do not yet make whole characters, plus one token of context that
  decoders such as SentencePiece's need to place a leading space);
* `StopFinder` searches only the new text, plus the longest stop string's length - 1 of
  the text before it (a stop may straddle the two);
* `held_back` is the longest end of the text that may start a stop string (a Knuth-Morris-
  Pratt pass per stop string over at most its own length of text).

The request limits (`MAX_STOP_STRINGS` strings of at most `MAX_STOP_CHARS` characters)
bound the work per token by a constant.
"""

from collections.abc import Sequence

from models.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16  # stop strings (or token-id lists) of one request
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_IDS = 64  # token ids of one stop token-id list

_INCOMPLETE = '\ufffd'  # what a decoder makes of the bytes of an unfinished UTF-8 character


class IncrementalText:
  """The decoded text of a token sequence that grows one token at a time."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.tokens: list[int] = []
    self.text = ''  # whole characters only
    self._prefix = 0  # window start: tokens already in `text`, kept as decoding context
    self._read = 0  # tokens in `text`

  def add(self, token: int) -> str:
    """Appends a token; returns the text it completes ('' while a character is unfinished)."""
    self.tokens.append(token)
    before = self.tokenizer.decode(self.tokens[self._prefix:self._read])
    now = self.tokenizer.decode(self.tokens[self._prefix:])
    if now.endswith(_INCOMPLETE):
      return ''
    new = now[len(before):]
    self.text += new
    self._prefix, self._read = self._read, len(self.tokens)
    return new

  def flush(self) -> str:
    """The end of the text, unfinished characters included (at the sample's end)."""
    before = self.tokenizer.decode(self.tokens[self._prefix:self._read])
    new = self.tokenizer.decode(self.tokens[self._prefix:])[len(before):]
    self.text += new
    self._prefix = self._read = len(self.tokens)
    return new


class StopFinder:
  """Finds the first stop string in a text given piece by piece."""

  def __init__(self, stops: Sequence[str]):
    self.stops = tuple(stops)
    self._longest = max((len(s) for s in self.stops), default=0)
    self._searched = 0  # text before this has been searched for every stop

  def find(self, text: str) -> int | None:
    """Where the first stop starts in `text` (the text so far, `text` of earlier calls plus
    more), or None; searches only what is new."""
    if not self.stops:
      return None
    start = max(0, self._searched - self._longest + 1)
    found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
    self._searched = len(text)
    return min(found) if found else None


def _failure(pattern: str) -> list[int]:
  """KMP: fail[k] = length of the longest proper border of pattern[:k + 1]."""
  fail = [0] * len(pattern)
  k = 0
  for i in range(1, len(pattern)):
    while k and pattern[i] != pattern[k]:
      k = fail[k - 1]
    if pattern[i] == pattern[k]:
      k += 1
    fail[i] = k
  return fail


def _overlap(text: str, pattern: str, fail: list[int]) -> int:
  """Length of the longest end of `text` that is a proper start of `pattern`."""
  k = 0
  for ch in text[-(len(pattern) - 1):] if len(pattern) > 1 else '':
    while k and ch != pattern[k]:
      k = fail[k - 1]
    if ch == pattern[k]:
      k += 1
    if k == len(pattern):  # a whole stop (the caller cuts those first): keep its border
      k = fail[k - 1]
  return k


class HoldBack:
  """How much of a text's end to hold back while it may be the start of a stop string."""

  def __init__(self, stops: Sequence[str]):
    self._patterns = [(s, _failure(s)) for s in stops]

  def __call__(self, text: str) -> int:
    return max((_overlap(text, s, f) for s, f in self._patterns), default=0)
