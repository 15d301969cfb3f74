"""Counters of an engine's life."""

import dataclasses


@dataclasses.dataclass
class EngineStats:
  """Counters of an engine's life (seconds of the engine's clock).

  A decode step's time is `decode_host_s` (host overhead: the tree and its
  metadata, the batch arrays and their upload, the dispatch of the jitted call,
  and handing out the tokens) plus `decode_wait_s` (waiting for the device's
  result): step wall time minus the wait for the device. Of the host part,
  `decode_prepare_s` is the tree, layout and arrays, `decode_dispatch_s` the
  jitted call's dispatch. With `overlap_decode` a step's prepare and dispatch
  run while the device computes the step before it, so its host time is
  hidden rather than added; its wait is what is left of the device's time.
  A step whose shapes the engine runs for the first time (it may compile) is
  counted apart, in `new_shape_steps` and `new_shape_s`, not in the decode
  figures. `shapes` holds every distinct model step run, a shape in a sampling
  mode (at most the engine's `compiled_shape_budget().num_programs`); `errors`
  counts requests that finished
  with reason 'error'.
  """

  iterations: int = 0
  decode_steps: int = 0
  decode_rows: int = 0
  decode_chunks: int = 0  # chunks in use, summed over the counted decode steps
  decode_s: float = 0.0
  decode_host_s: float = 0.0
  decode_prepare_s: float = 0.0  # host: the tree, layout and batch arrays, before the dispatch
  decode_dispatch_s: float = 0.0  # host: the jitted call's dispatch (arguments, uploads)
  decode_wait_s: float = 0.0
  plan_builds: int = 0  # decode attention plans prepared (once per tree change, not per step)
  new_shape_steps: int = 0
  new_shape_s: float = 0.0
  prefill_calls: int = 0
  prefill_tokens: int = 0
  prefill_padded_tokens: int = 0
  prefill_s: float = 0.0
  shared_tokens: int = 0
  cached_tokens: int = 0
  copied_tokens: int = 0
  forked_samples: int = 0
  generated_tokens: int = 0
  peak_chunks: int = 0
  peak_rows: int = 0
  errors: int = 0
  shapes: set = dataclasses.field(default_factory=set)

  def summary(self) -> dict:
    out = {k: v for k, v in dataclasses.asdict(self).items() if k != 'shapes'}
    out['distinct_step_shapes'] = len(self.shapes)
    out['host_overhead_fraction'] = self.decode_host_s / self.decode_s if self.decode_s else 0.0
    out['mean_decode_step_ms'] = 1e3 * self.decode_s / max(self.decode_steps, 1)
    out['mean_decode_host_ms'] = 1e3 * self.decode_host_s / max(self.decode_steps, 1)
    out['mean_decode_wait_ms'] = 1e3 * self.decode_wait_s / max(self.decode_steps, 1)
    out['mean_decode_prepare_ms'] = 1e3 * self.decode_prepare_s / max(self.decode_steps, 1)
    out['mean_decode_dispatch_ms'] = 1e3 * self.decode_dispatch_s / max(self.decode_steps, 1)
    return out
