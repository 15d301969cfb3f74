"""The greedy-agreement measures: first divergences, and the margin error only where a row still
follows the reference and names the same two leading tokens."""

import types

import numpy as np

from experiments import agreement_metrics as am


def _run(tokens, top_tokens, top_logprobs):
  return types.SimpleNamespace(tokens=np.array(tokens), top_tokens=np.array(top_tokens),
                               top_logprobs=np.array(top_logprobs, np.float32))


def test_first_divergences_and_margin_errors():
  ref = _run([[1, 2, 3], [4, 5, 6]],
             [[[1, 9], [2, 9], [3, 9]], [[4, 9], [5, 9], [6, 9]]],
             [[[-0.1, -2.0], [-0.2, -1.0], [-0.5, -0.6]], [[-0.1, -3.0], [-0.3, -0.4], [0, -1]]])
  # Row 0 follows the reference throughout; row 1 parts at position 1 (a near tie there: 0.1).
  out = _run([[1, 2, 3], [4, 9, 6]],
             [[[1, 9], [2, 9], [3, 9]], [[4, 9], [9, 5], [6, 9]]],
             [[[-0.1, -2.5], [-0.2, -1.0], [-0.5, -0.7]], [[-0.2, -3.0], [-0.3, -0.35], [0, -1]]])
  np.testing.assert_array_equal(am.first_divergences(out.tokens, ref.tokens), [-1, 1])
  fields, at = am.compare(out, ref, target=0.05)
  assert [a[:2] for a in at] == [(1, 1)] and abs(at[0][2] - 0.1) < 1e-6
  assert fields['identical'] == 1 and fields['divergences'] == 1 and fields['over_margin'] == 1
  # Positions before each row's divergence: row 0's three and row 1's first.
  assert fields['margin_error_positions'] == 4
  np.testing.assert_allclose(fields['margin_error_max'], 0.5, atol=1e-6)
  assert '| 1/2 | 1 | 1 | 0.100 |' in am.table([dict(impl='x', dtype='bf16', **fields)])


def test_a_row_that_never_parts_has_no_divergence_and_an_unsupported_record_a_row():
  ref = _run([[1]], [[[1, 2]]], [[[-0.1, -0.2]]])
  fields, at = am.compare(ref, ref, target=0.1)
  assert at == [] and fields['max_margin_at_divergence'] is None
  assert fields['margin_error_max'] == 0.0
  text = am.table([dict(impl='mosaic_gpu', dtype='float32', unsupported='no')])
  assert '| mosaic_gpu | float32 | not supported |' in text
