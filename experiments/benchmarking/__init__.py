"""Benchmarking library shared by the experiments: timing, roofline, workloads, report.

  timing     device_time (fori_loop minus empty loop, L2 flushed), host_time, Timing
  roofline   measure_ceilings, floor, shared_prefix_cost, per_sequence_cost, Cost, Ceilings
  workloads  Shape, named grids (hydragen, chunkattention, targets, smoke), make_problem
  report     JsonlWriter (JSONL with run metadata), markdown_table, plot_sweeps, plot_bars, progress
  gpu_clock  ClockSampler: the SM clock and power cap while a timed region runs (NVML)
"""

from experiments.benchmarking.report import (
    JsonlWriter, markdown_table, plot_bars, plot_sweeps, progress, progress_counter, read_jsonl,
    resume_records,
    run_metadata, write_workdir_readme,
)
from experiments.benchmarking.roofline import (
    Ceilings, Cost, floor, measure_ceilings, measure_copy_bandwidth, measure_matmul_rate,
    per_sequence_cost, shared_prefix_cost,
)
from experiments.benchmarking.timing import Timing, device_time, host_time
from experiments.benchmarking.workloads import GRIDS, Problem, Shape, check_rows, grid, make_problem
