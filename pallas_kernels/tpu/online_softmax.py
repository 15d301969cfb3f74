"""Online-softmax state held in VMEM, shared by the Mosaic TPU tree-attention kernels.

A kernel accumulates, per query row, the running maximum `m`, the running sum
`l` of exp(score - m) and the unnormalised output `acc` = sum exp(score - m) * v.
`m` and `l` are kept lane-replicated as [M, 128] float32 (the TPU idiom of
`jax.experimental.pallas.ops.tpu.flash_attention`: a column vector costs a
whole vreg row either way, and full-width loads/stores need no relayout).

Masked scores use the finite `NEG` instead of -inf, so that a row that has seen
no key yet never computes exp(-inf - -inf); `l == 0` marks such a row, and
`finish` turns it into the empty partial state (0, -inf).

A partial state `(out, lse)` (see `hydrajax.partial_state`) enters the running
state as m = lse, l = 1, acc = out, which is exact: merging more keys into it
afterwards is the LSE merge.
"""

import jax
import jax.numpy as jnp

LANES = 128  # TPU vreg lanes; lse/m/l are stored lane-replicated at this width
NEG = -1e30  # finite stand-in for -inf in running maxima
TRANS_B = (((1,), (1,)), ((), ()))  # q [M, H] . k [S, H] -> [M, S]


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """A pallas_call output varying over every mesh axis its operands vary over: inside a
  `jax.shard_map` (with check_vma, the default) an output must say so."""
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in operands))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def reset(m_ref, l_ref, acc_ref) -> None:
  """Empty state: m = NEG, l = 0, acc = 0."""
  m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def load_state(m_ref, l_ref, acc_ref, out, lse) -> None:
  """Starts from a partial state: out [M, H] float32, lse [M, 128] float32 (-inf if empty,
  NaN kept NaN)."""
  seen = lse != -jnp.inf
  m_ref[...] = jnp.where(seen, lse, NEG)
  l_ref[...] = jnp.where(seen, 1.0, 0.0).astype(jnp.float32)
  acc_ref[...] = jnp.where(seen[:, :1], out, 0.0)


def update(q, k, v, visible, m_ref, l_ref, acc_ref, *, scale: float) -> None:
  """Adds one block of keys to the running state.

  Args:
    q: [M, H] queries.
    k: [S, H] keys; rows no query may see can hold anything (even NaN).
    v: [S, H] values; rows no query may see must be finite (zero them first).
    visible: [M, S] bool, or None when every query sees every key (the fast
      path: no mask work on the VPU).
    m_ref, l_ref: [M, 128] float32 refs; acc_ref: [M, H] float32 ref.
    scale: softmax scale.
  """
  s = jax.lax.dot_general(
      q, k, TRANS_B, preferred_element_type=jnp.float32, precision=_precision(q.dtype)
  ) * scale  # [M, S]
  if visible is not None:
    s = jnp.where(visible, s, NEG)
  m_prev = m_ref[...]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [M, 128]
  p = jnp.exp(s - m_next[:, :1])  # [M, S]
  if visible is not None:
    p = jnp.where(visible, p, 0.0)
  alpha = jnp.exp(m_prev - m_next)  # [M, 128]
  l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
  m_ref[...] = m_next
  pv = jax.lax.dot(
      p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=_precision(v.dtype)
  )  # [M, H]
  acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def finish(m_ref, l_ref, acc_ref) -> tuple[jax.Array, jax.Array]:
  """The partial state (out [M, H] float32, lse [M, 128] float32) of the keys seen."""
  l = l_ref[...]
  seen = l != 0.0  # NaN (a NaN score or value) stays NaN
  l_safe = jnp.where(seen, l, 1.0)
  out = acc_ref[...] / l_safe[:, :1]
  lse = jnp.where(seen, m_ref[...] + jnp.log(l_safe), -jnp.inf)
  return out, lse
