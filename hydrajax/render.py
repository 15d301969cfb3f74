"""A readable text rendering of a sharing plan."""

from hydrajax.layout import SharingPlan


def _rows(begin: int, end: int) -> str:
  return f'row {begin}' if end - begin == 1 else f'rows {begin}-{end - 1} ({end - begin})'


def render_plan(plan: SharingPlan, *, max_children: int = 6) -> str:
  """Draws the segment tree, one line per segment; long sibling lists are elided."""
  if not isinstance(plan, SharingPlan):
    raise ValueError(f'plan must be a SharingPlan (the host plan, not its device layout), got '
                     f'{type(plan).__name__}')
  children: dict[int, list[int]] = {}
  for j, s in enumerate(plan.segments):
    children.setdefault(s.parent, []).append(j)
  shared = plan.shared_tokens()
  private = sum(plan.private_lengths)
  unshared = plan.unshared_tokens()
  lines = [
      f'{plan.num_rows} rows, {len(plan.segments)} shared segments; KV tokens stored: '
      f'{shared + private:,} with sharing vs {unshared:,} without '
      f'({unshared / max(1, shared + private):.1f}x)'
  ]

  def draw(j: int, prefix: str, last: bool) -> None:
    s = plan.segments[j]
    lines.append(
        f'{prefix}{"└─ " if last else "├─ "}{s.label or j}: {s.kv_length:,} tokens, {_rows(s.row_begin, s.row_end)}'
    )
    kids = children.get(j, [])
    shown = kids if len(kids) <= max_children else kids[: max_children - 1]
    inner = prefix + ('   ' if last else '│  ')
    for i, c in enumerate(shown):
      draw(c, inner, i == len(kids) - 1)
    if len(shown) < len(kids):
      lines.append(f'{inner}└─ ... {len(kids) - len(shown)} more like these')

  roots = children.get(-1, [])
  for i, j in enumerate(roots[:max_children]):
    draw(j, '', i == len(roots) - 1 and len(roots) <= max_children)
  if len(roots) > max_children:
    lines.append(f'└─ ... {len(roots) - max_children} more trees')
  lengths = plan.private_lengths
  lines.append(
      f'private: {private:,} tokens in pages of {plan.page_size} '
      f'(per row {min(lengths)}..{max(lengths)})'
  )
  return '\n'.join(lines)
