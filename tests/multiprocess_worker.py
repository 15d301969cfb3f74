"""One process of `tests/test_multiprocess.py`: starts JAX's multi-process runtime on a loopback
coordinator (one CPU device a process, gloo collectives), runs greedy `generate` and the engine
over a mesh spanning every process, and prints the tokens as one JSON line.

    python -m tests.multiprocess_worker 127.0.0.1:PORT NUM_PROCESSES PROCESS_ID MESH
"""

import json
import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hydrajax.attention import parallel  # noqa: E402
from models.llama import init_model  # noqa: E402
from models.config import get_config  # noqa: E402
from models.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from models.generate import generate  # noqa: E402
from models.prompt_plan import prompt_node  # noqa: E402

CONFIG = dict(name='tiny_gqa', num_heads=4, num_kv_heads=2, vocab_size=96)


def prompts(vocab: int):
  """Two independent groups (one per dp shard): a shared prefix with two children, and one more."""
  rng = np.random.default_rng(5)
  toks = lambda n: rng.integers(0, vocab, n).tolist()
  shared = prompt_node(toks(21), [prompt_node(toks(5), num_samples=2),
                                  prompt_node(toks(9), num_samples=1)])
  return [shared, prompt_node(toks(7), num_samples=1)]


def engine_prompts(vocab: int):
  rng = np.random.default_rng(0)
  prefix = rng.integers(0, vocab, 20).tolist()
  return [prefix + rng.integers(0, vocab, n).tolist() for n in (3, 7, 1)]


def run(mesh_spec: str) -> dict:
  """Greedy tokens of `generate` and of the engine on `mesh_spec` ('none' for one device)."""
  name = CONFIG['name']
  config = get_config(name, **{k: v for k, v in CONFIG.items() if k != 'name'})
  mesh = parallel.parse_mesh(mesh_spec)
  model = init_model(config, mesh=mesh, seed=2)
  print('model made', flush=True)
  out = generate(model, prompts(config.vocab_size), max_new_tokens=6, impl='xla')
  engine_config = EngineConfig(num_chunks=32, chunk_size=16, max_batch=4, impl='xla',
                               prefill_impl='xla', max_sequence_length=64)
  print('generated', flush=True)
  engine = Engine(init_model(config, mesh=mesh, seed=4), engine_config)
  served = engine.generate(engine_prompts(config.vocab_size), SamplingParams(max_new_tokens=5))
  return dict(generate=np.asarray(out.tokens).tolist(), engine=[repr(o) for o in served])


def main(coordinator: str, num_processes: int, process_id: int, mesh_spec: str):
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if num_processes > 1:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60)
  print(f'process {jax.process_index()} of {jax.process_count()}: {jax.devices()}', flush=True)
  result = run(mesh_spec)
  result.update(process=jax.process_index(), devices=jax.device_count())
  print('RESULT ' + json.dumps(result), flush=True)
  if num_processes > 1:
    jax.distributed.shutdown()


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
