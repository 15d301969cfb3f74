"""Evaluating generated programs: APPS records, a sandboxed checker, pass@k.

  apps       Problem (an APPS record), load_problems (JSONL file or release folder), the APPS
             harness' output comparison rules
  sandbox    run untrusted Python in a sandbox (namespaces, private tmpfs root, leased uid,
             budgets; a weaker mode with a warning where those are unavailable)
  sandbox_launcher  the script that builds the sandbox (run by `sandbox`, never imported)
  apps_runner       runs a program on a problem's tests inside the sandbox; its value codec
  checker    check_programs(problem, programs) -> CheckReport (per-program Status, pass@k)
  metrics    pass_at_k, the unbiased estimator of Chen et al. (2021)
  tokenizer  ByteTokenizer: a byte-level tokenizer for the tiny models trained here
"""

from hydrajax.evaluation.apps import Problem, load_problems, stdout_matches, call_output_matches
from hydrajax.evaluation.checker import (
    CheckConfig, CheckReport, ProgramResult, Status, check_program, check_programs,
)
from hydrajax.evaluation.metrics import mean_pass_at_k, pass_at_k
from hydrajax.evaluation.sandbox import Isolation, SandboxLimits, SandboxResult, isolation
from hydrajax.evaluation.tokenizer import ByteTokenizer
