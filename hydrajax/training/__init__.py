"""Training-side hydrajax: differentiable tree attention (prepared once per batch layout, or in
one call) and the causal prefill layout."""

from hydrajax.training.prefill_layout import (
    PrefillAttentionPlan,
    PrefillLayout,
    PrefillPlan,
    attend_prefill,
    plan_prefill,
    prefill_attention,
    prepare_prefill_attention,
    unshared_sequences,
    write_kv,
)
from hydrajax.training.training_plan import (
    TrainingAttentionPlan,
    attend_differentiable,
    prepare_training_attention,
    resolve_training,
    training_unsupported_reason,
    tree_attention_differentiable,
)
from hydrajax.training.costs import training_attention_cost
