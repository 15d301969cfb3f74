"""hydrajax: exact shared-prefix attention (Hydragen, ChunkAttention) in JAX."""
from hydrajax.attention import (
    AttentionFallbackWarning, AttentionImpl, AttentionPlan, XlaConfig, attend, merge_along_paths,
    merge_into_rows, path_item_index, prepare_attention, resolve, sum_along_paths, tree_attention,
    tree_attention_sharded, tree_attention_xla,
)
from hydrajax.builders import PromptNode, TokenPlan, plan_from_tokens, plan_tree
from hydrajax.layout import (
    LayoutPolicy, Segment, SegmentGroup, SharingPlan, TreeLayout, bucket_size,
)
from hydrajax.partial_state import PartialState, empty_state, merge, merge_many
from hydrajax.reference import naive_attention, naive_tree_attention
from hydrajax.render import render_plan
from hydrajax.shapes import AttentionShapes
from hydrajax.sharing_policy import SharingPolicy, demote

__version__ = '0.1.0'

__all__ = [
    'AttentionFallbackWarning',
    'AttentionImpl',
    'AttentionPlan',
    'AttentionShapes',
    'LayoutPolicy',
    'PartialState',
    'PromptNode',
    'Segment',
    'SegmentGroup',
    'SharingPlan',
    'SharingPolicy',
    'TokenPlan',
    'TreeLayout',
    'XlaConfig',
    'attend',
    'bucket_size',
    'demote',
    'empty_state',
    'merge',
    'merge_along_paths',
    'merge_into_rows',
    'path_item_index',
    'sum_along_paths',
    'merge_many',
    'naive_attention',
    'naive_tree_attention',
    'plan_from_tokens',
    'plan_tree',
    'prepare_attention',
    'render_plan',
    'resolve',
    'tree_attention',
    'tree_attention_sharded',
    'tree_attention_xla',
]
