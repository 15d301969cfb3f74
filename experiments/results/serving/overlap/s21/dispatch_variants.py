"""Session 21, call 1: which argument makes the overlapped engine's jitted call wait for the step
before it? `experiments.serving` (its flags, e.g. the overlap profile) with Engine._model_step
wrapped per HYDRAJAX_PROBE: 'asis' (timers only), 'device_put' (every numpy leaf put on the
device, async, before the call; the put timed apart), 'block_inputs' (jax.block_until_ready on
the non-donated device inputs first: if the call is then fast, it waited for an input).
Prints the last 24 calls' times as JSON lines."""
import json, os, time

import jax
import numpy as np
from absl import app
from experiments import serving
from models.engine import engine as engine_lib

MODE = os.environ.get('HYDRAJAX_PROBE', 'asis')
calls = []
original_init = engine_lib.Engine.__init__


def init(self, *args, **kwargs):
  original_init(self, *args, **kwargs)
  step = self._model_step

  def wrapped(params, cache, *rest, **kwargs):
    t0 = time.perf_counter()
    if MODE == 'device_put':
      rest, kwargs = jax.tree.map(
          lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, (rest, kwargs))
    elif MODE == 'block_inputs':
      jax.block_until_ready([x for x in jax.tree.leaves((rest, kwargs))
                             if isinstance(x, jax.Array)])
    t1 = time.perf_counter()
    out = step(params, cache, *rest, **kwargs)
    calls.append({'mode': MODE, 'before_ms': round((t1 - t0) * 1e3, 3),
                  'call_ms': round((time.perf_counter() - t1) * 1e3, 3),
                  'numpy_leaves': sum(isinstance(x, np.ndarray)
                                      for x in jax.tree.leaves((rest, kwargs)))})
    return out

  self._model_step = wrapped


engine_lib.Engine.__init__ = init
try:
  app.run(serving.main)
except SystemExit:
  pass
finally:
  for c in calls[-24:]:
    print(json.dumps(c), flush=True)
