"""The Mosaic TPU training kernels (`pallas_kernels/tpu/training_attention.py`) alone, in TPU
interpret mode on CPU, against the naive oracle and its gradients: a group of shared segments
(one of them empty, lengths no block multiple, NaN past every length) and the private part's
rows, causal, in one launch each. Fresh seeds per run (printed with a failure).

The custom VJP over them is tested in tests/test_tree_attention_grad.py, their lowering for
v5e / v5p in tests/test_tpu_kernels.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import hydrajax as hj
from pallas_kernels.tpu import training_attention as kernel
from tests.conftest import assert_states_close

B, T, N, K, H, S = 3, 2, 4, 2, 8, 45  # a segment's rows; the private part: B = 1
G = N // K
BLOCKS = dict(block_rows=8, block_kv=16)  # several blocks of each kind


def _rng():
  seed = int(np.random.default_rng().integers(1 << 30))
  print(f'seed {seed}')  # shown with a failure
  return np.random.default_rng(seed)




def _problem(rng, causal, dtype, heads=(N, K)):
  """Three items: q [3, rows, T, N, H], K/V [3, S, K, H] with NaN past each length, lengths."""
  rows = 1 if causal else B
  if causal:  # a row's own tokens (its T queries among them), or none
    lengths = [S, int(rng.integers(T, S)), 0]
  else:
    lengths = [S, 0, int(rng.integers(1, S - 1))]
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  n, kh = heads
  q, k, v = draw(3, rows, T, n, H), draw(3, S, kh, H), draw(3, S, kh, H)
  for z, length in enumerate(lengths):
    k, v = (x.at[z, length:].set(jnp.nan) for x in (k, v))
  return q, k, v, lengths


def _fold(x, kh=K):
  """[Z, rows, T, N, ...] -> [Z, rows * T * G, K, ...] (token-major, then the GQA group)."""
  z, r, _, n = x.shape[:4]
  y = x.reshape((z, r, T, kh, n // kh) + x.shape[4:])
  return jnp.swapaxes(y, 3, 4).reshape((z, r * T * (n // kh), kh) + x.shape[4:])


def _unfold(x, rows):
  g, kh = x.shape[0] // (rows * T), x.shape[1]
  y = x.reshape((rows, T, g, kh) + x.shape[2:])
  return jnp.swapaxes(y, 2, 3).reshape((rows, T, g * kh) + x.shape[2:])


def _oracle(q, k, v, causal):
  """One item's state: its rows attend all of k (a segment) or, causal, are its last T."""
  rows, n = q.shape[0], k.shape[0]
  tile = lambda x: jnp.broadcast_to(x, (rows,) + x.shape)
  return hj.naive_attention(q, tile(k), tile(v), jnp.full((rows,), n if causal else n + T))


# (N, K): GQA in every combination; MHA (G = 1) and MQA in one each.
@pytest.mark.parametrize('causal,dtype,heads', [
    (False, jnp.float32, (N, K)), (True, jnp.float32, (N, K)), (False, jnp.bfloat16, (N, K)),
    (True, jnp.bfloat16, (N, K)), (False, jnp.bfloat16, (4, 4)), (True, jnp.float32, (4, 1))],
    ids=['segments-float32', 'causal-float32', 'segments-bfloat16', 'causal-bfloat16',
         'segments-bfloat16-mha', 'causal-float32-mqa'])
def test_forward_matches_oracle(causal, dtype, heads):
  q, k, v, lengths = _problem(_rng(), causal, dtype, heads)
  rows, g = q.shape[1], heads[0] // heads[1]
  args = (_fold(q, heads[1]), k, v, jnp.asarray(lengths, jnp.int32))
  kw = dict(scale=H**-0.5, causal=(T, g) if causal else None)
  got = kernel.segments_forward(*args, **kw, **BLOCKS, interpret=pltpu.InterpretParams())
  reference = kernel.segments_forward_reference(*args, **kw)
  for z, length in enumerate(lengths):
    expected = _oracle(q[z], k[z, :length], v[z, :length], causal)
    for out, lse in (got, reference):
      assert_states_close(hj.PartialState(_unfold(out[z], rows).astype(dtype),
                                          _unfold(lse[z], rows)), expected)
  empty = lengths.index(0)
  assert np.isneginf(np.asarray(got[1][empty])).all() and not np.asarray(got[0][empty]).any()


@pytest.mark.parametrize('causal,heads', [(False, (N, K)), (True, (N, K)), (True, (4, 4)),
                                          (False, (4, 1))],
                         ids=['segments', 'causal', 'causal-mha', 'segments-mqa'])
def test_backward_matches_oracle_grad(causal, heads):
  rng = _rng()
  q, k, v, lengths = _problem(rng, causal, jnp.float32, heads)
  (n, kh), rows = heads, q.shape[1]
  w = jnp.asarray(rng.standard_normal(q.shape, np.float32))
  lses, deltas, expected = [], [], []
  for z, length in enumerate(lengths):
    if length == 0:  # no token: lse -inf, no gradient
      lses.append(jnp.full((rows, T, n), -jnp.inf))
      deltas.append(jnp.zeros((rows, T, n)))
      expected.append((jnp.zeros((rows, T, n, H)),) + (jnp.zeros((0, kh, H)),) * 2)
      continue
    state = _oracle(q[z], k[z, :length], v[z, :length], causal)
    lses.append(state.lse)
    deltas.append(jnp.sum(w[z] * state.out, axis=-1))
    loss = lambda q_, k_, v_: jnp.sum(_oracle(q_, k_, v_, causal).out * w[z])
    expected.append(jax.grad(loss, argnums=(0, 1, 2))(q[z], k[z, :length], v[z, :length]))
  args = (_fold(q, kh), k, v, _fold(w, kh), _fold(jnp.stack(lses), kh),
          _fold(jnp.stack(deltas), kh), jnp.asarray(lengths, jnp.int32))
  kw = dict(scale=H**-0.5, causal=(T, n // kh) if causal else None)
  got = kernel.segments_backward(*args, **kw, **BLOCKS, interpret=pltpu.InterpretParams())
  reference = kernel.segments_backward_reference(*args, **kw)
  for z, length in enumerate(lengths):
    for i, name in enumerate(('dq', 'dk', 'dv')):
      for source, result in (('kernel', got), ('reference', reference)):
        a = np.asarray(_unfold(result[0][z], rows) if i == 0 else result[i][z])
        if i:  # tokens past the length: exact zeros
          np.testing.assert_array_equal(a[length:], 0.0, err_msg=f'{source} {name} {z}')
          a = a[:length]
        np.testing.assert_allclose(a, expected[z][i], rtol=1e-5, atol=1e-5,
                                   err_msg=f'{source} {name}, item {z}')


def test_bad_inputs_are_named():
  q, k, v, lengths = _problem(_rng(), False, jnp.float32)
  args = (_fold(q), k, v)
  lengths = jnp.asarray(lengths, jnp.int32)
  with pytest.raises(ValueError, match=r'kv_lengths must be \[Z\] = \(3,\)'):
    kernel.segments_forward(*args, lengths[:2], scale=1.0)
  with pytest.raises(ValueError, match=r'causal must be \(T, G\) with T \* G = M = 12'):
    kernel.segments_forward(*args, lengths, scale=1.0, causal=(T, G))
  with pytest.raises(ValueError, match=r'k_cache must be \[Z=3, S, K=2, H=8\]'):
    kernel.segments_forward(args[0], k[:, :, :1], v, lengths, scale=1.0)
  lse = jnp.zeros(args[0].shape[:3])
  with pytest.raises(ValueError, match=r'lse must be \(3, 12, 2\)'):
    kernel.segments_backward(*args, args[0], lse[:, 1:], lse, lengths, scale=1.0)


# Interpret mode is slow on 2 cores (10-30 s a case): `make test` keeps these (conftest);
# --all-cases runs all.
representative_cases = {
    'test_forward_matches_oracle': ('causal-bfloat16', 'segments-bfloat16-mha', 'causal-float32-mqa'),
    'test_backward_matches_oracle_grad': ('segments-mqa',),
}
