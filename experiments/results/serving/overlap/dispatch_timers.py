"""Where does the overlapped engine's dispatch wait? Runs `experiments.serving` (its flags) with
(Diagnostic only: it wraps JAX internals, pjit and pxla, which have no public equivalent.)
timers around Engine._run_model, JAX's Python dispatch path (`_pjit_call_impl_python`) and the
executable call (`ExecuteReplicated.__call__`); prints the last 24 calls as JSON lines."""
import json, time

from absl import app
from jax._src import pjit
from jax._src.interpreters import pxla
from experiments import serving
from models.engine import engine as engine_lib

calls, current = [], None


def timed(owner, name, key):
  original = getattr(owner, name)

  def wrapper(*args, **kwargs):
    t0 = time.perf_counter()
    try:
      return original(*args, **kwargs)
    finally:
      if current is not None:
        current[key] = current.get(key, 0.0) + (time.perf_counter() - t0) * 1e3
        current[key + '_n'] = current.get(key + '_n', 0) + 1
  setattr(owner, name, wrapper)


timed(pjit, '_pjit_call_impl_python', 'python_path_ms')
timed(pxla.ExecuteReplicated, '__call__', 'execute_ms')
original_run = engine_lib.Engine._run_model


def run_model(self, *args, **kwargs):
  global current
  current = {'kind': str(kwargs.get('kind'))}
  t0 = time.perf_counter()
  try:
    return original_run(self, *args, **kwargs)
  finally:
    current['run_model_ms'] = (time.perf_counter() - t0) * 1e3
    calls.append(current)
    current = None


engine_lib.Engine._run_model = run_model
try:
  app.run(serving.main)
except SystemExit:
  pass
finally:
  for c in calls[-24:]:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}),
          flush=True)
