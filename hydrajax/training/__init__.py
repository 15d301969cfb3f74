"""Training-side hydrajax: differentiable tree attention and the causal prefill layout."""

from hydrajax.training.tree_attention_vjp import tree_attention_differentiable
