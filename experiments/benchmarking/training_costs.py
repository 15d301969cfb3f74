"""Roofline costs of training attention (forward + backward) over prompt groups.

Counts for Bp prompts of P tokens, each with G completions of T tokens, N query
heads, K kv heads, head dim H (every prompt at full length):

* shared: each prompt causal over itself once; each completion's T queries over
  its prompt (read once per group) and causally over itself.
* per-sequence: every sample's own sequence of P + T tokens, all of it as
  queries, causal (the prompt recomputed per sample, as an unshared model does).

FLOPs: the forward is 2 matmuls over the visible (query, key) pairs; a backward
without recomputation is 4 more, so the floor counts 6 (flash attention runs 7:
it recomputes QK^T). Bytes: each of q, k, v, out read or written once in the
forward; q, k, v, out, dout read and dq, dk, dv written once in the backward.
"""

from experiments.benchmarking.roofline import Cost

MATMULS_FWD_BWD = 6


def _causal_pairs(queries: int, keys_before: int) -> int:
  """(query, key) pairs when `queries` causal queries follow `keys_before` visible keys."""
  return queries * keys_before + queries * (queries + 1) // 2


def training_attention_cost(num_prompts: int, group_size: int, prompt: int, completion: int,
                            num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                            shared: bool, dtype_bytes: int = 2) -> Cost:
  """Minimum bytes and FLOPs of attention forward + backward; see the module docstring."""
  for name, x in (('num_prompts', num_prompts), ('group_size', group_size), ('prompt', prompt),
                  ('completion', completion), ('head_dim', head_dim)):
    if x < 1:
      raise ValueError(f'{name} must be >= 1, got {x}')
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f'num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads '
                     f'({num_kv_heads})')
  samples = num_prompts * group_size
  if shared:
    pairs = num_prompts * _causal_pairs(prompt, 0) + samples * _causal_pairs(completion, prompt)
    q_tokens = num_prompts * prompt + samples * completion
  else:
    pairs = samples * _causal_pairs(prompt + completion, 0)
    q_tokens = samples * (prompt + completion)
  return _cost(pairs, q_tokens, num_q_heads, num_kv_heads, head_dim, dtype_bytes)


def tree_prefill_cost(plan, num_q_heads: int, num_kv_heads: int, head_dim: int, *, shared: bool,
                      dtype_bytes: int = 2) -> Cost:
  """Minimum bytes and FLOPs of a token tree's attention forward + backward (`tree_prefill`).

  shared: each node's real tokens are queries once, over its ancestors' real tokens and
  causally over themselves. Per-sequence: every root-to-leaf path as its own causal sequence
  (the ancestors recomputed per leaf, as an unshared model does). plan: a `TreePrefillPlan`.
  """
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f'num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads '
                     f'({num_kv_heads})')
  if shared:
    runs = [(n, before) for n, before in zip(plan.lengths, plan.offsets)]
  else:
    runs = [(plan.offsets[x] + plan.lengths[x], 0) for x in plan.leaves]
  pairs = sum(_causal_pairs(n, before) for n, before in runs)
  q_tokens = sum(n for n, _ in runs)
  return _cost(pairs, q_tokens, num_q_heads, num_kv_heads, head_dim, dtype_bytes)


def _cost(pairs, q_tokens, num_q_heads, num_kv_heads, head_dim, dtype_bytes) -> Cost:
  kv_tokens = q_tokens  # every token has its own key and value in both forms
  q_bytes = q_tokens * num_q_heads * head_dim * dtype_bytes
  kv_bytes = kv_tokens * 2 * num_kv_heads * head_dim * dtype_bytes
  # forward: q, k, v, out; backward: q, k, v, out, dout, dq, dk, dv.
  bytes_ = 2 * q_bytes + kv_bytes + 4 * q_bytes + 2 * kv_bytes
  flops = MATMULS_FWD_BWD * 2 * num_q_heads * head_dim * pairs
  return Cost(float(bytes_), float(flops))
