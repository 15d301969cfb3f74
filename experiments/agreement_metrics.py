"""How a decoding's greedy tokens agree with a reference's, with numpy alone: the measures of
`experiments.real_model_agreement`, shared with its transformers peer
(`experiments/baselines/transformers_agreement.py`, which runs where jax is not installed).

`out` and `ref` are anything with `tokens` [R, M] and `top_tokens`, `top_logprobs` [R, M, >= 2]
(the top-2 of every generated position).
"""

import numpy as np


def first_divergences(tokens: np.ndarray, reference: np.ndarray) -> np.ndarray:
  """[R] the first position where a row differs from the reference, or -1."""
  differs = tokens != reference
  return np.where(differs.any(axis=1), differs.argmax(axis=1), -1)


def margin_errors(out, ref, first: np.ndarray) -> np.ndarray:
  """|top-1 minus top-2 log-prob, against the reference's| at every position where a row still
  follows the reference (before its first divergence) and names the same two tokens there.

  Those positions see the reference's own context, so this is the implementation's error in the
  quantity a greedy choice rests on: a choice flips where it exceeds the reference's margin."""
  m = ref.tokens.shape[1]
  before = np.arange(m)[None, :] < np.where(first < 0, m, first)[:, None]
  same = np.all(out.top_tokens[..., :2] == ref.top_tokens[..., :2], axis=-1)
  got = out.top_logprobs[..., 0] - out.top_logprobs[..., 1]
  want = ref.top_logprobs[..., 0] - ref.top_logprobs[..., 1]
  return np.abs(got - want)[before & same]


def compare(out, ref, target: float) -> tuple[dict, list[tuple[int, int, float]]]:
  """(a record's agreement fields, each first divergence as (row, position, reference margin)).

  A divergence counts against the target where the reference's margin there exceeds `target`."""
  margin = ref.top_logprobs[..., 0] - ref.top_logprobs[..., 1]
  first = first_divergences(out.tokens, ref.tokens)
  at = [(r, int(i), float(margin[r, i])) for r, i in enumerate(first) if i >= 0]
  errors = margin_errors(out, ref, first)
  stat = lambda f: float(f(errors)) if errors.size else None
  return dict(
      sequences=len(first), tokens=int(ref.tokens.shape[1]), identical=int((first < 0).sum()),
      divergences=len(at), over_margin=sum(m > target for _, _, m in at), margin=target,
      max_margin_at_divergence=max((m for _, _, m in at), default=None),
      margin_error_positions=int(errors.size), margin_error_median=stat(np.median),
      margin_error_p99=stat(lambda e: np.quantile(e, 0.99)), margin_error_max=stat(np.max),
  ), at


def table(records) -> str:
  """The markdown table of agreement records (an `unsupported` record: a row saying so)."""
  lines = ['| impl | dtype | identical | diverge | margin > target | largest margin at a divergence '
           '| margin error: median / p99 / max (positions) |',
           '| --- | --- | --- | --- | --- | --- | --- |']
  for r in records:
    if 'unsupported' in r:
      lines.append(f"| {r['impl']} | {r['dtype']} | not supported | - | - | - | - |")
      continue
    largest = r['max_margin_at_divergence']
    error = ('-' if r['margin_error_max'] is None else
             f"{r['margin_error_median']:.4f} / {r['margin_error_p99']:.4f} / "
             f"{r['margin_error_max']:.4f} ({r['margin_error_positions']})")
    lines.append(f"| {r['impl']} | {r['dtype']} | {r['identical']}/{r['sequences']} | "
                 f"{r['divergences']} | {r['over_margin']} | "
                 f"{'-' if largest is None else f'{largest:.3f}'} | {error} |")
  return '\n'.join(lines) + '\n'
