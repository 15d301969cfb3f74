"""Training-side hydrajax: differentiable tree attention (prepared once per batch layout, or in
one call), the causal prefill layout (prompts and completions) and its any-depth form, the
causal prefill of a token tree (rollout trees)."""

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
from hydrajax.training.tree_prefill import (
    TreePrefillAttentionPlan,
    TreePrefillLayout,
    TreePrefillPlan,
    attend_tree_prefill,
    path_sequences,
    plan_rollout_tree,
    plan_tree_prefill,
    prepare_tree_prefill,
    tree_levels,
    tree_prefill_attention,
    write_tree_kv,
)
from hydrajax.training.costs import training_attention_cost, tree_prefill_cost
