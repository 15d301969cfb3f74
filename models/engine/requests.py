"""Requests, their events, and the checks a prompt passes before it is queued."""

import dataclasses
from typing import Callable, Hashable, NamedTuple

import numpy as np

from hydrajax.validation import token_ids
from models.sampling import SamplingParams


class TokenEvent(NamedTuple):
  """One streamed token, or the end of a request without one (token -1: cancelled, error).

  A NamedTuple: cheap to make per token. `logprob` and `top_logprobs` ((token, log-prob)
  pairs, most likely first) are set when the request asked for them.
  """

  request_id: int
  token: int
  index: int  # 0-based index of the token among the request's outputs
  finished: bool
  reason: str | None = None  # 'stop', 'length', 'cancelled' or 'error' when finished
  logprob: float | None = None
  top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass
class Request:
  """A request's state and timings (seconds of the engine's clock).

  `first_sample` is the id of sample 0 of its prompt (its own id when n = 1),
  `sample_index` its own index; `shared_tokens`, `cached_tokens` (the part of
  them reused from finished requests) and `prefilled_tokens` describe its
  prompt's admission, which all its samples share. `logprobs` and
  `top_logprobs` follow `output` when the request asked for them; `error`
  says what failed when it finished with reason 'error'.
  """

  id: int
  prompt: np.ndarray
  params: SamplingParams
  on_token: Callable[[TokenEvent], None] | None = None
  arrival: float = 0.0
  first_sample: int = -1
  sample_index: int = 0
  admitted: float | None = None
  first_token: float | None = None
  finished: float | None = None
  state: str = 'queued'  # queued, running, done, cancelled
  reason: str | None = None
  output: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
  seq_id: int = -1
  shard: int = 0  # the data parallel shard (chunk cache) it runs on, chosen at admission
  shared_tokens: int = 0
  cached_tokens: int = 0
  prefilled_tokens: int = 0
  cancel_requested: bool = False
  error: str | None = None
  client: Hashable = None  # who asked (the queue takes turns between clients)


def check_prompt(prompt, vocab_size: int) -> np.ndarray:
  """A prompt as int64 [n], n >= 1, ids in [0, vocab_size); ValueError naming `prompt`."""
  return np.array(token_ids(prompt, 'prompt', vocab_size=vocab_size, allow_empty=False),
                  np.int64)
