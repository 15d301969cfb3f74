"""Tree attention, the op: one home for its inference and training paths.

  dispatch  AttentionImpl, the registry of backends (`IMPLEMENTATIONS`, `TRAINING_KERNELS`) and
            the one resolver (`resolve_backend`, `resolve_training`)
  plan      prepare_attention -> AttentionPlan -> attend; tree_attention in one call
  xla       the XLA backend (Hydragen's algorithm in jnp), the reference of the kernels
  parallel  tree attention over a mesh (data and tensor parallel), the mesh axes
  training  the differentiable path (custom VJPs) and the causal prefill layouts

The kernels live in `pallas_kernels` (below this package); the layout, the partial state and
the input checks in the base modules of `hydrajax` (below both).
"""

from hydrajax.attention.dispatch import (
    IMPLEMENTATIONS, TRAINING_KERNELS, AttentionFallbackWarning, AttentionImpl, resolve,
    resolve_backend, resolve_training, training_unsupported_reason,
)
from hydrajax.attention.parallel import tree_attention_sharded
from hydrajax.attention.plan import (
    AttentionPlan, attend, prepare_attention, tree_attention, tree_attention_xla,
)
from hydrajax.attention.xla import (
    XlaConfig, merge_along_paths, merge_into_rows, path_item_index, sum_along_paths,
)
