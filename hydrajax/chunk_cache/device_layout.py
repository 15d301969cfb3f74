"""From a chunk-cache `SharingPlan` to a `TreeLayout` with few distinct static shapes.

The conversion and its policy live in `hydrajax.layout` (`LayoutPolicy`, `build_layout`,
`SharingPlan.to_device(policy=...)`): one conversion for `generate`, the chunk cache, the
engine and the experiments. This module keeps the chunk cache's names for them.
"""

from hydrajax.layout import (  # noqa: F401 (re-exported)
    LayoutPolicy, SharingPlan, TreeLayout, build_layout, device_groups, group_arrays, make_layout,
    next_power_of_two, page_table, segment_pieces,
)


def device_layout(
    plan: SharingPlan,
    *,
    policy: LayoutPolicy = LayoutPolicy(),
    max_private_pages: int | None = None,
) -> TreeLayout:
  """`plan.to_device(policy=policy, max_private_pages=...)`."""
  return build_layout(plan, policy, max_private_pages=max_private_pages)
