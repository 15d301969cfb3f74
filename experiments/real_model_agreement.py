"""Greedy agreement of a real model in bf16 with its float32 reference, and why they part.

    python -m experiments.real_model_agreement                       # SmolLM2, CPU: XLA only
    python -m experiments.real_model_agreement --impls=mosaic_gpu,xla --questions=64 \
        --new_tokens=64                                              # a Hopper GPU

Every question shares one few-shot prompt (a prompt tree: the prompt once, the questions below
it). The reference decodes greedily in float32 with per-sequence dense caches and records the
top-2 log-probs of every position. Each implementation then decodes the same tree in each of
`--dtypes` (bf16, and float32 as an exactness check; float16 keeps 3 more mantissa bits than
bf16 in a narrower range). Where a bf16 sequence first differs from the reference, the
reference's margin there (top-1 minus top-2 log-prob) says how close the float32 model itself
was to a tie: bf16 rounding may flip a near tie, never a clear choice. The target is no
divergence where the margin exceeds `--margin` (0.1). The margin error is how far an
implementation moves that top-2 margin where its sequence still follows the reference (the same
context, the same two leading tokens): the noise a greedy choice has to survive, comparable
between implementations of one dtype.

Writes agreement.jsonl (a record an implementation and dtype), divergences.jsonl (one a first
divergence), table.md and margins.png to --workdir.
"""

import json
import os
import time

from absl import flags
import jax
import jax.numpy as jnp

import hydrajax as hj
from experiments import agreement_metrics, cli
from experiments.qa_prompts import FEWSHOT, QUESTIONS
from models import generate as gen
from models import prompt_plan as pp
from models import pretrained
from models.checkpoint import load_checkpoint
from models.llama import ModelMode
from models.sampling import SamplingParams

_CHECKPOINT = flags.DEFINE_string('checkpoint', '', 'a .gguf file or an HF folder (default: '
                                  'SmolLM2-135M-Instruct, fetched by `make model`)')
_QUESTIONS = flags.DEFINE_integer('questions', 16, f'questions (1 to {len(QUESTIONS)})',
                                  lower_bound=1, upper_bound=len(QUESTIONS))
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 32, 'tokens decoded per question (no stop)',
                                   lower_bound=1)
_IMPLS = flags.DEFINE_list('impls', ['xla'], 'tree attention implementations compared')
_DTYPES = flags.DEFINE_list('dtypes', ['float32', 'bfloat16'], 'dtypes each implementation '
                            'decodes in (float32 is the exactness check)')
_MARGIN = flags.DEFINE_float('margin', 0.1, 'a divergence where the float32 top-2 margin is '
                             'above this counts against the target', lower_bound=0.0)
_WORKDIR = cli.workdir_flag('real_model_agreement')
cli.choices('impls', [i.value for i in hj.AttentionImpl])
cli.choices('dtypes', ['float32', 'bfloat16', 'float16'])


def _load(dtype):
  if _CHECKPOINT.value:
    model, tokenizer = load_checkpoint(_CHECKPOINT.value, dtype=dtype)
    if tokenizer is None:
      raise SystemExit(f'--checkpoint={_CHECKPOINT.value} has no tokenizer')
    return model, tokenizer
  return pretrained.load_smollm2(dtype=dtype)


def _decode(model, forest, new, impl, *, top: int = 0):
  sampling = SamplingParams(top_logprobs=top) if top else SamplingParams()
  run = lambda: gen.generate(model, forest, max_new_tokens=new, impl=impl, sampling=sampling)
  start = time.perf_counter()
  run()  # compiles
  compiled = time.perf_counter() - start
  start = time.perf_counter()
  out = run()
  return out, compiled, time.perf_counter() - start


def _plot(margins: dict[str, list[float]], threshold: float, path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, values in margins.items():
    if values:
      ax.hist(values, bins=30, alpha=0.6, label=f'{name} ({len(values)} divergences)')
  ax.axvline(threshold, color='k', ls='--', label=f'target: none above {threshold:g}')
  ax.set_xlabel('float32 top-1 minus top-2 log-prob at the first divergence')
  ax.set_ylabel('sequences')
  ax.set_title('Where greedy decoding first leaves the float32 reference')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  questions = QUESTIONS[:_QUESTIONS.value]
  new = _NEW_TOKENS.value
  f32_model, tokenizer = _load(jnp.float32)
  shared = tokenizer.encode(FEWSHOT)
  own = [tokenizer.encode(f'Question: {q}\nAnswer:', add_bos=False) for q in questions]
  forest = [pp.prompt_node(shared, [pp.prompt_node(ids) for ids in own])]
  print(f'{len(questions)} questions after a {len(shared)}-token shared prompt, {new} tokens '
        f'each; backend {jax.default_backend()}', flush=True)

  print('reference: float32, dense per-sequence caches ...', flush=True)
  ref, _, _ = _decode(f32_model, forest, new, ModelMode.DENSE, top=2)

  records, divergences, margins = [], [], {}
  models = {'float32': f32_model}
  for dtype in _DTYPES.value:
    if dtype not in models:
      models[dtype] = _load(jnp.dtype(dtype))[0]
    for impl in _IMPLS.value:
      name = f'{impl} {dtype}'
      print(f'{name} ...', flush=True)
      try:
        out, compile_s, decode_s = _decode(models[dtype], forest, new, impl, top=2)
      except ValueError as e:  # a kernel without this dtype (Mosaic GPU: bf16 and f16 only)
        if 'does not support these inputs' not in str(e):
          raise
        records.append(dict(impl=impl, dtype=dtype, unsupported=str(e)))
        print(f'  not run: {e}', flush=True)
        continue
      fields, at = agreement_metrics.compare(out, ref, _MARGIN.value)
      margins[name] = [m for _, _, m in at]
      records.append(dict(impl=impl, dtype=dtype, **fields, compile_s=compile_s,
                          decode_s=decode_s, backend=jax.default_backend(),
                          device=str(jax.devices()[0])))
      for r, i, m in at:
        divergences.append(dict(impl=impl, dtype=dtype, question=questions[r], position=i,
                                margin=m, reference=tokenizer.decode(ref.tokens[r, :i + 1]),
                                got=tokenizer.decode(out.tokens[r, :i + 1])))
      print(f'  {fields["identical"]}/{fields["sequences"]} identical; {len(at)} diverge, '
            f'{fields["over_margin"]} where the float32 margin > {_MARGIN.value:g}', flush=True)

  with open(os.path.join(_WORKDIR.value, 'agreement.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  with open(os.path.join(_WORKDIR.value, 'divergences.jsonl'), 'w') as f:
    f.writelines(json.dumps(d) + '\n' for d in divergences)
  table = agreement_metrics.table(records)
  with open(os.path.join(_WORKDIR.value, 'table.md'), 'w') as f:
    f.write(table)
  _plot({k: v for k, v in margins.items() if 'float32' not in k}, _MARGIN.value,
        os.path.join(_WORKDIR.value, 'margins.png'))
  print('\n' + table)
  print('A greedy choice can flip only where the float32 model was near a tie: the margin at each '
        'first divergence says how near. The margin error (where a row still follows the '
        'reference) is how far an implementation moves that margin.')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
