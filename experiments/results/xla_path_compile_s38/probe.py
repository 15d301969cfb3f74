"""Compile time of the serving engine's decode step on the XLA path (tiny_gqa, the soak test's
engine config) at J segment slots: trace, lower, StableHLO size, XLA compile.

  PYTHONPATH=. python experiments/results/xla_path_compile_s38/probe.py 512
"""

import dataclasses
import sys
import time

import numpy as np
from flax import nnx

from models.config import get_config
from models.engine import Engine
from models.llama import Llama
from models.sampling import SamplingMode
from tests.test_server_soak import SOAK_CONFIG

engine = Engine(Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(0)), SOAK_CONFIG)
c, b, j = engine.config, 32, int(sys.argv[1])
layout = engine._prepare_plan(engine._empty_layout(b, j, engine.caches[0].config.layout), c.impl)
tokens = np.zeros((b, 1), np.int32)
seeds, streams, index, rows = engine._sampling_inputs([], b)
rows = dataclasses.replace(rows, mode=SamplingMode.GREEDY)
t0 = time.time()
traced = engine._model_step.trace(
    engine._params, engine.kv, tokens, np.zeros((b, 1), np.int32),
    np.full((b, 1), engine._drop_slot, np.int32), layout, seeds, streams, index, rows, None,
    feed=None, impl=c.impl, top_logprobs=c.max_top_logprobs)
t1 = time.time()
lowered = traced.lower()
t2 = time.time()
size = len(lowered.as_text())
lowered.compile()
t3 = time.time()
print(f'J={j} path width={layout.layout.row_segments.shape[1]} stablehlo chars={size} '
      f'trace {t1 - t0:.1f} s, lower {t2 - t1:.1f} s, compile {t3 - t2:.1f} s')
