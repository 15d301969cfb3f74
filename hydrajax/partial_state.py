"""The partial attention state `(out, lse)` and its merge.

A partial state is attention of some query rows over a subset of the keys:
`out` is the softmax-weighted mean of the values over that subset, `lse` the
natural-log sum of exp(scores) over it (float32). Attention over a union of
disjoint key sets is the merge of their states:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

An empty key set is `(0, -inf)`: merging it is a no-op, and merging two empty
states gives `(0, -inf)`, never NaN. A NaN score or value among the keys seen makes
the state NaN (lse NaN), as plain softmax attention does, and a merge keeps it NaN: a
corrupt cache shows in the output instead of being dropped as if empty. Golden case (worked by hand): one key with
score 0 and value 1 gives (1, 0); a second with score log 3 and value 5 gives
(5, log 3); the merge is lse = log 4, out = 1/4 * 1 + 3/4 * 5 = 4.
"""

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp


class PartialState(NamedTuple):
  out: jax.Array  # [..., H], any float dtype
  lse: jax.Array  # [...], float32, natural log; -inf for an empty key set


def empty_state(out_shape, dtype=jnp.float32) -> PartialState:
  """The state of attention over no keys: (0, -inf)."""
  return PartialState(
      jnp.zeros(out_shape, dtype), jnp.full(out_shape[:-1], -jnp.inf, jnp.float32)
  )


def normalized(o: jax.Array, l: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The state (o / l, m + log l) of keys with softmax sums `o` [..., H] and `l` [...] taken
  relative to `m`: (0, -inf) where no key was seen (l == 0), NaN where l is NaN."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  return o / l_safe[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


def _weights(lses: jax.Array) -> tuple[jax.Array, jax.Array]:
  """exp(lse_i - max) per state (0 where empty) and the merged lse; axis 0 is the state axis."""
  m = jnp.max(lses, axis=0)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lses - m_safe)  # exp(-inf) = 0 for empty states, NaN for a NaN state
  total = jnp.sum(w, axis=0)
  lse = jnp.where(total == 0, -jnp.inf, m_safe + jnp.log(jnp.where(total == 0, 1.0, total)))
  return w, total, lse


def merge_stacked(outs: jax.Array, lses: jax.Array) -> PartialState:
  """Merge of the states stacked on axis 0 (outs [S, ..., H] float32, lses [S, ...]).

  An empty state adds nothing, whatever its `out` holds (NaN included); a NaN state makes
  the result NaN.
  """
  w, total, lse = _weights(lses)
  acc = jnp.sum(jnp.where(w[..., None] == 0, 0.0, w[..., None] * outs), axis=0)
  return PartialState(acc / jnp.where(total == 0, 1.0, total)[..., None], lse)


def _as_state(state, name: str) -> PartialState:
  """A state as `PartialState` (a plain `(out, lse)` pair too), its shapes checked."""
  if not isinstance(state, tuple) or len(state) != 2:
    raise ValueError(f'{name} must be a PartialState or an (out, lse) pair, got '
                     f'{type(state).__name__}')
  out, lse = state
  if getattr(out, 'ndim', 0) < 1 or getattr(lse, 'shape', None) != tuple(out.shape[:-1]):
    raise ValueError(f'{name}: lse must have out\'s shape without its last axis, got out '
                     f'{getattr(out, "shape", None)} and lse {getattr(lse, "shape", None)}')
  return PartialState(out, lse)


def merge_many(states: Sequence[PartialState], out_dtype=None) -> PartialState:
  """N-way merge of partial states over disjoint key sets (same shapes; an `(out, lse)` pair
  is a state too). An lse is finite, -inf (empty) or NaN (a NaN among its keys)."""
  if not states:
    raise ValueError('merge_many needs at least one state')
  states = [_as_state(s, f'states[{i}]') for i, s in enumerate(states)]
  for i, s in enumerate(states[1:], 1):
    if s.out.shape != states[0].out.shape:
      raise ValueError(f'states must share one shape: states[0].out is {states[0].out.shape}, '
                       f'states[{i}].out is {s.out.shape}')
  out_dtype = out_dtype or states[0].out.dtype
  merged = merge_stacked(jnp.stack([s.out.astype(jnp.float32) for s in states]),
                         jnp.stack([s.lse.astype(jnp.float32) for s in states]))
  return PartialState(merged.out.astype(out_dtype), merged.lse)


def merge(a: PartialState, b: PartialState, out_dtype=None) -> PartialState:
  """2-way merge; see the module docstring."""
  return merge_many([_as_state(a, 'a'), _as_state(b, 'b')], out_dtype)
