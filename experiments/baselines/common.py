"""Options shared by the builders, and small guards.

A builder takes a `Problem` and `Options` and returns a `Candidate` (run once
for the check, time it), or raises `Unsupported` saying why it cannot run the
point (missing package, backend, memory cap, shape).
"""

import dataclasses
from typing import Any

from experiments.benchmarking.sweep import Candidate, Unsupported
from experiments.benchmarking.workloads import Problem

__all__ = ['Candidate', 'Options', 'Unsupported', 'check_copy_budget', 'require_decode']


@dataclasses.dataclass(frozen=True)
class Options:
  """Knobs shared by the builders.

  Attributes:
    max_copy_bytes: cap on per-sequence KV copies (bytes of K and V together).
    page_size: tokens per page of the paged baselines.
    timing: keyword arguments of `device_time` (and `repeats` for the torch timer).
  """

  max_copy_bytes: float = 24e9
  page_size: int = 16
  timing: dict[str, Any] = dataclasses.field(default_factory=dict)


def check_copy_budget(problem: Problem, options: Options, factor: float = 1.0) -> None:
  need = problem.shape.per_sequence_kv_bytes() * factor
  if need > options.max_copy_bytes:
    raise Unsupported(
        f'per-sequence KV copies need {need / 1e9:.1f} GB > --max_copy_gb={options.max_copy_bytes / 1e9:g}'
    )


def require_decode(problem: Problem) -> None:
  if problem.shape.query_len != 1:
    raise Unsupported(f'decode only (query_len 1), got {problem.shape.query_len}')
