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
import functools
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrajax import AttentionImpl, Segment, SharingPlan
from hydrajax.evaluation import apps
from models import generate as gen
from models import prompt_plan as pp
from models.kv_cache import KVCache
from models.sampling import SamplingParams

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
    return [pp.prompt_node(fewshot, [pp.prompt_node(p, num_samples=samples) for p in problems])]
  if mode == 'one_level':
    return [pp.prompt_node(fewshot, [pp.prompt_node(p) for p in problems for _ in range(samples)])]
  if mode == 'no_sharing':
    return [pp.prompt_node(list(fewshot) + list(p)) for p in problems for _ in range(samples)]
  raise ValueError(f'mode must be one of {MODES}, got {mode!r}')


def kv_tokens(mode: str, fewshot_len: int, problem_lens: Sequence[int], samples: int,
              new_tokens: int) -> int:
  """KV tokens one batch stores in `mode`: the length of generate's plan of it (`plan_prompts`
  of the mode's forest, token values left out: they do not change the layout)."""
  forest = prompt_forest([0] * fewshot_len, [[0] * n for n in problem_lens], samples, mode)
  return pp.plan_prompts(forest, max_new_tokens=new_tokens).kv_tokens


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


def lean_prefill_calls(tp: pp.TreePrompts, chunk: int,
                      call_tokens: int | None = None) -> list[pp.PrefillCall]:
  """`models.generate.prefill_calls` without its padding: fewer, smaller model calls.

  generate pads every round to the largest round's rows and every row to the longest node's
  chunk, so that a tree compiles once. With a long shared node and many short children (a 20K
  document and 1024 questions, or a few-shot prompt and 128 copies of a problem) that is
  (children + 1) x chunk tokens per round: most of the prefill is padding. Here each round is
  split into groups of rows of one tree depth and one width (columns rounded up to a page);
  dummy rows are dropped; a group runs after the groups of smaller depth of its round, so
  ancestors' KV is written before children attend it. Rows whose own pages start at 0 get a
  page table as wide as their columns; others keep generate's width (one compile across a long
  node's rounds).

  call_tokens: at most this many query tokens per call (rows x columns; a group is split by
  rows), default unbounded. The attention's scores over private pages grow with rows x columns x
  row length: 16 rows of private 20K-token documents at 2048 columns ran out of an H200's memory.
  """
  if call_tokens is not None and call_tokens < 1:
    raise ValueError(f'call_tokens must be >= 1, got {call_tokens}')
  out = []
  length = tp.plan.kv_tokens
  for call in pp.prefill_calls(tp, chunk):
    live = np.flatnonzero(call.segment_ids >= 0)
    need = (call.write_slots < length).sum(axis=1)
    page = call.plan.page_size  # columns and starts are whole pages
    cols = {int(r): min(call.tokens.shape[1], -(-int(need[r]) // page) * page) for r in live}
    starts = {int(r): call.plan.private_lengths[r] - call.tokens.shape[1] for r in live}
    keys = sorted({(tp.nodes[call.segment_ids[r]][1], cols[int(r)]) for r in live})
    batches = []
    for depth, c in keys:
      rows = [int(r) for r in live if (tp.nodes[call.segment_ids[r]][1], cols[int(r)]) == (depth, c)]
      per_call = len(rows) if call_tokens is None else max(1, call_tokens // c)
      batches += [(rows[i:i + per_call], c) for i in range(0, len(rows), per_call)]
    for rows, c in batches:
      width = max(starts[r] + c for r in rows) // page  # pages
      if width * page > c:
        width = call.max_private_pages
      segments = []
      for seg in call.plan.segments:
        inside = [i for i, r in enumerate(rows) if seg.row_begin <= r < seg.row_end]
        if inside:
          segments.append(Segment(seg.kv_start, seg.kv_length, inside[0], inside[-1] + 1, -1,
                                  seg.position))
      for i, seg in enumerate(segments):  # nearest earlier segment holding its rows
        parent = next((k for k in range(i - 1, -1, -1) if segments[k].row_begin <= seg.row_begin
                       and seg.row_end <= segments[k].row_end), -1)
        segments[i] = dataclasses.replace(seg, parent=parent)
      pages = tuple(tuple(call.plan.private_pages[r][:width])
                    + (0,) * (width - len(call.plan.private_pages[r][:width])) for r in rows)
      plan = SharingPlan(len(rows), tuple(segments), page, pages,
                         tuple(starts[r] + c for r in rows), length)
      out.append(pp.PrefillCall(call.tokens[rows, :c], call.positions[rows, :c],
                                 call.write_slots[rows, :c], plan, width,
                                 call.last_index[rows], call.segment_ids[rows]))
  return out


def lean_prefill(model, tp: pp.TreePrompts, cache: KVCache, *, impl, chunk: int,
                 call_tokens: int | None = None, written: frozenset[int] = frozenset()):
  """Writes every node's KV once (see `lean_prefill_calls`); returns (first logits, cache).

  written: nodes (segment indices) whose KV the cache already holds at their place in the
  plan (e.g. a document shared by every point of a sweep): their calls are skipped. No row may
  end on such a node (its first logits would be missing).
  """
  if any(int(j) in written for j in tp.row_node):
    raise ValueError(f'written={sorted(written)} holds a node that ends a row: its logits are needed')
  calls = [(call, call.plan.to_device(max_private_pages=call.max_private_pages))
           for call in lean_prefill_calls(tp, chunk, call_tokens)
           if not all(int(j) in written for j in call.segment_ids[call.segment_ids >= 0])]
  return gen.run_prefill(model, calls, tp.row_node, cache, impl=impl)


_COMPILE_EVENTS = frozenset({
    '/jax/core/compile/jaxpr_trace_duration',
    '/jax/core/compile/jaxpr_to_mlir_module_duration',
    '/jax/core/compile/backend_compile_duration',
})


class CompileClock:
  """Seconds JAX spends tracing, lowering and compiling while it is open (jax.monitoring's
  compile events, recorded in the thread that compiles): a timed window's compile share."""

  def __init__(self):
    self.seconds = 0.0

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
      self.seconds += duration

  def __enter__(self) -> 'CompileClock':
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)


@dataclasses.dataclass(frozen=True)
class BatchRun:
  """One batch generated: tokens [rows, M] by (problem, sample), times, and its KV size.

  prefill_s and decode_s are steady-state times: the compiles inside their windows are taken out
  (a new prompt shape compiles its prefill; one decode step runs untimed first and compiles the
  loop, the rest is scaled to all its steps). compile_s: every compile of the batch, the untimed
  warm-ups' included.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  prefill_s: float
  decode_s: float
  kv_tokens: int
  rows: int
  compile_s: float = 0.0


def _root_segment(forest, tp: pp.TreePrompts) -> int | None:
  """The segment holding the forest's one root at tokens [0, n) of the plan when the root has
  children (a document above its questions), else None."""
  seg = tp.plan.segments[0] if tp.plan.segments else None
  if len(forest) != 1 or not forest[0].children or seg is None:
    return None
  return 0 if (seg.kv_start, seg.kv_length) == (0, len(forest[0].tokens)) else None


def run_batch(model, forest, *, max_new_tokens: int, sampling: SamplingParams, seed: int,
              stop_tokens: Sequence[int], impl, prefill_chunk: int = 512,
              prefill_call_tokens: int | None = None, cache_dtype=None,
              warm_prefill: bool = False, root_kv: dict | None = None) -> BatchRun:
  """`models.generate.generate`'s steps, with prefill and decode timed apart (device synced).

  prefill_chunk, prefill_call_tokens: `lean_prefill_calls`' chunk and call_tokens.
  warm_prefill: run the prefill once untimed first, so its time excludes compiling.
  root_kv: a dict shared across calls whose forests have the same root (a document under
  different questions): the first call whose plan holds the root as its first segment stores
  its KV there, later ones copy it in instead of prefilling it again (bitwise the same KV:
  the root's prefill does not depend on its children).
  """
  tp = pp.plan_prompts(forest, max_new_tokens=max_new_tokens)
  dtype = cache_dtype or model.dtype
  key = jax.random.key(seed)
  stops = jnp.asarray(np.array(list(stop_tokens), np.int32).reshape(-1))
  graphdef, params = nnx.split(model)
  # As generate: XLA prefill for XLA decode, else the backend's kernel where it fits.
  prefill_impl = (AttentionImpl.XLA if impl in (AttentionImpl.XLA, 'xla')
                  else AttentionImpl.AUTO)
  prefill = functools.partial(lean_prefill, model, tp, impl=prefill_impl, chunk=prefill_chunk,
                              call_tokens=prefill_call_tokens)
  with CompileClock() as clock:  # compiles inside the timed windows are taken out
    if warm_prefill:
      jax.block_until_ready(prefill(KVCache.zeros(model.config, tp.plan.kv_tokens, dtype)))
    start, compiled = time.perf_counter(), clock.seconds
    cache = KVCache.zeros(model.config, tp.plan.kv_tokens, dtype)
    node = None if root_kv is None else _root_segment(forest, tp)
    n = len(forest[0].tokens)
    written = frozenset()
    if node is not None and 'kv' in root_kv:
      k, v = root_kv['kv']
      cache = KVCache(cache.k.at[:, :n].set(k), cache.v.at[:, :n].set(v))
      written = frozenset({node})
    first, cache = prefill(cache, written=written)
    if node is not None and 'kv' not in root_kv:
      root_kv['kv'] = (cache.k[:, :n], cache.v[:, :n])
    jax.block_until_ready(first)
    prefill_s = time.perf_counter() - start - (clock.seconds - compiled)
    rows = pp.tree_rows(tp)
    layout = tp.plan.to_device()
    state = gen.start_decode(cache, first, rows, key, stops, max_new_tokens=max_new_tokens,
                             sampling=sampling)
    state = gen.decode(graphdef, params, state, layout, rows, key, stops, jnp.int32(1),
                       sampling=sampling, impl=impl)  # compiles; untimed
    warm_steps = int(state.step)
    start, compiled = time.perf_counter(), clock.seconds
    state = gen.decode(graphdef, params, state, layout, rows, key, stops,
                       jnp.int32(max_new_tokens), sampling=sampling, impl=impl)
    tokens = np.asarray(state.tokens)
    decode_s = time.perf_counter() - start - (clock.seconds - compiled)
  steps = int(state.step)
  if steps > warm_steps:
    decode_s *= steps / (steps - warm_steps)
  order = np.lexsort((tp.sample_ids, tp.prompt_ids))
  return BatchRun(tokens[order], np.asarray(state.lengths)[order], prefill_s, decode_s,
                  tp.plan.kv_tokens, tp.num_rows, clock.seconds)
