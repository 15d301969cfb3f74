"""The APPS workload (Hydragen section 4.4), flag-free so tests and the training script import it.

Prompt (the APPS paper's format, few-shot examples first):

  QUESTION:\n{question}\n{starter_code}\nUse Standard Input format|Use Call-Based format\nANSWER:\n

A few-shot example is that prompt followed by its solution and `END_OF_EXAMPLE`. Every sequence's
prompt is [few-shot examples][problem prompt]; its samples continue from there.

Three sharing modes of the same sequences (the KV each stores):

  two_level   few-shot once; each problem's prompt once; samples private     (Hydragen, 2 levels)
  one_level   few-shot once; every sample stores its own copy of its problem (Hydragen, 1 level)
  no_sharing  every sample stores the whole prompt                           (per-sequence KV)

All three run the same attention implementation over the same tree layout; only what is shared
differs, so time and memory differences come from sharing alone.
"""

import dataclasses
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import AttentionImpl
from hydrajax.evaluation import apps
from models import generate as gen
from models.kv_cache import KVCache
from models.sampling import SamplingConfig

MODES = ('no_sharing', 'one_level', 'two_level')
# The embedded problem set, few-shot examples and tiny model (package data).
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')
END_OF_EXAMPLE = '\nEND_OF_EXAMPLE\n'


def problem_prompt(problem: apps.Problem) -> str:
  kind = 'Use Call-Based format' if problem.call_based else 'Use Standard Input format'
  starter = problem.starter_code
  if starter and not starter.endswith('\n'):
    starter += '\n'
  return f'QUESTION:\n{problem.question.strip()}\n{starter}{kind}\nANSWER:\n'


def fewshot_text(examples: Sequence[apps.Problem]) -> str:
  return ''.join(problem_prompt(p) + p.solutions[0] + END_OF_EXAMPLE for p in examples)


def program_from_completion(text: str) -> str:
  """The program in a completion: everything before the end-of-example marker."""
  return text.split(END_OF_EXAMPLE.strip())[0].rstrip() + '\n'


def pad_tokens(tokens: Sequence[int], length: int) -> list[int]:
  """`tokens` repeated (or cut) to exactly `length` tokens: synthetic prompts of a given size."""
  tokens = list(tokens)
  if length <= 0:
    return tokens
  if not tokens:
    raise ValueError('cannot pad an empty token list')
  return (tokens * (-(-length // len(tokens))))[:length]


def prompt_forest(fewshot: Sequence[int], problems: Sequence[Sequence[int]], samples: int,
                  mode: str) -> list:
  """The `PromptNode` forest of one batch of problems in a sharing mode (see the module doc)."""
  if mode == 'two_level':
    return [gen.prompt_node(fewshot, [gen.prompt_node(p, num_samples=samples) for p in problems])]
  if mode == 'one_level':
    return [gen.prompt_node(fewshot, [gen.prompt_node(p) for p in problems for _ in range(samples)])]
  if mode == 'no_sharing':
    return [gen.prompt_node(list(fewshot) + list(p)) for p in problems for _ in range(samples)]
  raise ValueError(f'mode must be one of {MODES}, got {mode!r}')


def kv_tokens(mode: str, fewshot_len: int, problem_lens: Sequence[int], samples: int,
              new_tokens: int) -> int:
  """KV tokens one batch stores in `mode` (private regions rounded up as generate does)."""
  private = -(-new_tokens // gen.PRIVATE_ALIGN) * gen.PRIVATE_ALIGN
  rows = samples * len(problem_lens)
  if mode == 'two_level':
    return fewshot_len + sum(problem_lens) + rows * private
  if mode == 'one_level':
    return fewshot_len + samples * sum(problem_lens) + rows * private
  if mode == 'no_sharing':
    return rows * fewshot_len + samples * sum(problem_lens) + rows * private
  raise ValueError(f'mode must be one of {MODES}, got {mode!r}')


def max_problems(mode: str, fewshot_len: int, problem_lens: Sequence[int], samples: int,
                 new_tokens: int, kv_bytes_per_token: int, budget_bytes: int) -> int:
  """The most problems (taken in order) whose batch KV fits `budget_bytes` (0: not even one)."""
  best = 0
  for p in range(1, len(problem_lens) + 1):
    if kv_tokens(mode, fewshot_len, problem_lens[:p], samples, new_tokens) * kv_bytes_per_token \
        > budget_bytes:
      break
    best = p
  return best


@dataclasses.dataclass(frozen=True)
class BatchRun:
  """One batch generated: tokens [rows, M] by (problem, sample), times, and its KV size."""

  tokens: np.ndarray
  lengths: np.ndarray
  prefill_s: float
  decode_s: float
  kv_tokens: int
  rows: int


def run_batch(model, forest, *, max_new_tokens: int, sampling: SamplingConfig, seed: int,
              stop_tokens: Sequence[int], impl, prefill_chunk: int = 512,
              cache_dtype=None) -> BatchRun:
  """`models.generate.generate`'s steps, with prefill and decode timed apart (device synced)."""
  tp = gen.plan_prompts(forest, max_new_tokens=max_new_tokens)
  dtype = cache_dtype or model.dtype
  key = jax.random.key(seed)
  stops = jnp.asarray(np.array(list(stop_tokens), np.int32).reshape(-1))
  graphdef, params = nnx.split(model)
  # As generate: XLA prefill for XLA decode, else the backend's kernel where it fits.
  prefill_impl = (AttentionImpl.XLA if impl in (AttentionImpl.XLA, 'xla')
                  else AttentionImpl.AUTO)
  start = time.perf_counter()
  cache = KVCache.zeros(model.config, tp.plan.kv_tokens, dtype)
  first, cache = gen.prefill(model, tp, cache, impl=prefill_impl, chunk=prefill_chunk)
  jax.block_until_ready(first)
  mid = time.perf_counter()
  rows = gen.tree_rows(tp)
  state = gen.start_decode(cache, first, rows, key, stops, max_new_tokens=max_new_tokens,
                           sampling=sampling)
  state = gen.decode(graphdef, params, state, tp.plan.to_device(), rows, key, stops,
                     jnp.int32(max_new_tokens), sampling=sampling, impl=impl)
  tokens = np.asarray(state.tokens)
  end = time.perf_counter()
  order = np.lexsort((tp.sample_ids, tp.prompt_ids))
  return BatchRun(tokens[order], np.asarray(state.lengths)[order], mid - start, end - mid,
                  tp.plan.kv_tokens, tp.num_rows)
