"""pass@k, the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models
Trained on Code": with n samples of which c pass,

  pass@k = 1 - C(n - c, k) / C(n, k)

the probability that at least one of k samples drawn without replacement from the n passes;
computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i) for numerical stability.
"""

from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem with n samples, c of them correct."""
  if not 0 <= c <= n:
    raise ValueError(f'need 0 <= c <= n, got c={c}, n={n}')
  if not 1 <= k <= n:
    raise ValueError(f'k must be in [1, n={n}], got {k}')
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float | None:
  """Mean pass@k over problems given (n, c) per problem; problems with n < k are left out."""
  values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
  return float(np.mean(values)) if values else None
