"""JAX implementations timed by the microbenchmark: hydrajax's own and JAX peers.

hydrajax: the jnp tree path (`tree_attention_xla`) and the Mosaic GPU kernels
(`tree_attention(..., impl=MOSAIC_GPU)`).
Peers: the naive oracle over per-sequence copies; a jnp paged decode whose page
tables all point at one physical copy of the prefix (vLLM's "physically shared
pages"); JAX's stock Pallas (Triton) paged_attention with the same shared page
tables and its flash-decode (`decode_attention.gqa`) over per-sequence copies,
both deprecated in JAX 0.11 and used here only as baselines; and
`jax.nn.dot_product_attention` (cuDNN where it runs, else XLA) over copies.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import hydrajax
from experiments.baselines.common import (
    Candidate, Options, Unsupported, check_copy_budget, require_decode,
)
from experiments.benchmarking.timing import device_time
from experiments.benchmarking.workloads import Problem


def _candidate(fn, args, options: Options, out_of=lambda r: r, note: str = '') -> Candidate:
  jitted = jax.jit(fn)

  def run():
    return np.asarray(out_of(jitted(*args)), np.float32)

  return Candidate(run=run, time=lambda: device_time(fn, *args, **options.timing), note=note)


def xla_tree(problem: Problem, options: Options) -> Candidate:
  """hydrajax's jnp tree path (Hydragen in XLA)."""
  fn = lambda q, k, v, layout: hydrajax.tree_attention_xla(q, k, v, layout)
  args = (problem.q, problem.k_cache, problem.v_cache, problem.layout)
  return _candidate(fn, args, options, out_of=lambda s: s.out)


def mosaic_gpu(problem: Problem, options: Options) -> Candidate:
  """hydrajax's Pallas Mosaic GPU kernels, when importable and supported."""
  args = (problem.q, problem.k_cache, problem.v_cache, problem.layout)
  try:
    impl, _ = hydrajax.resolve(hydrajax.AttentionImpl.MOSAIC_GPU, *args)
  except (ValueError, ImportError) as e:
    raise Unsupported(str(e)) from e
  fn = lambda q, k, v, layout: hydrajax.tree_attention(q, k, v, layout, impl=impl)
  return _candidate(fn, args, options, out_of=lambda s: s.out)


def naive_copies(problem: Problem, options: Options) -> Candidate:
  """The naive oracle (float32) over per-sequence copies of the whole context."""
  check_copy_budget(problem, options, factor=3.0)  # bf16 copies plus their float32 upcast
  k, v = problem.per_sequence_kv()
  lengths = jnp.full((problem.shape.batch,), k.shape[1], jnp.int32)
  fn = lambda q, k, v, n: hydrajax.naive_attention(q, k, v, n)
  return _candidate(fn, (problem.q, k, v, lengths), options, out_of=lambda s: s.out)


def dot_product_copies(problem: Problem, options: Options) -> Candidate:
  """`jax.nn.dot_product_attention` over per-sequence copies: cuDNN on GPU where it runs."""
  require_decode(problem)
  check_copy_budget(problem, options)
  k, v = problem.per_sequence_kv()
  args = (problem.q, k, v)
  failures = []
  impls = ('cudnn', 'xla') if jax.default_backend() == 'gpu' else ('xla',)
  for impl in impls:
    fn = functools.partial(jax.nn.dot_product_attention, implementation=impl)
    try:
      jax.block_until_ready(jax.jit(fn)(*args))
    except Exception as e:  # cuDNN rejects some shapes at compile time
      failures.append(f'{impl}: {type(e).__name__}: {str(e)[:200]}')
      continue
    note = f'implementation={impl}' + (f' (failed: {"; ".join(failures)})' if failures else '')
    return _candidate(fn, args, options, note=note)
  raise Unsupported('; '.join(failures))


def _page_pool(problem: Problem, page_size: int):
  """One physical copy of the prefix in pages, then each row's suffix pages.

  Returns (k_pool, v_pool [num_pages, C, K, H], page_table [B, pages] int32,
  lengths [B] int32): every row's table starts with the same prefix pages.
  """
  s = problem.shape
  if s.prefix % page_size:
    raise Unsupported(f'prefix {s.prefix} is not a multiple of page_size {page_size}')
  c = page_size
  prefix_pages = s.prefix // c
  suffix_pages = -(-s.suffix // c)
  pk, pv = problem.prefix_kv()  # [P, K, H]
  sk, sv = problem.suffix_kv()  # [B, S, K, H]
  pad = suffix_pages * c - s.suffix

  def pool(p, x):
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.concatenate([p.reshape(prefix_pages, c, *p.shape[1:]),
                            x.reshape(s.batch * suffix_pages, c, *x.shape[2:])])

  table = np.concatenate([
      np.broadcast_to(np.arange(prefix_pages), (s.batch, prefix_pages)),
      prefix_pages + np.arange(s.batch)[:, None] * suffix_pages + np.arange(suffix_pages)[None, :],
  ], axis=1).astype(np.int32)
  lengths = np.full((s.batch,), s.prefix + s.suffix, np.int32)
  return pool(pk, sk), pool(pv, sv), jnp.asarray(table), jnp.asarray(lengths)


def _paged_decode(q, k_pool, v_pool, table, lengths, *, block_pages):
  """Flash-decode over page tables in jnp: online softmax over blocks of pages.

  q [B, 1, N, H]; k_pool, v_pool [num_pages, C, K, H]; table [B, pages]; lengths [B].
  """
  b, _, n, h = q.shape
  c, kh = k_pool.shape[1], k_pool.shape[2]
  pages = table.shape[1]
  num_blocks = -(-pages // block_pages)
  table = jnp.pad(table, ((0, 0), (0, num_blocks * block_pages - pages)))
  blocks = table.reshape(b, num_blocks, block_pages).transpose(1, 0, 2)  # [nb, B, bp]
  qg = q.reshape(b, kh, n // kh, h)
  scale = h**-0.5

  def step(carry, xs):
    m, l, acc = carry
    i, ids = xs
    k = k_pool[ids].reshape(b, block_pages * c, kh, h)  # [B, S_b, K, H]
    v = v_pool[ids].reshape(b, block_pages * c, kh, h)
    s = jnp.einsum('bkgh,bskh->bkgs', qg, k, preferred_element_type=jnp.float32) * scale
    pos = i * block_pages * c + jnp.arange(block_pages * c)
    s = jnp.where((pos[None, :] < lengths[:, None])[:, None, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum(
        'bkgs,bskh->bkgh', p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (m_new, l, acc), None

  init = (jnp.full((b, kh, n // kh), -jnp.inf, jnp.float32),
          jnp.zeros((b, kh, n // kh), jnp.float32),
          jnp.zeros((b, kh, n // kh, h), jnp.float32))
  (m, l, acc), _ = jax.lax.scan(step, init, (jnp.arange(num_blocks), blocks))
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(b, 1, n, h).astype(q.dtype)


def paged_jnp(problem: Problem, options: Options) -> Candidate:
  """jnp paged decode; all page tables point at one physical copy of the prefix."""
  require_decode(problem)
  k_pool, v_pool, table, lengths = _page_pool(problem, options.page_size)
  block_pages = max(1, 512 // options.page_size)
  fn = functools.partial(_paged_decode, block_pages=block_pages)
  return _candidate(fn, (problem.q, k_pool, v_pool, table, lengths), options,
                    note=f'page_size={options.page_size}, {block_pages} pages per step')


def _stock_gpu_op(name: str):
  if jax.default_backend() != 'gpu':
    raise Unsupported(f'JAX stock Pallas {name} (Triton) needs a GPU')
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', DeprecationWarning)
      module = __import__(f'jax.experimental.pallas.ops.gpu.{name}', fromlist=[name])
  except ImportError as e:
    raise Unsupported(f'cannot import jax.experimental.pallas.ops.gpu.{name}: {e}') from e
  return module


def paged_pallas(problem: Problem, options: Options) -> Candidate:
  """JAX's stock Pallas paged_attention (deprecated) with physically shared prefix pages."""
  require_decode(problem)
  module = _stock_gpu_op('paged_attention')
  k_pool, v_pool, table, lengths = _page_pool(problem, options.page_size)
  k_splits, per_block = 16, 8
  pages = table.shape[1]
  width = -(-pages // (k_splits * per_block)) * k_splits * per_block
  table = jnp.pad(table, ((0, 0), (0, width - pages)))  # padding pages are masked by lengths
  k_pages = k_pool.transpose(2, 0, 1, 3)  # [K, num_pages, C, H]
  v_pages = v_pool.transpose(2, 0, 1, 3)
  scale = problem.shape.head_dim**-0.5

  def fn(q, k_pages, v_pages, table, lengths):
    # The op applies no softmax scale: scale q first.
    q = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
    out = module.paged_attention(
        q, k_pages, v_pages, table, lengths, k_splits=k_splits, pages_per_compute_block=per_block
    )
    return out[:, None]

  return _candidate(fn, (problem.q, k_pages, v_pages, table, lengths), options,
                    note=f'page_size={options.page_size}, k_splits={k_splits}')


def decode_pallas_copies(problem: Problem, options: Options) -> Candidate:
  """JAX's stock Pallas flash-decode (`decode_attention.gqa`, deprecated) over per-sequence copies."""
  require_decode(problem)
  module = _stock_gpu_op('decode_attention')
  k_splits, block_k = 16, 128
  pad_to = k_splits * block_k  # the op needs S divisible by k_splits * block_k
  s = problem.shape
  padded = -(-(s.prefix + s.suffix) // pad_to) * pad_to
  check_copy_budget(problem, options, factor=padded / (s.prefix + s.suffix))
  k, v = problem.per_sequence_kv(pad_to=pad_to)
  lengths = jnp.full((s.batch,), s.prefix + s.suffix, jnp.int32)
  fn = lambda q, k, v, n: module.gqa(q[:, 0], k, v, kv_seq_len=n, k_splits=k_splits, block_k=block_k)[:, None]
  return _candidate(fn, (problem.q, k, v, lengths), options,
                    note=f'k_splits={k_splits}, block_k={block_k}, copies padded to {padded} tokens')


IMPLEMENTATIONS = {
    'mosaic_gpu': mosaic_gpu,
    'xla_tree': xla_tree,
    'paged_jnp': paged_jnp,
    'paged_pallas': paged_pallas,
    'dot_product_copies': dot_product_copies,
    'decode_pallas_copies': decode_pallas_copies,
    'naive_copies': naive_copies,
}
