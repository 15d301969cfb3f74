"""Candidate block sizes of the Mosaic TPU tree-attention kernels, compiled for each TPU generation.

No TPU is needed and none is timed: libtpu's compiler runs deviceless
(`pallas_kernels.tpu.aot`). For each generation (one chip of v5e:1x1, v5p:2x2x1, v6e:1x1) this
compiles `hj.tree_attention(impl='mosaic_tpu', config=candidate)` at the shapes of
`experiments/tpu_aot.py` (decode: B rows under one P-token prefix, 32/8 heads, head dim 128 and
64; and a prefill-like call of T query tokens per row) for a few candidate `BlockSizes`, and
records per (generation, candidate, shape): whether it compiled (else the kernel's or the
compiler's error), the scoped VMEM it asked for and `plan()`'s VMEM estimate, the grid steps of
both kernels, the compiler's `memory_analysis` and `cost_analysis` figures and the roofline of
those (`aot.stats`), with the MXU time of the attention's FLOPs on the chip's peak.

The chosen entry per generation (`pallas_kernels/tpu/block_sizes.py`) is the candidate that
compiled at every shape (and whose blocks pass the kernel's VMEM check in float32 and at full
size too, by `plan()`'s estimate) with the fewest grid steps in all, fewer VMEM bytes breaking
a tie, and whose float32 compile of the H=64 decode call succeeds (tried best first until one does):
a step's fixed pipeline cost is what the roofline does not see, and the compiler accepting
the VMEM the blocks need is what can be checked without a chip.

    JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 PYTHONPATH=.:.libtpu python -m \
      experiments.tpu_block_sizes --workdir=workdir/tpu_block_sizes
"""

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
from absl import app, flags, logging

import hydrajax as hj
from experiments import cli
from experiments.benchmarking import report
from experiments.tpu_programs import decode_plan, tree_attention_kernels
from pallas_kernels.tpu import aot
from pallas_kernels.tpu import tree_attention as tpu
from pallas_kernels.tpu.block_sizes import BLOCK_SIZES_BY_GENERATION, BlockSizes

matplotlib.use('Agg')
MiB = 2**20
TOPOLOGY = {'v5e': 'v5e:1x1', 'v5p': 'v5p:2x2x1', 'v6e': 'v6e:1x1'}  # one chip each
TENSOR_CORES = {'v5e': 1, 'v5p': 2, 'v6e': 1}
VMEM_PER_CORE = {'v5e': 128 * MiB, 'v5p': 64 * MiB, 'v6e': 128 * MiB}
STEP_SECONDS = 0.35e-6  # per-grid-step pipeline cost usually quoted for Pallas TPU (ROOFLINE.md)
# The shared kernel's candidates (the private kernel keeps its defaults: at these shapes it is
# bandwidth-bound and its blocks are capped by the unroll bound, see `tree_attention.plan`).
CANDIDATES = {
    'fallback': {},
    'kv2048': dict(block_kv=2048),
    'lanes512': dict(lanes_per_block=512),
    'lanes512_kv2048': dict(lanes_per_block=512, block_kv=2048),
    'rows2048_kv2048': dict(block_rows=2048, block_kv=2048),
}

_WORKDIR = cli.workdir_flag('tpu_block_sizes', 'where results.jsonl, table.md, the plot go')
_GENERATIONS = flags.DEFINE_list('generations', list(TOPOLOGY), 'TPU generations')
_CANDIDATES = flags.DEFINE_list('candidates', list(CANDIDATES), 'candidate block sizes')
_BATCH = flags.DEFINE_integer('batch', 256, 'decode rows (sharing one prefix)')
_PREFIX = flags.DEFINE_integer('prefix', 16384, 'shared prefix tokens of the decode batch')
_PREFILL = flags.DEFINE_list('prefill', ['8', '2048', '128'],
                             'the prefill-like call: rows, shared prefix, query tokens per row')
_RESUME = flags.DEFINE_bool('resume', False, 'keep the rows of results.jsonl in --workdir and '
                            'compile only the (generation, candidate, shape) it lacks')
cli.choices('generations', TOPOLOGY)
cli.choices('candidates', CANDIDATES)
cli.int_list('prefill')
cli.at_least(1, 'batch', 'prefix')


def scoped_vmem_limit(generation: str) -> int:
  """The scoped VMEM a candidate asks for (and its blocks' VMEM budget), leaving Mosaic's
  internal scratch room: 96 MiB of v5e's and v6e's 128 MiB per TensorCore, 56 MiB of v5p's 64."""
  return {128 * MiB: 96 * MiB, 64 * MiB: 56 * MiB}[VMEM_PER_CORE[generation]]


def candidate(generation: str, name: str) -> BlockSizes:
  """Today's defaults ('fallback'), or a candidate with one core split per TensorCore (a
  single-core chip gains nothing from a split but no-op steps) and the chip's VMEM limit."""
  if name == 'fallback':
    return BlockSizes()
  return BlockSizes(core_splits=TENSOR_CORES[generation],
                    vmem_limit_bytes=scoped_vmem_limit(generation), **CANDIDATES[name])


def shapes() -> dict[str, dict]:
  """The calls compiled for every candidate: decode at H=128 and H=64, and prefill."""
  decode = dict(batch=_BATCH.value, prefix=_PREFIX.value, heads=32, kv_heads=8)
  rows, prefix, tokens = (int(v) for v in _PREFILL.value)
  return {
      f'decode B={_BATCH.value} P={_PREFIX.value} 32/8 H=128': dict(decode, head_dim=128),
      f'decode B={_BATCH.value} P={_PREFIX.value} 32/8 H=64': dict(decode, head_dim=64),
      f'prefill B={rows} P={prefix} T={tokens} 32/8 H=128': dict(
          batch=rows, prefix=prefix, heads=32, kv_heads=8, head_dim=128, query_tokens=tokens),
  }


def float32_check_shape() -> tuple[str, dict]:
  """The call whose VMEM `plan()` underestimates most (packed H=64 heads), in float32 (twice
  the bytes of q, K, V and the output): compiled for the best candidates until one passes."""
  name, shape = list(shapes().items())[1]
  return f'{name} float32 (check)', dict(shape, dtype=jnp.float32)


def plan_figures(shape: dict, block_sizes: BlockSizes) -> dict:
  """`tree_attention.plan()`'s tiling of a call: effective blocks, grid steps, VMEM."""
  t = shape.get('query_tokens', 1)
  sharing = decode_plan(shape['batch'], shape['prefix'], private=max(16, t))
  layout = sharing.to_device()
  h, k = shape['head_dim'], shape['kv_heads']
  p = tpu.plan((sharing.num_rows, t, shape['heads'], h), shape.get('dtype', jnp.bfloat16),
               (sharing.kv_tokens, k, h), layout, block_sizes)
  width = layout.private_pages.shape[1]
  shared_steps = p.num_splits * (k // p.heads_per_block) * p.num_items if layout.groups else 0
  private_steps = ((k // p.private_heads_per_block) * (p.padded_rows // p.private_rows_per_block)
                   * -(-width // p.pages_per_block))
  f32 = tpu.plan((sharing.num_rows, t, shape['heads'], h), jnp.float32,
                 (sharing.kv_tokens, k, h), layout, block_sizes)
  flops = 4 * sharing.num_rows * t * shape['heads'] * h * (shape['prefix'] + t)
  return dict(block_rows=p.block_rows, block_kv=p.block_kv, heads_per_block=p.heads_per_block,
              core_splits=p.num_splits, row_tiles=p.num_tiles, shared_steps=shared_steps,
              private_steps=private_steps, grid_steps=shared_steps + private_steps,
              shared_step_work=p.block_rows * p.block_kv * p.heads_per_block,
              vmem_estimate_bytes=p.vmem_bytes, vmem_limit_bytes=p.vmem_limit_bytes,
              f32_vmem_estimate_bytes=f32.vmem_bytes,
              f32_fits=f32.vmem_bytes <= (block_sizes.vmem_limit_bytes or tpu.VMEM_BUDGET_BYTES),
              attention_flops=flops)


def compile_row(generation: str, name: str, shape_name: str, shape: dict) -> dict:
  topology = TOPOLOGY[generation]
  block_sizes = candidate(generation, name)
  row = dict(generation=generation, topology=topology, candidate=name, shape=shape_name,
             block_sizes=dataclasses.asdict(block_sizes), **plan_figures(shape, block_sizes))
  chip = aot.CHIPS[generation]
  row['mxu_seconds'] = row['attention_flops'] / chip.peak_bf16_flops
  row['step_overhead_seconds'] = row['grid_steps'] * STEP_SECONDS
  start = time.perf_counter()
  try:
    compiled = tree_attention_kernels(topology, block_sizes=block_sizes, **shape)
    row.update(status='ok', error=None, **aot.stats(compiled, topology))
  except Exception as e:  # noqa: BLE001 (a candidate the kernel or compiler refuses is a result)
    row.update(status='refused', error=f'{type(e).__name__}: {str(e)[:400]}')
  row['compile_seconds'] = round(time.perf_counter() - start, 1)
  return row


def fits_at_full_size(block_sizes: BlockSizes) -> bool:
  """Whether the blocks pass the kernel's VMEM/SMEM check at their full size (a decode batch
  filling a row tile, a prefix of several kv blocks, 32/8 heads) at head dim 128 and 64, in
  bf16 and float32: the benchmark shapes fill a 2048-row tile only in the prefill call."""
  sharing = hj.plan_tree(hj.PromptNode(4 * block_sizes.block_kv,
                                       num_samples=block_sizes.block_rows), private_capacity=16)
  layout = sharing.to_device()
  return all(
      tpu.unsupported_reason(hj.AttentionShapes(sharing.num_rows, 1, 32, 8, h, sharing.kv_tokens,
                                                jnp.dtype(dtype)), layout,
                             config=block_sizes) is None
      for dtype in (jnp.bfloat16, jnp.float32) for h in (128, 64))


def ranking(rows: list[dict], generation: str) -> list[str]:
  """The candidates of a generation that compiled at every bf16 shape, and whose blocks would
  pass the kernel's VMEM check in float32 and at full size too, fewest grid steps in all first
  (then the least VMEM asked, then the smallest estimate)."""
  mine = [r for r in rows if r['generation'] == generation and not r['shape'].endswith('(check)')]
  keys = {}
  for name in dict.fromkeys(r['candidate'] for r in mine):
    runs = [r for r in mine if r['candidate'] == name]
    if (all(r['status'] == 'ok' and r['f32_fits'] for r in runs)
        and fits_at_full_size(candidate(generation, name))):
      keys[name] = (sum(r['grid_steps'] for r in runs), max(r['vmem_limit_bytes'] for r in runs),
                    max(r['vmem_estimate_bytes'] for r in runs))
  return sorted(keys, key=keys.get)


def check_row(rows: list[dict], generation: str, name: str) -> dict | None:
  return next((r for r in rows if (r['generation'], r['candidate']) == (generation, name)
               and r['shape'].endswith('(check)')), None)


def choose(rows: list[dict]) -> dict[str, str]:
  """Per generation, the first of `ranking` whose float32 check compiled."""
  chosen = {}
  for generation in dict.fromkeys(r['generation'] for r in rows):
    for name in ranking(rows, generation):
      check = check_row(rows, generation, name)
      if check is not None and check['status'] == 'ok':
        chosen[generation] = name
        break
  return chosen


ABOUT = (
    '**Nothing here was timed on a chip.** Each candidate was compiled by libtpu\'s compiler '
    'for one chip of the generation; "refused" is the kernel\'s own VMEM/SMEM check or the '
    'compiler\'s error. The chosen entry per generation is the candidate that compiled at every '
    'shape, and whose blocks pass the kernel\'s VMEM check in float32 and at full size too '
    '(`plan()`\'s estimate for a batch filling a row tile, head dim 128 and 64), with the '
    'fewest grid steps in all, and whose float32 compile of the H=64 decode '
    'call (the shape whose VMEM the estimate undercounts most) succeeded: the best candidates '
    'are compiled so in turn until one passes. A grid step\'s fixed pipeline '
    'cost is what a roofline does not see ("step cost" is the count times 0.35 µs, an '
    'assumption). Mosaic kernels report no FLOPs to the cost analysis, so "roofline" is the '
    'compiler-counted bytes (the kernels\' operands and the XLA ops around them) over HBM '
    'bandwidth, and "MXU" is the attention\'s FLOPs (4·B·T·N·H·(P+T)) over the chip\'s bf16 '
    'peak. Neither ranks candidates: the FLOPs are the same for all, and the counted bytes move '
    'with how XLA fuses the ops around the kernels, not with what the kernels read.\n\n'
    'Candidates other than `fallback` (today\'s `BlockSizes()`) take one core split per '
    'TensorCore and ask for 96 MiB of scoped VMEM on v5e and v6e (128 MiB per TensorCore), '
    '56 MiB on v5p (64 MiB); that limit is also the budget of the kernel\'s VMEM check.')

TABLE_HEAD = ('| generation | candidate | shape | status | rows x kv x heads, splits | tiles | '
              'grid steps shared + private | step cost µs | VMEM estimate / asked MiB | '
              'f32 estimate MiB | '
              'temp MiB | MiB accessed | roofline µs | MXU µs | compile s |\n|'
              + ' --- |' * 15)


def _one_line(error: str) -> str:
  return ' '.join(error.replace('|', '/').split())[:160]


def _row_text(r: dict) -> str:
  head = (f"| {r['generation']} | {r['candidate']} | {r['shape']} | "
          f"{r['status'] if r['status'] == 'ok' else 'refused: ' + _one_line(r['error'])} | "
          f"{r['block_rows']} x {r['block_kv']} x {r['heads_per_block']}, {r['core_splits']} | "
          f"{r['row_tiles']} | {r['shared_steps']} + {r['private_steps']} | "
          f"{r['step_overhead_seconds'] * 1e6:.0f} | {r['vmem_estimate_bytes'] / MiB:.1f} / "
          f"{r['vmem_limit_bytes'] / MiB:.0f} | {r['f32_vmem_estimate_bytes'] / MiB:.1f}"
          f"{'' if r['f32_fits'] else ' (over)'} |")
  if r['status'] != 'ok':
    return head + f" - | - | - | {r['mxu_seconds'] * 1e6:.0f} | {r['compile_seconds']} |"
  return head + (f" {r['bytes']['temp'] / MiB:.1f} | {r['bytes_accessed'] / MiB:.0f} | "
                 f"{r['roofline_seconds'] * 1e6:.0f} | {r['mxu_seconds'] * 1e6:.0f} | "
                 f"{r['compile_seconds']} |")


def _chosen_text(rows: list[dict], chosen: dict[str, str]) -> str:
  lines = ['| generation | chosen | BlockSizes | grid steps (all shapes) | table entry now |',
           '| --- | --- | --- | --- | --- |']
  for generation, name in chosen.items():
    runs = [r for r in rows if r['generation'] == generation and r['candidate'] == name
            and not r['shape'].endswith('(check)')]
    knobs = {k: v for k, v in runs[0]['block_sizes'].items()
             if v != getattr(BlockSizes(), k)}
    entry = BLOCK_SIZES_BY_GENERATION.get(generation) == candidate(generation, name)
    lines.append(f"| {generation} | {name} | {knobs or 'defaults'} | "
                 f"{sum(r['grid_steps'] for r in runs)} | {'same' if entry else 'differs'} |")
  return '\n'.join(lines)


def _plot(rows: list[dict], path: str) -> None:
  rows = [r for r in rows if not r['shape'].endswith('(check)')]
  generations = list(dict.fromkeys(r['generation'] for r in rows))
  shape_names = list(dict.fromkeys(r['shape'] for r in rows))
  fig, axes = plt.subplots(1, len(generations), figsize=(5 * len(generations), 4.5),
                           squeeze=False, sharey=True)
  for ax, generation in zip(axes[0], generations):
    names = list(dict.fromkeys(r['candidate'] for r in rows if r['generation'] == generation))
    width = 0.8 / len(shape_names)
    for i, shape_name in enumerate(shape_names):
      for j, name in enumerate(names):
        r = next((r for r in rows if (r['generation'], r['candidate'], r['shape']) ==
                  (generation, name, shape_name)), None)
        if r is None:
          continue
        ok = r['status'] == 'ok'
        ax.bar(j + (i - (len(shape_names) - 1) / 2) * width, r['grid_steps'], width,
               color=f'C{i}', alpha=1.0 if ok else 0.25, hatch=None if ok else 'xx',
               label=shape_name if j == 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
    ax.set_yscale('log')
    ax.set_title(f'{generation} ({TOPOLOGY[generation]}): grid steps per call')
  axes[0][0].set_ylabel('grid steps (hatched: refused)')
  fig.legend(*axes[0][0].get_legend_handles_labels(), loc='lower center', ncol=len(shape_names),
             fontsize=8)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_reports(rows: list[dict], command: str) -> dict[str, str]:
  chosen = choose(rows)
  table = TABLE_HEAD + '\n' + '\n'.join(_row_text(r) for r in rows) + '\n'
  with open(os.path.join(_WORKDIR.value, 'table.md'), 'w') as f:
    f.write(table + '\n' + _chosen_text(rows, chosen) + '\n')
  _plot(rows, os.path.join(_WORKDIR.value, 'grid_steps.png'))
  with open(os.path.join(_WORKDIR.value, 'README.md'), 'w') as f:
    f.write(
        '# Block sizes of the Mosaic TPU kernels per TPU generation (compiled, not timed)\n\n'
        f'Command: `JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 PYTHONPATH=.:.libtpu {command}`\n'
        f'(JAX {jax.__version__}, libtpu on the path; no TPU attached). Rows: '
        '`results.jsonl`; the table: `table.md`; the plot: `grid_steps.png`.\n\n'
        + ABOUT + '\n\n## Chosen\n\n' + _chosen_text(rows, chosen)
        + '\n\n## Every compile\n\n' + table)
  return chosen


def main(argv):
  del argv
  reason = aot.libtpu_reason()
  if reason:
    raise app.UsageError(f'{reason}; `make tpu-block-sizes` installs it')
  os.makedirs(_WORKDIR.value, exist_ok=True)
  # The command that makes every row at once (--resume only completes an earlier run).
  command = ' '.join(['python -m experiments.tpu_block_sizes']
                     + [a for a in sys.argv[1:] if not a.startswith(('--resume', '--noresume'))])
  path = os.path.join(_WORKDIR.value, 'results.jsonl')
  rows = report.resume_records(path, (lambda r: True) if _RESUME.value else None)
  done = {(r['generation'], r['candidate'], r['shape']) for r in rows}
  jobs = [(g, c, s, shape) for g in _GENERATIONS.value for c in _CANDIDATES.value
          for s, shape in shapes().items() if (g, c, s) not in done]
  with open(path, 'a') as out:
    def run(job, where):
      row = compile_row(*job)
      logging.info('[%s] %s %s %s: %s, %d grid steps, VMEM ~%.0f/%.0f MiB (%.0f s)', where,
                   *job[:3], row['status'] if row['status'] == 'ok' else row['error'][:160],
                   row['grid_steps'], row['vmem_estimate_bytes'] / MiB,
                   row['vmem_limit_bytes'] / MiB, row['compile_seconds'])
      out.write(json.dumps(row) + '\n')
      out.flush()
      rows.append(row)
      return row

    for i, job in enumerate(jobs, 1):
      run(job, f'{i}/{len(jobs)}')
    check_name, check_shape = float32_check_shape()
    for generation in _GENERATIONS.value:  # the best candidates' float32 check, until one passes
      for name in ranking(rows, generation):
        check = check_row(rows, generation, name) or run(
            (generation, name, check_name, check_shape), 'float32 check')
        if check['status'] == 'ok':
          break
  order = {(g, c): i for i, (g, c) in enumerate(
      (g, c) for g in TOPOLOGY for c in CANDIDATES)}
  rows.sort(key=lambda r: order[r['generation'], r['candidate']])  # stable: shapes keep order
  chosen = write_reports(rows, command)
  logging.info('chosen: %s', chosen)


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
