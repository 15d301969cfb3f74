"""The differentiable side of tree attention: tree attention with a custom VJP (prepared once
per batch layout, or in one call), the causal prefill layout (prompts and completions) and its
any-depth form, the causal prefill of a token tree (rollout trees)."""

from hydrajax.attention.training.prefill_layout import (
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
from hydrajax.attention.training.training_plan import (
    TrainingAttentionPlan,
    attend_differentiable,
    prepare_training_attention,
    tree_attention_differentiable,
)
from hydrajax.attention.training.tree_prefill import (
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
