"""PyTorch peers on the same GPU, when torch imports with CUDA.

* torch_flash_tree: Hydragen in PyTorch. The prefix is one FlashAttention-2
  call with every row's queries stacked (GQA group folded into the query
  length) that also returns the LSE; the suffix is a second call per row; the
  two partial states are LSE-merged.
* torch_sdpa_copies: `scaled_dot_product_attention` over per-sequence copies.

Inputs come from the JAX arrays through DLPack (no host copy) and are laid out
once, outside the timed region. Timed with CUDA events around each call, the
L2 flushed by zeroing a 256 MiB buffer before each call; the SM clock is
sampled while they run (`Timing.clock`), as `device_time` does.
"""

import statistics

import numpy as np

from experiments.baselines.common import (
    Candidate, Options, Unsupported, check_copy_budget, require_decode,
)
from experiments.benchmarking import gpu_clock
from experiments.benchmarking.timing import Timing
from experiments.benchmarking.workloads import Problem

_FLUSH_BYTES = 256 * 2**20


def _torch():
  try:
    import torch
  except ImportError as e:
    raise Unsupported(f'torch not importable: {e}') from e
  if not torch.cuda.is_available():
    raise Unsupported('torch has no CUDA device')
  return torch


def _to_torch(torch, x):
  return torch.from_dlpack(x)


def _event_time(torch, run, options: Options) -> Timing:
  repeats = max(10, 4 * options.timing.get('repeats', 5))
  flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device='cuda')
  for _ in range(3):
    run()
  torch.cuda.synchronize()
  starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
  ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
  with gpu_clock.ClockSampler.for_backend('gpu') as clock:
    for s, e in zip(starts, ends):
      flush.zero_()
      s.record()
      run()
      e.record()
    torch.cuda.synchronize()
  samples = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
  return Timing(
      median_s=statistics.median(samples), samples_s=tuple(samples), iterations=1,
      method='CUDA events per call, L2 flushed by zeroing a buffer', flush_bytes=_FLUSH_BYTES,
      clock=clock.summary(),
  )


def _flash(torch, q, k, v, scale):
  """FlashAttention-2 with LSE: q [B, K, M, H], k/v [B, K, S, H] -> out, lse [B, K, M]."""
  res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
  return res[0], res[1]


def torch_flash_tree(problem: Problem, options: Options) -> Candidate:
  """Hydragen in PyTorch: batched prefix + per-row suffix + LSE merge."""
  torch = _torch()
  require_decode(problem)
  s = problem.shape
  b, n, kh, h = s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim
  g = n // kh
  scale = h**-0.5
  q = _to_torch(torch, problem.q)  # [B, 1, N, H]
  q_prefix = q.reshape(b, kh, g, h).permute(1, 0, 2, 3).reshape(1, kh, b * g, h).contiguous()
  q_suffix = q.reshape(b, kh, g, h).contiguous()  # [B, K, G, H]
  pk, pv = (_to_torch(torch, x).permute(1, 0, 2).unsqueeze(0).contiguous() for x in problem.prefix_kv())
  sk, sv = (_to_torch(torch, x).permute(0, 2, 1, 3).contiguous() for x in problem.suffix_kv())

  def run():
    o2, l2 = _flash(torch, q_suffix, sk, sv, scale)  # [B, K, G, H], [B, K, G]
    if s.prefix == 0:
      return o2
    o1, l1 = _flash(torch, q_prefix, pk, pv, scale)  # [1, K, B*G, H], [1, K, B*G]
    o1 = o1.reshape(kh, b, g, h).permute(1, 0, 2, 3)
    l1 = l1.reshape(kh, b, g).permute(1, 0, 2)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    out = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return out.to(q.dtype)

  def output():
    return run().reshape(b, 1, n, h).float().cpu().numpy()

  return Candidate(run=output, time=lambda: _event_time(torch, run, options),
                   note=f'torch {torch.__version__}, aten flash attention with LSE')


def torch_sdpa_copies(problem: Problem, options: Options) -> Candidate:
  """PyTorch `scaled_dot_product_attention` over per-sequence copies."""
  torch = _torch()
  require_decode(problem)
  check_copy_budget(problem, options)
  s = problem.shape
  b, n, h = s.batch, s.num_q_heads, s.head_dim
  q = _to_torch(torch, problem.q).permute(0, 2, 1, 3).contiguous()  # [B, N, 1, H]
  k, v = problem.per_sequence_kv()
  k, v = (_to_torch(torch, x).permute(0, 2, 1, 3).contiguous() for x in (k, v))  # [B, K, S, H]

  def run():
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

  def output():
    return run().permute(0, 2, 1, 3).reshape(b, 1, n, h).float().cpu().numpy()

  return Candidate(run=output, time=lambda: _event_time(torch, run, options),
                   note=f'torch {torch.__version__}')


IMPLEMENTATIONS = {
    'torch_flash_tree': torch_flash_tree,
    'torch_sdpa_copies': torch_sdpa_copies,
}


def copy_bandwidth() -> float | None:
  """Bytes/s (read + written) of a 2 GiB device-to-device copy through PyTorch, or None."""
  try:
    torch = _torch()
  except Unsupported:
    return None
  src = torch.randint(0, 1 << 30, (2**29,), dtype=torch.int32, device='cuda')
  dst = torch.empty_like(src)
  for _ in range(3):
    dst.copy_(src)
  torch.cuda.synchronize()
  times = []
  for _ in range(10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) * 1e-3)
  del src, dst
  torch.cuda.empty_cache()
  return 2 * 2**31 / float(np.median(times))
