"""Plans and device layouts of a chunk cache, and the cache of the decode layout's arrays.

A decode step attends over every live row: its segment groups change only
with the tree's structure and its page table only when a page is added, so
`LayoutCache` keeps both on the device keyed on the cache's versions and
uploads only the private lengths on every call. A subset of rows (a prefill
batch) is built afresh.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hydrajax.chunk_cache.row_order import RowArrays
from hydrajax.layout import LayoutPolicy, device_groups, make_layout, page_table
from hydrajax.layout import Segment, SharingPlan, TreeLayout


def no_empty_groups(policy: LayoutPolicy, share_prefixes: bool) -> LayoutPolicy:
  """Without sharing there is never a segment: no (empty) fixed-shape segment group either,
  so attention takes the plain paged path instead of merging empty shared states."""
  if share_prefixes or not policy.fixed_shapes:
    return policy
  return dataclasses.replace(policy, fixed_shapes=False)


def build_plan(arrays: RowArrays, rows: list[int], segments: tuple[Segment, ...], num_rows: int,
               chunk_size: int, kv_tokens: int) -> SharingPlan:
  """The plan of `rows` (global rows, in order) over their `segments`, padded to `num_rows`."""
  npages = arrays.npages[rows].tolist()
  pages = [tuple(p[:k]) for p, k in zip(arrays.pages[rows].tolist(), npages)]
  lengths = (arrays.lengths[rows] - arrays.shared[rows]).tolist()
  pad = num_rows - len(rows)
  return SharingPlan(
      num_rows, segments, chunk_size, tuple(pages) + ((),) * pad,
      tuple(lengths) + (0,) * pad, kv_tokens,
  )


def plan_layout(plan: SharingPlan, policy: LayoutPolicy, max_pages: int) -> TreeLayout:
  """A plan on the device, uncached; the page table is `policy.page_width` of the widest row."""
  width = policy.page_width(max(len(p) for p in plan.private_pages), max_pages)
  return make_layout(
      *device_groups(plan, policy), jnp.asarray(page_table(plan, width)),
      jnp.asarray(np.array(plan.private_lengths, np.int32)), plan.page_size,
  )


class LayoutCache:
  """The device arrays of the layout of all rows, keyed on the tree's versions."""

  def __init__(self):
    self.entries: dict[str, tuple] = {}  # 'groups' and 'pages': (key, device arrays)

  def clear(self) -> None:
    self.entries.clear()

  def layout(
      self,
      arrays: RowArrays,
      live_rows: int,
      num_rows: int,
      segments: Callable[[], tuple[Segment, ...]],
      policy: LayoutPolicy,
      *,
      chunk_size: int,
      kv_tokens: int,
      max_pages: int,
      structure_version: int,
      pages_version: int,
  ) -> TreeLayout:
    """The layout of the first `live_rows` rows of `arrays`, padded to `num_rows`.

    `segments` (the shared segments of all rows) is called only when the structure changed.
    """
    b, c = live_rows, chunk_size
    key = (structure_version, num_rows)
    cached = self.entries.get('groups')
    if cached is None or cached[0] != key:  # the groups need only the segments of the plan
      plan = SharingPlan(num_rows, segments(), c, ((),) * num_rows, (0,) * num_rows, kv_tokens)
      cached = (key, device_groups(plan, policy))
      self.entries['groups'] = cached
    pkey = (structure_version, pages_version, num_rows)
    pages = self.entries.get('pages')
    if pages is None or pages[0] != pkey:
      width = policy.page_width(int(arrays.npages[:b].max(initial=0)), max_pages)
      table = np.zeros((num_rows, width), np.int32)
      table[:b] = arrays.pages[:b, :width]
      pages = (pkey, jnp.asarray(table))
      self.entries['pages'] = pages
    lengths = np.zeros(num_rows, np.int32)
    lengths[:b] = arrays.lengths[:b] - arrays.shared[:b]
    return make_layout(*cached[1], pages[1], jnp.asarray(lengths), c)
