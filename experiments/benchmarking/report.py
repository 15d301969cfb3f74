"""Benchmark output: JSONL per point, markdown tables, plots, and a progress bar.

Every JSONL record carries the run's metadata (device, JAX version, command
line, UTC timestamp), so one line is enough to know where a number came from.
"""

import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def run_metadata() -> dict[str, Any]:
  """Where and how this run happens."""
  device = jax.devices()[0]
  meta = {
      'device': device.device_kind,
      'backend': jax.default_backend(),
      'device_count': jax.device_count(),
      'jax_version': jax.__version__,
      'jaxlib_version': _version('jaxlib'),
      'python': platform.python_version(),
      # orig_argv keeps `-m package.module` where argv[0] would be the module's file.
      'command': ' '.join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.orig_argv[1:]),
      'host': platform.node(),
  }
  # A copied working tree (a lent machine) may carry stale git metadata: the caller can say.
  if os.environ.get('HYDRAJAX_GIT_COMMIT'):
    meta['git_commit'] = os.environ['HYDRAJAX_GIT_COMMIT']
    return meta
  try:
    meta['git_commit'] = subprocess.run(
        ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, timeout=5
    ).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    meta['git_commit'] = None
  return meta


def _jsonable(x: Any) -> Any:
  if isinstance(x, float) and not math.isfinite(x):
    return None if math.isnan(x) else ('inf' if x > 0 else '-inf')
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, 'item') and callable(x.item):  # numpy / jax scalars
    return _jsonable(x.item())
  return x


class JsonlWriter:
  """Appends one JSON object per line to `path`, each with the run metadata under 'meta'."""

  def __init__(self, path: str, meta: dict[str, Any] | None = None):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.path = path
    self.meta = run_metadata() if meta is None else meta

  def append(self, record: dict[str, Any]) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')
    full = dict(record, timestamp=now, meta=self.meta)
    with open(self.path, 'a') as f:
      f.write(json.dumps(_jsonable(full), sort_keys=True) + '\n')
    return full


def fresh_jsonl(path: str, meta: dict[str, Any] | None = None) -> JsonlWriter:
  """A `JsonlWriter` on an empty `path` (an earlier run's file there is removed)."""
  if os.path.exists(path):
    os.remove(path)
  return JsonlWriter(path, meta)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def resume_records(path: str, keep: Callable[[dict[str, Any]], bool] | None) -> list[dict[str, Any]]:
  """An earlier run's records of `path` that a resumed sweep keeps (`keep` accepts them); they
  become the file's only lines, each with its own metadata. keep None (a fresh run) or no file:
  an empty file and no records."""
  records = [r for r in read_jsonl(path) if keep(r)] if keep and os.path.exists(path) else []
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    f.writelines(json.dumps(r, sort_keys=True) + '\n' for r in records)
  return records


def markdown_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str | Callable[[dict], Any]]]
) -> str:
  """A markdown table: one line per row; columns are (header, key or function of the row)."""
  def cell(row, getter):
    value = getter(row) if callable(getter) else row.get(getter)
    if value is None:
      return ''
    if isinstance(value, float):
      return f'{value:.3g}' if abs(value) < 1000 else f'{value:.0f}'
    return str(value).replace('|', '\\|')

  lines = [
      '| ' + ' | '.join(h for h, _ in columns) + ' |',
      '|' + '---|' * len(columns),
  ]
  lines += ['| ' + ' | '.join(cell(r, g) for _, g in columns) + ' |' for r in rows]
  return '\n'.join(lines) + '\n'


def plot_sweeps(
    records: Sequence[dict[str, Any]],
    *,
    x: str,
    y: str,
    series: str,
    fixed: Sequence[str],
    path: str,
    title: str = '',
    ylabel: str = '',
    logy: bool = True,
) -> bool:
  """One panel per setting of `fixed` keys in which `x` takes >= 2 values.

  Lines are the values of `series`. Returns False (and writes nothing) when the
  records hold no such sweep.
  """
  import matplotlib  # imported here: only plotting needs it
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  panels: dict[tuple, list[dict]] = {}
  for r in records:
    if r.get(y) is None or r.get(x) is None:
      continue
    panels.setdefault(tuple(r.get(k) for k in fixed), []).append(r)
  panels = {k: v for k, v in panels.items() if len({r[x] for r in v}) >= 2}
  if not panels:
    return False
  cols = min(3, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
  for ax, (key, recs) in zip(axes.flat, sorted(panels.items(), key=lambda kv: str(kv[0]))):
    by_series: dict[Any, list[dict]] = {}
    for r in recs:
      by_series.setdefault(r.get(series), []).append(r)
    for name, rs in sorted(by_series.items(), key=lambda kv: str(kv[0])):
      rs = sorted(rs, key=lambda r: r[x])
      ax.plot([r[x] for r in rs], [r[y] for r in rs], marker='o', label=str(name))
    ax.set_xscale('log', base=2)
    if logy:
      ax.set_yscale('log')
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(', '.join(f'{k}={v}' for k, v in zip(fixed, key)), fontsize=8)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis('off')
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def plot_bars(
    labels: Sequence[str],
    values: dict[str, Sequence[float | None]],
    *,
    path: str,
    ylabel: str,
    title: str = '',
    logy: bool = True,
    hline: float | None = None,
) -> None:
  """Grouped bars: one group per label, one bar per key of `values` (None = missing)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  n = max(1, len(values))
  width = 0.8 / n
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) * max(1, n / 3)), 4.5))
  for i, (name, vals) in enumerate(values.items()):
    xs = [j + i * width for j, v in enumerate(vals) if v is not None and v > 0]
    ys = [v for v in vals if v is not None and v > 0]
    ax.bar(xs, ys, width, label=name, color=plt.cm.tab20(i % 20))
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
  ax.set_xticklabels(labels, rotation=30, ha='right', fontsize=7)
  if logy:
    ax.set_yscale('log')
  if hline is not None:
    ax.axhline(hline, color='k', lw=0.8)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  ax.legend(fontsize=7)
  ax.grid(True, axis='y', which='both', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_workdir_readme(workdir: str, title: str, body: str = '',
                         meta: dict[str, Any] | None = None) -> str:
  """Writes `workdir`/README.md: what ran (the command, the commit, the machine), `body` (e.g.
  the run's table, its own `# ` title line dropped) and the files beside it. Returns its path."""
  meta = run_metadata() if meta is None else meta
  if body.startswith('# '):  # a table file's own title: the README has one
    body = body.split('\n', 1)[1] if '\n' in body else ''
  files = sorted(f for f in os.listdir(workdir) if f != 'README.md') if os.path.isdir(workdir) else []
  text = (f'# {title}\n\ncommand: `{meta.get("command")}`\n\n'
          f'commit: {meta.get("git_commit")}; machine: {meta.get("host")}, {meta.get("device")} '
          f'({meta.get("backend")}), jax {meta.get("jax_version")}\n\n'
          + (body.rstrip() + '\n\n' if body else '')
          + ('files: ' + ', '.join(f'`{f}`' for f in files) + '\n' if files else ''))
  path = os.path.join(workdir, 'README.md')
  os.makedirs(workdir, exist_ok=True)
  with open(path, 'w') as f:
    f.write(text)
  return path


class _NoBar:
  def update(self, n: int = 1) -> None:
    del n

  def close(self) -> None:
    pass


def progress_counter(*, total: int | None = None, desc: str = ''):
  """A tqdm bar on stderr counted by hand (`update()` after each point, `close()` at the end),
  for sweeps whose points are not one loop (total None: a count without an end)."""
  try:
    from tqdm import tqdm
  except ImportError:
    return _NoBar()
  return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)


def progress(items: Iterable[Any], *, total: int | None = None, desc: str = '') -> Iterator[Any]:
  """A tqdm bar on stderr for long sweeps (plain iteration when tqdm is absent)."""
  try:
    from tqdm import tqdm
  except ImportError:
    yield from items
    return
  yield from tqdm(items, total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)
