"""Probe (session 31): a non-wgmma private decode kernel, in Pallas Triton, against the Mosaic
GPU private kernel's times at the decode grid's short rows.

The Mosaic GPU private kernel copies whole 8-token chunks by TMA into 64-row wgmma tiles: at 9
private tokens a row it reads 16 tokens' bytes, and at B=1024 P=1K 32/32 it runs 95 µs a layer
(2.8 TB/s on what it reads, 1.6 on what the rows hold). This kernel reads each row's valid
tokens only (masked gathers of 256-byte rows, no TMA), one program per (row, `hb` kv heads),
scores by multiply-and-sum on the CUDA cores (T = 1: one query row per q head), and merges a
shared partial state ([B, K, G, H] f32 out, [B, K, G] lse) as the Mosaic kernel's merge does.
It is a measurement, not a library path: no tree item buffers, T = 1 only.

    PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s31/triton_private_probe.py --interpret  # CPU check
    PYTHONPATH=. python3 experiments/results/mosaic_gpu_check/s31/triton_private_probe.py --out DIR    # H200
"""

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as pltr
import jax.numpy as jnp
import numpy as np
from jax import lax

LOG2E = math.log2(math.e)


def merge_shared(m, l, acc, pout_ref, plse_ref, o_ref, lse_ref):
  """Writes the private state (running max m and sum l in log2 units, unnormalized acc) merged
  with the shared partial state (pout normalized, plse natural log; -inf: none)."""
  ls = plse_ref[...] * LOG2E
  mp = jnp.where(l > 0, m, -jnp.inf)
  top = jnp.maximum(ls, mp)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  ws = jnp.exp2(ls - top)
  wp = jnp.exp2(mp - top)
  den = ws + wp * l
  num = ws[..., None] * pout_ref[...] + wp[..., None] * acc
  safe = jnp.where(den > 0, den, 1.0)
  o_ref[...] = (num / safe[..., None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(den > 0, (top + jnp.log2(safe)) / LOG2E, -jnp.inf)


def block_slots(pages_ref, b, i, length, offset, *, bt, page_size):
  """(valid [bt], kv slot [bt]) of row b's tokens [i*bt, (i+1)*bt): page table lookups masked
  past the row's length (their slots are never read)."""
  t = i * bt + jnp.arange(bt, dtype=jnp.int32)
  valid = t < length
  page = pltr.load(pages_ref.at[b, t // page_size], mask=valid, other=0)
  return valid, offset + page * page_size + t % page_size


def launch(kernel, q, k_cache, v_cache, pages, lengths, offset, pout, plse, *, hb, num_warps,
           num_stages, interpret, name):
  """One program per (row, hb kv heads); caches, pages, lengths and offset whole."""
  b_rows, kh, g, h = q.shape
  full = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)
  block = lambda *tail: pl.BlockSpec((None, hb, *tail), lambda i, j: (i, j) + (0,) * len(tail))
  return pl.pallas_call(
      kernel,
      grid=(b_rows, kh // hb),
      in_specs=[block(g, h), full(k_cache), full(v_cache), full(pages), full(lengths),
                full(offset), block(g, h), block(g)],
      out_specs=[block(g, h), block(g)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)],
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(q, k_cache, v_cache, pages, lengths, offset, pout, plse)


def private_decode(q, k_cache, v_cache, pages, lengths, offset, pout, plse, *, page_size,
                   hb, bt, num_warps, num_stages=1, interpret=False):
  """out [B, K, G, H] (q.dtype), lse [B, K, G] f32 (natural): private tokens merged with the
  shared partial state (pout normalized, plse natural log; -inf: none)."""
  b_rows, kh, g, h = q.shape
  scale = h**-0.5 * LOG2E

  def kernel(q_ref, k_ref, v_ref, pages_ref, len_ref, off_ref, pout_ref, plse_ref, o_ref,
             lse_ref):
    b = pl.program_id(0)
    head0 = pl.program_id(1) * hb
    cols_k = jnp.broadcast_to(head0 + jnp.arange(hb, dtype=jnp.int32)[None, :, None], (bt, hb, h))
    cols_h = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[None, None, :], (bt, hb, h))
    length = len_ref[b]
    off = off_ref[0]
    qs = q_ref[...].astype(jnp.float32) * scale  # [hb, G, H]

    def body(i, carry):
      m, l, acc = carry
      valid, slot = block_slots(pages_ref, b, i, length, off, bt=bt, page_size=page_size)
      shape = (bt, hb, h)  # every index an array (interpret mode takes no mixed indexers)
      rows = jnp.broadcast_to(slot[:, None, None], shape)
      mask = jnp.broadcast_to(valid[:, None, None], shape)
      at = (rows, cols_k, cols_h)
      k = pltr.load(k_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
      v = pltr.load(v_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
      s = jnp.sum(k[:, :, None, :] * qs[None], axis=-1)  # [bt, hb, G]
      s = jnp.where(jnp.broadcast_to(valid[:, None, None], s.shape), s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=0))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - m_new[None])
      l = l * alpha + jnp.sum(p, axis=0)
      acc = acc * alpha[..., None] + jnp.sum(p[..., None] * v[:, :, None, :], axis=0)
      return m_new, l, acc

    init = (jnp.full((hb, g), -1e30, jnp.float32), jnp.zeros((hb, g), jnp.float32),
            jnp.zeros((hb, g, h), jnp.float32))
    m, l, acc = lax.fori_loop(0, (length + bt - 1) // bt, body, init)
    merge_shared(m, l, acc, pout_ref, plse_ref, o_ref, lse_ref)

  return launch(kernel, q, k_cache, v_cache, pages, lengths, offset, pout, plse, hb=hb,
                num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                name=f'private_decode_triton_hb{hb}_bt{bt}_w{num_warps}')


def private_decode_dot(q, k_cache, v_cache, pages, lengths, offset, pout, plse, *, page_size,
                       hb, bt, num_warps, num_stages=1, interpret=False):
  """As `private_decode`, with contiguous loads of [bt, hb, H] (a gathered token index, then
  slices: vectorized, GPU only) and the scores of the hb*G q rows (padded to 16) against the
  bt*hb (token, head) rows as one tensor-core dot, masked to each q row's kv head."""
  b_rows, kh, g, h = q.shape
  scale = h**-0.5 * LOG2E
  rows_q = max(16, hb * g)

  def kernel(q_ref, k_ref, v_ref, pages_ref, len_ref, off_ref, pout_ref, plse_ref, o_ref,
             lse_ref):
    b = pl.program_id(0)
    heads = pl.ds(pl.program_id(1) * hb, hb)
    length = len_ref[b]
    off = off_ref[0]
    qs = (q_ref[...].astype(jnp.float32) * scale).reshape(hb * g, h)
    if rows_q > hb * g:
      qs = jnp.concatenate([qs, jnp.zeros((rows_q - hb * g, h), jnp.float32)], 0)
    qs = qs.astype(q.dtype)
    row_head = jnp.arange(rows_q, dtype=jnp.int32) // g  # [rows_q]
    col_head = jnp.arange(bt * hb, dtype=jnp.int32) % hb  # [bt*hb], token-major

    def body(i, carry):
      m, l, acc = carry
      valid, slot = block_slots(pages_ref, b, i, length, off, bt=bt, page_size=page_size)
      mask = jnp.broadcast_to(valid[:, None, None], (bt, hb, h))
      if interpret:  # interpret mode takes no mixed indexers: the same elements, as arrays
        at = (jnp.broadcast_to(slot[:, None, None], (bt, hb, h)),
              jnp.broadcast_to(heads.start + jnp.arange(hb)[None, :, None], (bt, hb, h)),
              jnp.broadcast_to(jnp.arange(h)[None, None, :], (bt, hb, h)))
      else:
        at = (slot, heads, slice(None))
      k = pltr.load(k_ref.at[at], mask=mask, other=0.0).reshape(bt * hb, h)
      v = pltr.load(v_ref.at[at], mask=mask, other=0.0).reshape(bt * hb, h)
      s = pltr.dot(qs, k, trans_b=True)  # [rows_q, bt*hb] f32
      col_valid = jnp.broadcast_to(valid[:, None], (bt, hb)).reshape(bt * hb)
      see = (row_head[:, None] == col_head[None, :]) & col_valid[None, :]
      s = jnp.where(see, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - m_new[:, None])
      l = l * alpha + jnp.sum(p, axis=1)
      acc = acc * alpha[:, None] + pltr.dot(p.astype(v.dtype), v)
      return m_new, l, acc

    init = (jnp.full((rows_q,), -1e30, jnp.float32), jnp.zeros((rows_q,), jnp.float32),
            jnp.zeros((rows_q, h), jnp.float32))
    m, l, acc = lax.fori_loop(0, (length + bt - 1) // bt, body, init)
    m, l, acc = m[:hb * g].reshape(hb, g), l[:hb * g].reshape(hb, g), acc[:hb * g].reshape(hb, g, h)
    merge_shared(m, l, acc, pout_ref, plse_ref, o_ref, lse_ref)

  return launch(kernel, q, k_cache, v_cache, pages, lengths, offset, pout, plse, hb=hb,
                num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                name=f'private_decode_dot_hb{hb}_bt{bt}_w{num_warps}')


def reference(q, k_cache, v_cache, pages, lengths, offset, pout, plse, *, page_size):
  b_rows, kh, g, h = q.shape
  cap = pages.shape[1] * page_size
  t = jnp.arange(cap)
  slot = offset[0] + pages[:, t // page_size] * page_size + t % page_size  # [B, cap]
  k = k_cache[slot].astype(jnp.float32)  # [B, cap, K, H]
  v = v_cache[slot].astype(jnp.float32)
  s = jnp.einsum('bkgh,btkh->bkgt', q.astype(jnp.float32), k) * h**-0.5
  valid = (t[None] < lengths[:, None])[:, None, None, :]
  s = jnp.where(valid, s, -jnp.inf)
  s_all = jnp.concatenate([s, plse[..., None]], -1)
  lse = jax.nn.logsumexp(s_all, axis=-1)
  p = jnp.exp(s - lse[..., None])
  out = jnp.einsum('bkgt,btkh->bkgh', p, v) + jnp.exp(plse - lse)[..., None] * pout
  return out, lse


def make(b, s, kh, g, *, capacity, page_size, seed, dtype=jnp.bfloat16):
  """B rows of s private tokens each in their own `capacity`-token pages (a shuffled table)."""
  rng = np.random.default_rng(seed)
  per_row = capacity // page_size
  perm = rng.permutation(b * per_row).astype(np.int32).reshape(b, per_row)
  keys = jax.random.split(jax.random.key(seed), 5)
  h = 128
  tokens = b * capacity + page_size  # one spare page: offset = page_size
  q = jax.random.normal(keys[0], (b, kh, g, h), dtype)
  kc = jax.random.normal(keys[1], (tokens, kh, h), dtype)
  vc = jax.random.normal(keys[2], (tokens, kh, h), dtype)
  pout = jax.random.normal(keys[3], (b, kh, g, h), jnp.float32)
  plse = jax.random.normal(keys[4], (b, kh, g), jnp.float32) * 3
  lengths = jnp.full((b,), s, jnp.int32) if s >= 0 else jnp.asarray(
      rng.integers(0, capacity + 1, b), jnp.int32)
  return (q, kc, vc, jnp.asarray(perm), lengths, jnp.asarray([page_size], jnp.int32), pout,
          plse)


def check(args_, page_size, want=None, *, dot=False, **kw):
  out, lse = (private_decode_dot if dot else private_decode)(*args_, page_size=page_size, **kw)
  ro, rl = want or reference(*args_, page_size=page_size)
  o, r = np.asarray(out, np.float32), np.asarray(ro, np.float32)
  rel = float(np.linalg.norm(o - r) / np.linalg.norm(r))
  lse_err = float(np.max(np.abs(np.asarray(lse) - np.asarray(rl))))
  return rel, lse_err


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--interpret', action='store_true')
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  if args.interpret:  # small shapes, random lengths (empty rows included), MHA and GQA
    for (b, kh, g, hb, bt), seed in zip([(5, 4, 1, 2, 16), (3, 4, 4, 2, 8), (4, 2, 8, 1, 16)],
                                        itertools.count()):
      a = make(b, -1, kh, g, capacity=48, page_size=16, seed=seed, dtype=jnp.float32)
      for dot in (False, True):
        rel, lse_err = check(a, 16, dot=dot, hb=hb, bt=bt, num_warps=4, interpret=True)
        print(f'B={b} K={kh} G={g} hb={hb} bt={bt} dot={dot}: out rel {rel:.2e} '
              f'lse max {lse_err:.2e}')
        assert rel < 2e-2 and lse_err < 2e-2, (rel, lse_err)  # dot: bf16 q and p
    return

  sys.path.insert(0, os.getcwd())
  from pallas_kernels.mosaic_gpu.check_on_device import cupti_us
  os.makedirs(args.out, exist_ok=True)
  sink = open(os.path.join(args.out, 'results.jsonl'), 'a')
  # (B, S, K, G): the decode grid's short rows (32/32, 128-token pages as --capacity=128) and
  # the 32/8 shapes' one private token.
  shapes = [(1024, 9, 32, 1), (1024, 13, 32, 1), (1024, 65, 32, 1), (32, 9, 32, 1)]
  configs = [dict(dot=True, hb=hb, bt=bt, num_warps=w) for hb, bt, w in
             [(16, 16, 4), (8, 16, 4), (16, 8, 4), (32, 8, 4), (8, 32, 4), (16, 16, 8)]]
  configs += [dict(hb=hb, bt=bt, num_warps=w) for hb, bt, w in [(4, 16, 2), (8, 8, 4)]]
  for (b, s, kh, g) in shapes:
    sets = [make(b, s, kh, g, capacity=128, page_size=128, seed=i) for i in range(3)]
    want = jax.jit(functools.partial(reference, page_size=128))(*sets[0])
    useful = b * kh * s * 128 * 2 * 2 + b * kh * g * 128 * (2 * 2 + 4 + 4)
    for cfg in configs:
      if cfg['hb'] > kh or (g > 1 and cfg['hb'] * g > 32 * (1 + cfg.get('dot', False))):
        continue
      t0 = time.time()
      try:
        rel, lse_err = check(sets[0], 128, want, **cfg)
        kernel = private_decode_dot if cfg.get('dot') else private_decode
        fn = jax.jit(functools.partial(kernel, page_size=128,
                                       **{k: v for k, v in cfg.items() if k != 'dot'}))
        us, _ = cupti_us(fn, sets)
        rec = dict(shape=[b, s, kh, g], **cfg, us=round(us, 2), out_rel=rel, lse_err=lse_err,
                   tb_s=round(useful / us / 1e6, 2))
      except Exception as e:  # report and go on
        rec = dict(shape=[b, s, kh, g], **cfg, error=f'{type(e).__name__}: {str(e)[:300]}')
      rec['elapsed_s'] = round(time.time() - t0, 1)
      print(json.dumps(rec), flush=True)
      sink.write(json.dumps(rec) + '\n')
      sink.flush()


if __name__ == '__main__':
  main()
