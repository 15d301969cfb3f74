"""The engine's one jitted model call: write the new tokens' KV, sample the next ones."""

import jax
import jax.numpy as jnp
from flax import nnx

from hydrajax import AttentionPlan
from hydrajax.attention.parallel import ShardedLayout
from models.kv_cache import CACHE_PROGRAM_OPTIONS
from models.sampling import SamplingRows, request_keys, sample_batch


def model_step(graphdef, treedef, params, cache, tokens, positions, slots, layout, seeds, streams,
               indices, rows: SamplingRows, sample_rows=None, feed=None, *, impl,
               top_logprobs: int):
  """One model call: writes the new tokens' KV, samples next tokens from last positions.

  tokens, positions, slots [B, T]; one token is sampled per row, or with
  `sample_rows` [S] one per entry, from that row's logits. seeds [S] uint32,
  streams [S], indices [S] make each entry's key (`request_keys`); `rows` are
  the entries' sampling parameters. `layout` is a TreeLayout (the model
  prepares its attention plan in the call) or an AttentionPlan prepared on the
  host once per tree change (decode steps). `params` are the model's state leaves
  (`treedef` rebuilds the state). `feed` = (previous tokens [B], src [B])
  replaces the tokens of rows with src >= 0. Returns (`Sampled` of [S], cache).
  """
  if feed is not None:  # rows with src >= 0 take the previous step's token, still on the device
    previous, src = feed
    tokens = jnp.where(src[:, None] >= 0, previous[jnp.maximum(src, 0)][:, None], tokens)
  model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
  h, cache = model.forward_hidden(tokens, positions, cache, slots, layout, impl=impl)
  logits = model.logits(h[:, -1])  # [B, V]
  if sample_rows is not None:
    logits = logits[sample_rows]
  keys = request_keys(seeds, streams, indices)
  return sample_batch(logits, keys, rows, top_logprobs=top_logprobs), cache


def compiler_options(platform: str, *, command_buffers: bool) -> dict:
  """XLA compile options of the model step on `platform`: those of every program over a KV
  cache (`CACHE_PROGRAM_OPTIONS`), and `EngineConfig.command_buffers` False turns XLA's CUDA
  graphs off on a GPU (other platforms have none)."""
  if platform != 'gpu' or command_buffers:
    return dict(CACHE_PROGRAM_OPTIONS)
  return {**CACHE_PROGRAM_OPTIONS, 'xla_gpu_enable_command_buffer': ''}


def segment_slots(layout) -> int:
  """J of a layout (or of a plan's, or of per-dp-shard ones stacked) made with fixed shapes
  (0: no segment group)."""
  if isinstance(layout, ShardedLayout):
    layout = layout.layouts
  if isinstance(layout, AttentionPlan):
    layout = layout.layout
  return int(layout.groups[0].kv_start.shape[-1]) if layout.groups else 0
