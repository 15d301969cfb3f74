"""End-to-end decode throughput of the Llama with a shared prefix (Hydragen figures 3/4).

B sequences share one P-token prompt and each generates M tokens. The prefix
is prefilled once; then each mode lays out the KV cache its own way and runs
the same jitted decode loop (`models.generate.decode`):

  no_sharing    every row stores and reads its own prefix copy (FlashAttention-style baseline)
  paged         the prefix pages are stored once but every row's page table lists them, so
                each row reads them itself (the vLLM baseline)
  tree          Hydragen: the prefix is one shared segment (matrix-matrix attention),
                the generated tokens private pages
  no_attention  the tree cache and every projection, without the attention product (ceiling)

The first three run with an attention implementation (`xla`, or `mosaic_gpu`
when it supports the inputs). Decode time is wall time around the whole
jitted loop (one program, so no per-token host time), after a warm-up step;
slow points time fewer steps (`steps_timed` says how many). Memory comes from
XLA's analysis of the compiled decode program; points whose cache or program
does not fit are recorded as such, not run.

With a tensor-parallel model (`models.init_model(..., mesh=)`)
the same code runs sharded: the cache is made in its shards, memory figures
are per device, and the attention implementation is resolved for one
device's heads.
"""

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarking import gpu_clock, timing
import hydrajax
from hydrajax import AttentionImpl, PromptNode, SharingPlan
from experiments.benchmarking import per_sequence_cost, shared_prefix_cost
from hydrajax.attention.parallel import DP, TP, mesh_sizes
from hydrajax.evaluation import needle
from models import sharding_rules as sr
from models.config import LlamaConfig
from models.generate import decode, prefill, start_decode
from models.kv_cache import KVCache, cache_sharding
from models.llama import Llama, ModelMode
from models.prompt_plan import RowSpec, plan_prompts, prompt_node
from models.sampling import SamplingParams

log = logging.getLogger(__name__)

MODES = ('no_sharing', 'paged', 'tree', 'no_attention')
# What names an implementation's own attention kernels in a profile (`impl_kernels_s`: those
# alone, without the glue XLA runs around them, which `attention_kernel_s` also holds).
IMPL_KERNEL_MARKERS = {'mosaic_gpu': 'mosaic_gpu_kernel'}
GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class Case:
  """One point of the grid."""

  mode: str
  impl: str  # 'xla' or 'mosaic_gpu'; '' for no_attention
  batch: int
  prefix: int
  new_tokens: int

  @property
  def name(self) -> str:
    return self.mode if self.mode == 'no_attention' else f'{self.mode}_{self.impl}'


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
  """What a mode decodes with: the layout, the per-row spec and the cache size L."""

  plan: SharingPlan
  rows: RowSpec
  kv_tokens: int
  prefix_dest: np.ndarray  # [copies] flat token index where each copy of the prefix starts


def decode_setup(case: Case, page_size: int) -> DecodeSetup:
  """The cache layout of a mode (host side)."""
  b, p, m = case.batch, case.prefix, case.new_tokens
  if case.mode in ('tree', 'no_attention'):
    capacity = -(-m // page_size) * page_size  # aligned pages suit the kernels
    plan = hydrajax.plan_tree(PromptNode(p, num_samples=b), private_capacity=capacity)
    base = np.array([pages[0] * plan.page_size for pages in plan.private_pages], np.int32)
    return DecodeSetup(plan, _rows(p, base, 0), plan.kv_tokens, np.zeros(1, np.int32))
  if p % page_size:
    raise ValueError(f'prefix {p} must be a multiple of page_size {page_size} for {case.mode}')
  own = -(-m // page_size)  # pages of generated tokens per row
  if case.mode == 'paged':
    shared = p // page_size
    pages = tuple(tuple(range(shared)) + tuple(shared + r * own + i for i in range(own))
                  for r in range(b))
    length = p + b * own * page_size
    base = p + np.arange(b, dtype=np.int32) * own * page_size
    dest = np.zeros(1, np.int32)
  elif case.mode == 'no_sharing':
    per_row = p // page_size + own
    pages = tuple(tuple(r * per_row + i for i in range(per_row)) for r in range(b))
    length = b * per_row * page_size
    base = np.arange(b, dtype=np.int32) * per_row * page_size + p
    dest = np.arange(b, dtype=np.int32) * per_row * page_size
  else:
    raise ValueError(f'mode must be one of {MODES}, got {case.mode!r}')
  plan = SharingPlan(b, (), page_size, pages, (p,) * b, length)
  return DecodeSetup(plan, _rows(p, base, p), length, dest)


def _rows(prefix: int, write_base: np.ndarray, private_base: int) -> RowSpec:
  b = write_base.shape[0]
  return RowSpec(
      positions=jnp.full((b,), prefix, jnp.int32),
      write_base=jnp.asarray(write_base, jnp.int32),
      private_base=jnp.full((b,), private_base, jnp.int32),
      sequence_ids=jnp.arange(b, dtype=jnp.int32),
  )


def decode_impl(case: Case) -> AttentionImpl | ModelMode:
  """The attention implementation a case decodes with (NO_ATTENTION for no_attention)."""
  return ModelMode.NO_ATTENTION if case.mode == 'no_attention' else AttentionImpl(case.impl)


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """A case's `models.generate.decode` call (greedy, a fixed key, no stop tokens) but for the
  state and the step count: one program for every count. Arrays, or ShapeDtypeStructs to lower
  with no device (`experiments.xla_programs`)."""

  graphdef: Any  # static
  params: Any
  layout: Any  # TreeLayout
  rows: RowSpec
  key: Any
  stops: Any  # [0] int32
  impl: AttentionImpl | ModelMode

  def lower(self, state) -> jax.stages.Lowered:
    return decode.lower(self.graphdef, self.params, state, self.layout, self.rows, self.key,
                        self.stops, jnp.int32(1), sampling=GREEDY, impl=self.impl)

  def runner(self, compiled):
    """(state, n) -> the state n steps later, by `compiled` (from `lower`); donates the state."""
    return lambda state, n: compiled(self.params, state, self.layout, self.rows, self.key,
                                     self.stops, jnp.int32(n))


def decode_call(model: Llama, case: Case, setup: DecodeSetup, cache: KVCache, first_logits, *,
                layout=None, sharding=None) -> tuple[DecodeCall, Any]:
  """(the decode call of `case`, its first state) for a cache holding the prefix.

  first_logits [V] or [B, V]: the prefill's last logits. The cache is donated. `layout`: the
  setup's plan on the device, if the caller made it already (else made here). With `sharding`
  the model, cache and logits are abstract (`nnx.eval_shape`, ShapeDtypeStructs), and so are
  the call's params, layout and rows and the state, on that sharding.
  """
  key, stops = jax.random.key(0), jnp.zeros((0,), jnp.int32)

  def start(cache, first_logits):
    first = jnp.broadcast_to(first_logits, (case.batch, first_logits.shape[-1]))
    return start_decode(cache, first, setup.rows, key, stops, max_new_tokens=case.new_tokens,
                        sampling=GREEDY)

  graphdef, params = nnx.split(model)
  layout = setup.plan.to_device() if layout is None else layout
  rows = setup.rows
  if sharding is None:
    state = start(cache, first_logits)
  else:
    place = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    state = place(jax.eval_shape(start, cache, first_logits))
    params, layout, rows = place(params), place(layout), place(rows)
  return DecodeCall(graphdef, params, layout, rows, key, stops, decode_impl(case)), state


def cache_bytes(config: LlamaConfig, kv_tokens: int, itemsize: int) -> int:
  return config.kv_bytes_per_token(itemsize) * kv_tokens


def params_bytes(model: Llama) -> int:
  """Parameter bytes on one device (all of them without a mesh)."""
  first = lambda x: x.addressable_shards[0].data.nbytes if hasattr(x, 'addressable_shards') \
      else x.nbytes
  return sum(first(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _tp(model: Llama) -> int:
  return sr.axis_size(getattr(model, 'mesh', None), sr.TP)


def _kv_heads(model: Llama) -> int:
  """kv heads one device holds (replicated ones counted)."""
  c = model.config
  return c.num_kv_heads * sr.kv_replication(c.num_heads, c.num_kv_heads, model.mesh) // _tp(model)


def decode_matmul_flops(config: LlamaConfig, batch: int) -> float:
  """Matmul FLOPs of one decode step outside attention (projections, MLP, LM head)."""
  c = config
  per_layer = c.dim * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.dim * c.mlp_dim
  return 2.0 * batch * (c.num_layers * per_layer + c.dim * c.vocab_size)


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> np.ndarray:
  """`length` token ids drawn uniformly from the vocabulary: a prompt for random weights."""
  return np.random.default_rng(seed).integers(0, vocab_size, length)


def text_prompt(tokenizer, length: int) -> list[int]:
  """`length` tokens of real text whose greedy continuation means something: a document with
  planted facts, then a question about one of them (`hydrajax.evaluation.needle`)."""
  task = needle.make_task(num_chars=5 * length, num_questions=1, seed=0)
  question = tokenizer.encode('\n' + task.questions[0], add_bos=False)
  return needle.document_tokens(tokenizer, task, length - len(question)) + question


def prefill_prefix(model: Llama, tokens, *, chunk: int, impl=AttentionImpl.XLA):
  """Prefills one prompt (token ids); returns (k, v [layers, P, K, H], last logits [V], seconds).

  Runs twice (compile, then timed): the time is the second run's.
  """
  prefix = len(tokens)
  tp = plan_prompts([prompt_node(np.asarray(tokens))], max_new_tokens=1)
  seconds = None
  for _ in range(2):
    cache = KVCache.zeros(model.config, tp.plan.kv_tokens, model.dtype, mesh=model.mesh)
    start = time.perf_counter()
    first, cache = prefill(model, tp, cache, impl=impl, chunk=chunk)
    jax.block_until_ready((first, cache))
    seconds = time.perf_counter() - start
  k, v = cache.k[:, :prefix], cache.v[:, :prefix]
  return k, v, first[0], seconds


def _build_cache(k, v, kv_tokens: int, dest: np.ndarray, mesh=None) -> KVCache:
  """A cache of L tokens with the prefix k, v [layers, P, K, H] copied at every `dest`."""
  out_shardings = None
  if mesh is not None:
    shape = (k.shape[0], kv_tokens) + k.shape[2:]
    out_shardings = KVCache(*(cache_sharding(mesh, shape),) * 2)

  @functools.partial(jax.jit, out_shardings=out_shardings)
  def build(k, v, dest):
    nl, p, kh, h = k.shape
    out = []
    for x in (k, v):
      buf = jnp.zeros((nl, kv_tokens, kh, h), x.dtype)
      idx = (dest[:, None] + jnp.arange(p)[None]).reshape(-1)
      out.append(buf.at[:, idx].set(jnp.tile(x, (1, dest.shape[0], 1, 1))))
    return KVCache(*out)

  return build(k, v, jnp.asarray(dest))


def run_case(model: Llama, case: Case, prefix_kv, first_logits, *, page_size: int,
             memory_limit: int, max_decode_s: float, profile_kernels: int = 0,
             compiler_options: dict[str, Any] | None = None) -> dict[str, Any]:
  """Measures one point; returns its record (status 'ok', 'does_not_fit' or 'unsupported').

  `compiler_options` are XLA options for the decode program over the library's own
  (`models.kv_cache.CACHE_PROGRAM_OPTIONS`), e.g. {'xla_disable_hlo_passes': ''} for XLA's
  default passes.

  With `profile_kernels` > 0 (GPU), one more step is profiled and its costliest
  kernels recorded (`top_kernels`: name, microseconds, launches). That step comes after the
  timed ones, so its rows hold more private tokens (`kernel_suffix`) than their mean
  (`suffix_mid`): `add_derived` takes its device-time floor at that length.
  """
  c = model.config
  itemsize = jnp.dtype(model.dtype).itemsize
  weights = params_bytes(model)
  record: dict[str, Any] = dict(
      mode=case.mode, impl=case.impl or 'none', name=case.name, batch=case.batch,
      prefix=case.prefix, new_tokens=case.new_tokens, page_size=page_size,
      weights_bytes=weights, memory_limit_bytes=memory_limit,
  )
  setup = decode_setup(case, page_size)
  cbytes = cache_bytes(c, setup.kv_tokens, itemsize) * _kv_heads(model) // c.num_kv_heads
  record.update(kv_tokens=setup.kv_tokens, cache_bytes=cbytes, tp=_tp(model))
  if weights + cbytes > memory_limit:
    record.update(status='does_not_fit', reason='weights + KV cache exceed device memory')
    return record
  if case.impl == 'xla' and case.mode in ('paged', 'no_sharing'):
    # The XLA path gathers every row's pages: K and V [B, S, K, H] of one layer at a time.
    gather = 2 * case.batch * setup.plan.to_device().max_private_tokens * (
        _kv_heads(model) * c.head_dim * itemsize)
    record['gather_bytes_estimate'] = gather
    if weights + cbytes + gather > memory_limit:
      record.update(status='does_not_fit', reason='estimated: weights + cache + the XLA path\'s '
                    'per-row gather of K and V [B, S, K, H] exceed device memory')
      return record
  impl = decode_impl(case)
  layout = setup.plan.to_device()
  if impl is not ModelMode.NO_ATTENTION:
    # One device's heads: what each shard of the attention shard_map runs.
    q = jax.ShapeDtypeStruct((case.batch, 1, c.num_heads // _tp(model), c.head_dim), model.dtype)
    kv = jax.ShapeDtypeStruct((c.num_layers * setup.kv_tokens, _kv_heads(model), c.head_dim),
                              model.dtype)
    try:
      resolved, _ = hydrajax.resolve(impl, q, kv, kv, layout)
    except ValueError as e:
      record.update(status='unsupported', reason=str(e))
      return record
    record['resolved_impl'] = resolved.value
  cache = _build_cache(*prefix_kv, setup.kv_tokens, setup.prefix_dest, model.mesh)
  call, state = decode_call(model, case, setup, cache, first_logits, layout=layout)
  start = time.perf_counter()
  compiled = call.lower(state).compile(compiler_options)
  record['compile_s'] = time.perf_counter() - start
  log.info('%s B=%d P=%d: decode compiled in %.1f s', case.name, case.batch, case.prefix,
           record['compile_s'])
  mem = compiled.memory_analysis()
  if mem is not None:
    program = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)
    record.update(program_bytes=program, temp_bytes=mem.temp_size_in_bytes)
    if program > memory_limit:
      record.update(status='does_not_fit', reason='decode program (weights, cache, temporaries) '
                    'exceeds device memory')
      return record
  run = call.runner(compiled)

  def timed(state, n):
    start = time.perf_counter()
    state = jax.block_until_ready(run(state, n))
    return state, time.perf_counter() - start

  state, warm = timed(state, 1)  # warm-up step: first-run costs (e.g. NCCL set-up at tp > 1)
  state, one = timed(state, 1)  # one step plus the call's fixed cost
  left = case.new_tokens - int(state.step)
  first_step = int(state.step)
  steps = max(1, min(left, int(max_decode_s / max(one, 1e-6))))
  # The SM clock the timed steps ran at (NVIDIA GPUs; ceilings are measured at the full clock).
  with gpu_clock.ClockSampler.for_backend(jax.default_backend()) as clock:
    state, elapsed = timed(state, steps)
  record.update(clock.summary())
  steps = int(state.step) - first_step
  # The step time is the slope: a call's fixed cost (dispatch, argument checks, the final
  # sync) is paid once per call, i.e. once per generation, not once per token.
  step_s = (elapsed - one) / (steps - 1) if steps > 1 else elapsed
  if step_s <= 0:  # noise larger than the steps (a loaded CPU): the plain mean instead
    step_s = elapsed / steps
  if profile_kernels and int(state.step) < case.new_tokens:
    record['kernel_suffix'] = int(state.step)  # step s feeds a row's s-th generated token
    state, kernels = timing.kernel_times(run, state, 1)
    record['top_kernels'] = kernels[:profile_kernels]
    record['kernel_profile'] = kernels  # every kernel: `unshared_kernel_s` matches them by name
    # Device time of one step, every kernel: `add_derived` takes attention's share from it too.
    record['kernel_step_s'] = sum(us for _, us, _ in kernels) * 1e-6
    marker = IMPL_KERNEL_MARKERS.get(case.impl)
    if marker is not None and case.mode != 'no_attention':
      record['impl_kernels_s'] = sum(us for name, us, _ in kernels if marker in name) * 1e-6
  stats = jax.devices()[0].memory_stats() or {}
  record.update(
      status='ok', steps_timed=steps, first_step=first_step, decode_s=elapsed, step_s=step_s,
      warmup_step_s=warm, one_step_call_s=one, call_overhead_s=max(0.0, one - step_s),
      tokens_per_s=case.batch / step_s,
      suffix_mid=first_step + (steps - 1) / 2,  # the timed steps' mean private tokens
      peak_bytes_in_use=stats.get('peak_bytes_in_use'),
      # What row 0 generated (every row continues the same prompt greedily): modes that compute
      # the same attention give the same tokens, up to the dtype's rounding.
      row0_tokens=[int(t) for t in np.asarray(state.tokens[0, :int(state.step)])],
  )
  del state
  return record


def add_derived(records: list[dict[str, Any]], config: LlamaConfig, ceilings) -> None:
  """Floors, attention shares, speedups and targets, from the measured points (in place)."""
  c = config
  ok = {(r['name'], r['batch'], r['prefix']): r for r in records if r.get('status') == 'ok'}
  for r in records:
    if r.get('status') != 'ok':
      continue
    b, p = r['batch'], r['prefix']
    suffix = max(1, int(round(r['suffix_mid'])))
    # Floors of one device's share: heads over tp (kv heads replicated below one a device),
    # rows over dp, and the matmuls over both.
    sizes = mesh_sizes(r.get('mesh'))
    tp, dp = sizes.get(TP, 1), sizes.get(DP, 1)
    cost_fn = shared_prefix_cost if r['mode'] in ('tree', 'no_attention') else per_sequence_cost

    def floor_s(suffix, cost_fn=cost_fn):
      shard = (-(-b // dp), p, suffix, c.num_heads // tp, max(1, c.num_kv_heads // tp),
               c.head_dim)
      return c.num_layers * cost_fn(*shard).floor_s(ceilings)

    r['attention_floor_s'] = floor_s(suffix)
    r['tree_attention_floor_s'] = floor_s(suffix, shared_prefix_cost)
    r['devices'] = tp * dp
    flops = decode_matmul_flops(c, b) / (tp * dp)
    r['matmul_flops_per_step'] = flops
    ceiling = ok.get(('no_attention', b, p))
    if r['mode'] == 'no_attention':
      r['matmul_efficiency'] = flops / r['step_s'] / ceilings.matmul_rate
    if ceiling is not None:
      r['attention_s'] = r['step_s'] - ceiling['step_s']
      r['attention_over_floor'] = r['attention_s'] / r['attention_floor_s']
      # The same share in device time (CUPTI, one step each): no host gaps or launch overheads
      # of either step in it, but every kernel of both, so it is what attention's kernels and
      # glue cost on the GPU (wall-time shares of the same kernels move between runs).
      # Both against the floor of the profiled step's lengths (the floor grows with the
      # private tokens, which differ between the timed and the profiled steps).
      if r.get('kernel_step_s') is not None and ceiling.get('kernel_step_s') is not None:
        r['attention_kernel_floor_s'] = floor_s(r.get('kernel_suffix', suffix))
        r['attention_kernel_s'] = r['kernel_step_s'] - ceiling['kernel_step_s']
        r['attention_kernel_over_floor'] = r['attention_kernel_s'] / r['attention_kernel_floor_s']
        if r.get('impl_kernels_s') is not None:
          r['impl_kernels_over_floor'] = r['impl_kernels_s'] / r['attention_kernel_floor_s']
        if r.get('kernel_profile') and ceiling.get('kernel_profile'):
          # Kernels both steps launch alike (same name, same launches: the projections'
          # GEMMs) are the same work; their difference is the GPU's drift between the two
          # runs (of the order of the attention floor itself at 7B), so the matched share
          # leaves them out.
          mine, theirs = unshared_kernel_s(r['kernel_profile'], ceiling['kernel_profile'])
          r['attention_kernel_matched_s'] = mine - theirs
          r['attention_kernel_matched_over_floor'] = (
              r['attention_kernel_matched_s'] / r['attention_kernel_floor_s'])
      r['fraction_of_ceiling'] = r['tokens_per_s'] / ceiling['tokens_per_s']
      r['predicted_tokens_per_s'] = b / (ceiling['step_s'] + r['tree_attention_floor_s'])
    for base in ('paged', 'no_sharing'):
      for impl in ('xla', 'mosaic_gpu'):
        other = ok.get((f'{base}_{impl}', b, p))
        if other is not None and r['mode'] in ('tree',):
          r[f'speedup_vs_{base}_{impl}'] = r['tokens_per_s'] / other['tokens_per_s']


def unshared_kernel_s(profile, other) -> tuple[float, float]:
  """Seconds of the kernels of `profile` and of `other` ([[name, us, launches]] each) that the
  other does not launch alike (same name and launch count)."""
  def alike(p):
    return {(name, calls) for name, _, calls in p}

  shared = alike(profile) & alike(other)
  return tuple(1e-6 * sum(us for name, us, calls in p if (name, calls) not in shared)
               for p in (profile, other))


def max_batch_estimates(records: list[dict[str, Any]], config: LlamaConfig) -> list[dict]:
  """Largest batch that fits, per (name, prefix): weights + per-row bytes (cache + temporaries).

  Per-row bytes come from the largest measured (compiled) batch of that mode:
  (program bytes - weights - the prefix stored once) / batch.
  """
  out = []
  best: dict[tuple, dict] = {}
  for r in records:
    if r.get('program_bytes') is None:
      continue
    key = (r['name'], r['prefix'])
    if key not in best or r['batch'] > best[key]['batch']:
      best[key] = r
  itemsize = 2
  for (name, prefix), r in sorted(best.items()):
    shared = 0 if r['mode'] == 'no_sharing' else config.kv_bytes_per_token(itemsize) * prefix
    fixed = r['weights_bytes'] + shared
    per_row = max(1.0, (r['program_bytes'] - fixed) / r['batch'])
    out.append(dict(name=name, prefix=prefix, from_batch=r['batch'], bytes_per_row=per_row,
                    max_batch=int(max(0, (r['memory_limit_bytes'] - fixed) // per_row))))
  return out


def summary_lines(records, kernels: int = 6) -> list[str]:
  """A line per measured point (step, program memory, attention over its floor) and under it
  the `kernels` costliest kernels of its profiled step (`--profile_kernels`)."""
  lines = []
  for r in records:
    if r.get('status') != 'ok':
      continue
    lines.append(f"{r['name']} B={r['batch']} P={r['prefix']}: step {1e3 * r['step_s']:.2f} ms, "
                 f"program {r.get('program_bytes', 0) / 2**30:.1f} GiB, "
                 f"attn/floor {r.get('attention_over_floor') or 0:.2f}, "
                 f"matched/floor {r.get('attention_kernel_matched_over_floor') or 0:.2f}"
                 + (f", SM clock {r['sm_mhz_min']:.0f}-{r['sm_mhz_median']:.0f} MHz (min-median),"
                    f" power cap {r['power_cap_fraction']:.0%} of samples"
                    if 'sm_mhz_median' in r else ''))
    lines += [f'  {us:9.0f} us x{n:<4d} {name[:90]}'
              for name, us, n in r.get('top_kernels', [])[:kernels]]
  return lines
