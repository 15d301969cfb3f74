"""A compiled XLA program's kernel launches per loop iteration, read from its HLO text.

`step_launches(compiled.as_text())` lists the launches of the program's busiest computation
(a decode loop's body: one step) in schedule order, each with XLA's base name (without the
`.remat` suffixes of work the rematerialization pass computes again), its kind and what it
computes; `summarize` counts them. `experiments.xla_programs` reads programs compiled for a
GPU on a machine with none.
"""

import collections
import dataclasses
import re

# An instruction of a computation: its name, result shape and opcode.
_INSTRUCTION = re.compile(r'\s*(?:ROOT )?%(\S+) = (.+?) ([a-z-]+)\(')
# Opcodes that are kernel launches in a scheduled XLA:GPU program (the rest are bitcasts,
# tuples, parameters, constants and control flow).
LAUNCH_OPCODES = ('fusion', 'custom-call', 'copy', 'scatter', 'gather', 'dynamic-update-slice',
                  'all-reduce', 'all-gather', 'reduce-scatter', 'sort')
MOSAIC_TARGET = 'mosaic_gpu'


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch of a step: the instruction's name, XLA's base name (without the
  `.remat` suffixes), its opcode or fusion kind, and the custom-call target or fusion root."""

  name: str
  base: str
  kind: str
  what: str

  @property
  def remat(self) -> bool:
    return self.name != self.base


def computations(hlo_text: str) -> dict[str, list[str]]:
  """The computations of an HLO module's text: name -> instruction lines."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r'^(?:ENTRY )?%(\S+) \(', line)
    if header:
      current = out.setdefault(header.group(1), [])
    elif current is not None and line.strip() and line.strip() != '}':
      current.append(line)
  return out


def step_launches(hlo_text: str) -> list[Launch]:
  """The launches of the decode loop's body (the computation with the most custom calls and
  fusions: the step), in schedule order."""
  comps = computations(hlo_text)
  if not comps:
    raise ValueError('hlo_text holds no computation (pass a compiled program\'s as_text())')

  def launches(lines):
    return [m for m in map(_INSTRUCTION.match, lines) if m and m.group(3) in LAUNCH_OPCODES]

  body = max(comps, key=lambda name: len(launches(comps[name])))
  out = []
  for line, m in ((line, _INSTRUCTION.match(line)) for line in comps[body]):
    if not m or m.group(3) not in LAUNCH_OPCODES:
      continue
    name, opcode = m.group(1), m.group(3)
    kind = re.search(r'kind=(k\w+)', line)
    target = re.search(r'custom_call_target="([^"]+)"', line)
    called = re.search(r'calls=%([\w.\-]+)', line)
    what = target.group(1) if target else ''
    if called and called.group(1) in comps:
      roots = [l.strip() for l in comps[called.group(1)] if l.strip().startswith('ROOT')]
      if roots:  # the fused computation's root op and shape
        root = _INSTRUCTION.match(roots[0])
        what = f'{root.group(3)} -> {root.group(2)}' if root else roots[0][:80]
    out.append(Launch(name, re.sub(r'(\.remat\d*)+$', '', name),
                      kind.group(1) if kind else opcode, what))
  return out


def category(launch: Launch) -> str:
  """mosaic (the attention kernels), gemm (cuBLAS or a GEMM fusion), collective or fusion."""
  if MOSAIC_TARGET in launch.what:
    return 'mosaic'
  if 'matmul' in launch.what or 'gemm' in launch.name or launch.what.startswith('dot'):
    return 'gemm'
  if launch.kind in ('all-reduce', 'all-gather', 'reduce-scatter'):
    return 'collective'
  return 'fusion'


def summarize(launches: list[Launch]) -> dict:
  """Counts of a step's launches: by category, the rematerialized ones, and the instructions
  XLA runs more than once a step (their base names)."""
  by_base = collections.Counter(l.base for l in launches)
  return dict(
      launches=len(launches),
      by_category=dict(collections.Counter(map(category, launches))),
      remat_launches=sum(l.remat for l in launches),
      repeated={base: n for base, n in by_base.items() if n > 1},
  )
