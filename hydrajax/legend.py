"""The dimension legend: one capital letter per dimension, used everywhere.

Einsum strings and shape comments in hydrajax use these letters:

  B  batch: query rows, one per decoding sequence, depth-first order of the sharing tree
  T  query tokens per row (1 when decoding, > 1 when a chunk of tokens is appended at once)
  S  kv tokens
  P  shared-prefix tokens
  N  query heads
  K  kv heads
  G  query heads per kv head (N // K): 1 is MHA, N is MQA, anything between is GQA
  H  head dim
  D  model dim
  F  MLP hidden dim
  V  vocabulary
  C  chunk (page) size, in tokens
  L  tokens in a flat KV buffer (a chunk pool is [L // C, C, K, H] viewed as [L, K, H])
  J  shared segments
  R  query rows covered by one segment (a segment's static row capacity)
"""

