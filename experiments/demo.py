"""`make demo`: a real model answers several questions that share one few-shot prompt.

    python -m experiments.demo                      # CPU: a few minutes
    python -m experiments.demo --questions=6 --new_tokens=24

SmolLM2-135M-Instruct (30 layers, fetched once by `make model`, see models.pretrained) answers
each question greedily after the same few-shot prompt, twice:

  tree           the few-shot prompt's KV is stored once and read once per decode step for all
                 the questions (Hydragen's tree attention), each question's own tokens apart
  per sequence   every question stores and reads its own copy of the whole prompt (dense caches:
                 the ground truth)

Both give the same text (greedy decoding is exact; in float32 the answers match token for
token). Printed: each answer, the time of each run (its compile, paid once per shape, apart; the
compiled programs are kept in the cache folder of models.pretrained, so a second run loads them),
the KV each stores, and where the results were written (--workdir).
"""

import json
import os
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import hydrajax as hj
from experiments import cli
from experiments.qa_prompts import FEWSHOT
from models import generate as gen
from models import prompt_plan as pp
from models import pretrained
from models.llama import ModelMode

QUESTIONS = (
    'What is the largest planet in the solar system?',
    'Who wrote the play Romeo and Juliet?',
    'Which ocean is the largest?',
    'What is the capital of Italy?',
    'What gas do plants take in from the air?',
    'How many days are there in a week?',
)

_QUESTIONS = flags.DEFINE_integer('questions', 4, f'questions asked (1 to {len(QUESTIONS)})',
                                  lower_bound=1, upper_bound=len(QUESTIONS))
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 16, 'most tokens generated per answer (an '
                                   'answer ends at its first newline)', lower_bound=1)
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'weights and KV')
_IMPL = flags.DEFINE_enum('impl', 'auto', [i.value for i in hj.AttentionImpl],
                          'tree attention implementation')
_WORKDIR = cli.workdir_flag('demo', 'output folder (answers.json)')


def _timed(run) -> tuple[gen.GenerateOutput, float, float]:
  """(output, first call's seconds (compiles), second call's seconds)."""
  start = time.perf_counter()
  first = run()
  first_s = time.perf_counter() - start
  start = time.perf_counter()
  out = run()
  second_s = time.perf_counter() - start
  np.testing.assert_array_equal(first.tokens, out.tokens)  # greedy: the same tokens again
  return out, first_s, second_s


def main(argv):
  del argv
  if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):  # a second run loads its programs
    jax.config.update('jax_compilation_cache_dir',
                      str(pretrained.default_cache_dir() / 'jax_programs'))
  print('loading SmolLM2-135M-Instruct ...', flush=True)
  try:
    model, tokenizer = pretrained.load_smollm2(dtype=jnp.dtype(_DTYPE.value))
  except pretrained.ModelUnavailableError as e:
    raise SystemExit(f'error: {e}') from None
  questions = QUESTIONS[:_QUESTIONS.value]
  newline = tokenizer.encode('\n', add_bos=False)
  stops = tuple(tokenizer.eos_ids) + (tuple(newline) if len(newline) == 1 else ())
  shared = tokenizer.encode(FEWSHOT)
  own = [tokenizer.encode(f'Question: {q}\nAnswer:', add_bos=False) for q in questions]
  forest = [pp.prompt_node(shared, [pp.prompt_node(ids) for ids in own])]
  new = _NEW_TOKENS.value
  print(f'{len(questions)} questions after a shared {len(shared)}-token few-shot prompt; '
        f'questions {min(map(len, own))}-{max(map(len, own))} tokens; up to {new} new tokens; '
        f'{model.config.num_layers} layers, {_DTYPE.value}, backend {jax.default_backend()}',
        flush=True)

  runs = {}
  for name, impl in (('tree', _IMPL.value), ('per sequence', ModelMode.DENSE)):
    print(f'decoding ({name}) ...', flush=True)
    runs[name] = _timed(lambda impl=impl: gen.generate(
        model, forest, max_new_tokens=new, stop_tokens=stops, impl=impl))
  tree, dense = runs['tree'][0], runs['per sequence'][0]
  answers = [tokenizer.decode(t).strip() for t in tree.tokens]
  same = [tokenizer.decode(a) == tokenizer.decode(b) for a, b in zip(tree.tokens, dense.tokens)]

  print()
  for q, a, s in zip(questions, answers, same):
    print(f'Q: {q}\nA: {a}' + ('' if s else '   (per sequence differs)'))
  per_token = model.config.kv_bytes_per_token(jnp.dtype(_DTYPE.value).itemsize)
  plan = pp.plan_prompts(forest, max_new_tokens=new).plan
  dense_tokens = len(questions) * (len(shared) + max(map(len, own)) + new)
  kv = {'tree': plan.kv_tokens * per_token, 'per sequence': dense_tokens * per_token}
  print(f'\n{"":14}{"compile s":>10}{"run s":>10}{"KV MiB":>9}')
  for name, (_, first_s, second_s) in runs.items():
    print(f'{name:14}{first_s - second_s:10.2f}{second_s:10.2f}{kv[name] / 2**20:9.2f}')
  print(f'({"the same text" if all(same) else "TEXT DIFFERS"} from both. run s: prefill and '
        'decode of every question, compiled; compile s: the first call\'s extra time (compiling, '
        'or loading the programs a former run kept); KV: every layer\'s K and V, the shared '
        'prompt stored once by the tree, once per question per sequence)')

  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, 'answers.json'), 'w') as f:
    json.dump(dict(questions=list(questions), answers=answers, same_text=all(same),
                   seconds={n: dict(first_call=r[1], second_call=r[2]) for n, r in runs.items()},
                   kv_bytes=kv), f, indent=1)
  if not all(same) and _DTYPE.value == 'float32':  # bfloat16 rounding may break a near-tie
    raise SystemExit('tree and per-sequence decoding gave different text in float32')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
