r"""A GRPO training loop over batches of one shape whose prompts' real lengths change: wall time
of each step and the step's compiled programs, with the prompt segments sized by their slot
(`Segment.kv_capacity`, session 42) against sized by their real length (before).

  PYTHONPATH=. python3 experiments/results/train_compile_once/probe.py --out=/tmp/probe.jsonl
  PYTHONPATH=. python3 experiments/results/train_compile_once/probe.py --nosmoke --out=...  # H200

`length` rebuilds each batch's plan with every segment's kv_capacity 0, which is the plan the
code before session 42 made. One JSONL record per step.
"""

import dataclasses
import json
import time

from absl import app, flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hydrajax.dispatch import AttentionImpl
from hydrajax.training import prefill_layout as pl
from models.config import get_config
from models.llama import Llama
from models.training import grpo

_SMOKE = flags.DEFINE_bool('smoke', True, 'tiny CPU model; --nosmoke: llama3_8b at 2 layers')
_BATCHES = flags.DEFINE_integer('batches', 4, 'steps, each on a batch of new prompt lengths')
_OUT = flags.DEFINE_string('out', '/tmp/compile_once.jsonl', 'JSONL output')


def _compiled(step) -> int:
  """Programs the step has compiled (`step.jitted` since the step places its state first;
  before, the step was the jitted function itself)."""
  return getattr(step, 'jitted', step)._cache_size()


def main(argv):
  del argv
  if _SMOKE.value:
    config, dtype, impl, (g, p, t), prompts = (get_config('tiny_gqa'), jnp.float32,
                                               AttentionImpl.XLA, (4, 32, 16), 2)
  else:
    config, dtype, impl, (g, p, t), prompts = (
        get_config('llama3_8b', num_layers=2, vocab_size=32_000), jnp.bfloat16,
        AttentionImpl.MOSAIC_GPU, (16, 4096, 512), 2)
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(0), dtype=dtype))
  rng = np.random.default_rng(0)
  b = prompts * g
  full = jnp.full((b, t), -float(np.log(config.vocab_size)), jnp.float32)
  batch = grpo.GrpoBatch(
      prompts=jnp.asarray(rng.integers(0, config.vocab_size, (prompts, p)), jnp.int32),
      completions=jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32),
      mask=jnp.ones((b, t)), advantages=jnp.asarray(rng.standard_normal(b), jnp.float32),
      old_logp=full, ref_logp=full)
  lengths = [rng.integers(p // 2, p + 1, prompts).tolist() for _ in range(_BATCHES.value)]
  with open(_OUT.value, 'w') as f:
    for mode in ('slot', 'length'):
      optimizer = optax.adam(1e-6)
      step = grpo.make_train_step(graphdef, optimizer, grpo.GrpoConfig(), impl=impl)
      state = [jax.tree.map(jnp.copy, params), optimizer.init(params)]
      for i, batch_lengths in enumerate(lengths):
        plan = pl.plan_prefill(batch_lengths, g, t, prompt_capacity=p)
        if mode == 'length':  # the plan before session 42: segments sized by their lengths
          segments = tuple(dataclasses.replace(s, kv_capacity=0)
                           for s in plan.completion_plan.segments)
          plan = dataclasses.replace(plan, completion_plan=dataclasses.replace(
              plan.completion_plan, segments=segments))
        start = time.perf_counter()
        *state, metrics = step(*state, batch, plan.to_device())
        loss = float(metrics['loss'])
        rec = dict(mode=mode, step=i, prompt_lengths=batch_lengths, G=g, P=p, T=t,
                   wall_s=time.perf_counter() - start, compiled=_compiled(step), loss=loss,
                   preset=config.name, layers=config.num_layers, impl=impl.value,
                   backend=jax.default_backend())
        print(json.dumps(rec), flush=True)
        f.write(json.dumps(rec) + '\n')


if __name__ == '__main__':
  app.run(main)
