"""Implementations the microbenchmark times: hydrajax's and its peers (benchmark-only code).

This is the only place where JAX's deprecated Pallas GPU ops and PyTorch are
imported, lazily inside the builders, so this package imports without them.
"""

from experiments.baselines.common import Candidate, Options, Unsupported
from experiments.baselines.jax_impls import IMPLEMENTATIONS as JAX_IMPLEMENTATIONS
from experiments.baselines.torch_peer import IMPLEMENTATIONS as TORCH_IMPLEMENTATIONS
from experiments.baselines.torch_peer import copy_bandwidth as torch_copy_bandwidth

# hydrajax's own first; the rest are baselines.
IMPLEMENTATIONS = {**JAX_IMPLEMENTATIONS, **TORCH_IMPLEMENTATIONS}
HYDRAJAX = ('mosaic_gpu', 'xla_tree')
