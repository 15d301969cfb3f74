"""hydrajax: exact shared-prefix attention (Hydragen, ChunkAttention) in JAX."""

from hydrajax.builders import PromptNode, TokenPlan, plan_from_tokens, plan_tree
from hydrajax.dispatch import AttentionImpl, resolve, tree_attention
from hydrajax.layout import Segment, SegmentGroup, SharingPlan, TreeLayout, bucket_size
from hydrajax.parallel import tree_attention_sharded
from hydrajax.partial_state import PartialState, empty_state, merge, merge_many
from hydrajax.reference import naive_attention, naive_tree_attention
from hydrajax.render import render_plan
from hydrajax.sharing_policy import SharingPolicy, demote
from hydrajax.tree_attention import merge_into_rows, tree_attention_xla

__version__ = '0.1.0'
