"""Training-side hydrajax: differentiable tree attention and the causal prefill layout."""

from hydrajax.training.prefill_layout import (
    PrefillLayout,
    PrefillPlan,
    plan_prefill,
    prefill_attention,
    unshared_sequences,
    write_kv,
)
from hydrajax.training.tree_attention_vjp import tree_attention_differentiable
from hydrajax.training.costs import training_attention_cost
