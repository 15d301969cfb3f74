r"""Greedy tokens under tensor and data parallelism equal one device's, on any backend.

Generates greedily from `--groups` shared-prefix prompt trees (independent sharing groups) with
the same random model on each mesh of `--meshes` and checks that every mesh gives the tokens of
the first. On two H200s:

  PYTHONPATH=. python -m experiments.tp_greedy_check --preset=codellama_7b --num_layers=4 \
      --meshes='none;tp:2' --impl=mosaic_gpu --workdir=workdir/tp_greedy
  PYTHONPATH=. python -m experiments.tp_greedy_check --preset=codellama_7b --num_layers=4 \
      --groups=3 --meshes='none;dp:2;dp:2,tp:2' --impl=mosaic_gpu --workdir=workdir/dp_greedy
  PYTHONPATH=. python -m experiments.tp_greedy_check --checkpoint=experiments/data/tiny_coder_h64 \
      --meshes='none;tp:2' --impl=mosaic_gpu --workdir=workdir/tp_greedy_trained

CPU (fake devices): XLA_FLAGS=--xla_force_host_platform_device_count=2 and --preset=tiny_gqa
--impl=xla. Writes results.jsonl (one record per mesh) and exits non-zero on a mismatch.

With --checkpoint (a folder written by `models.saved_params.save_params`, e.g. by
`experiments.train_tiny_coder`) the model is that trained one, restored into each mesh's shards,
and the prompts are the embedded APPS problems it learned (a few-shot prefix shared by
--samples rows under each problem): its greedy tokens have real margins, where a random model's
are often near-ties that rounding flips.

Where a row differs, the record says at which step and how close the reference's top two
log-probs were there (`first_difference`): a random model's top two logits are often within a
few bf16 ulps, and TP sums each projection in two halves before its all-reduce, so a margin
below ~0.05 is a near-tie flipped by rounding, a large one a real difference.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import cli
from experiments.benchmarking import markdown_table, report
from hydrajax.attention.parallel import parse_mesh
from models import sharding_rules as sr
from models.config import get_config
from models.generate import generate
from models.llama import init_model
from models.prompt_plan import prompt_node
from models.sampling import SamplingParams

_PRESET = flags.DEFINE_string('preset', 'tiny_gqa', 'model shape (models.config.PRESETS)')
_LAYERS = flags.DEFINE_integer('num_layers', 0, 'override the layer count (0: keep)')
_MESHES = flags.DEFINE_string('meshes', 'none;tp:2', "meshes to compare, ';'-separated (a mesh "
                              "itself may hold commas: 'none;dp:2,tp:2'); the first is the reference")
_IMPL = flags.DEFINE_string('impl', 'auto', 'attention implementation of decode')
_PREFIX = flags.DEFINE_integer('prefix_tokens', 1000, 'shared prompt length')
_SAMPLES = flags.DEFINE_integer('samples', 8, 'rows under each of the two problems')
_GROUPS = flags.DEFINE_integer('groups', 1, 'independent sharing groups (split over dp)')
_NEW = flags.DEFINE_integer('new_tokens', 32, 'greedy tokens per row')
_WORKDIR = cli.workdir_flag('tp_greedy_check')
_REDUCE = flags.DEFINE_enum('tp_reduce_dtype', 'float32', ['float32', 'bfloat16'],
                            'dtype of the all-reduces after wo and w_down with tp > 1')
_CHECKPOINT = flags.DEFINE_string(
    'checkpoint', '', 'a trained model written by models.saved_params.save_params (e.g. '
    'experiments/data/tiny_coder); prompts are then the APPS problems it learned and --preset, '
    '--num_layers and --prefix_tokens are ignored (default: random weights of --preset)')
cli.at_least(0, 'num_layers')
cli.at_least(1, 'prefix_tokens', 'samples', 'groups', 'new_tokens')


def first_differences(tokens, reference, top_logprobs, top_tokens):
  """Per differing row: the first differing step, the reference's top-2 log-prob margin there
  and whether the two tokens there are the reference's top two."""
  out = []
  for row in np.flatnonzero((tokens != reference).any(axis=1)):
    step = int(np.flatnonzero(tokens[row] != reference[row])[0])
    lp = top_logprobs[row, step]
    out.append(dict(row=int(row), step=step, margin=float(lp[0] - lp[1]),
                    swapped_top2=bool({int(tokens[row, step]), int(reference[row, step])}
                                      == set(int(t) for t in top_tokens[row, step, :2]))))
  return out


def _prompts(vocab: int):
  rng = np.random.default_rng(0)
  ids = lambda n: rng.integers(1, vocab, n).tolist()
  groups = []
  for _ in range(_GROUPS.value):
    problems = [prompt_node(ids(n), num_samples=_SAMPLES.value) for n in (37, 203)]
    groups.append(prompt_node(ids(_PREFIX.value), children=problems))
  return groups


def _learned_prompts():
  """Per group, the trained model's few-shot prefix over two of the APPS problems it learned."""
  from experiments import apps_workload as aw
  from hydrajax.evaluation import ByteTokenizer, load_problems
  tokenizer = ByteTokenizer()
  fewshot = load_problems(os.path.join(aw.DATA, 'apps_fewshot.jsonl'))[:1]
  fewshot = tokenizer.encode(aw.fewshot_text(fewshot))
  problems = load_problems(os.path.join(aw.DATA, 'apps_mini.jsonl'))
  if len(problems) < 2 * _GROUPS.value:
    raise app.UsageError(f'--groups={_GROUPS.value} needs {2 * _GROUPS.value} problems, the set '
                         f'has {len(problems)}')
  ids = [tokenizer.encode(aw.problem_prompt(p), add_bos=False) for p in problems]
  return [root for g in range(_GROUPS.value)
          for root in aw.prompt_forest(fewshot, ids[2 * g: 2 * g + 2], _SAMPLES.value, 'two_level')]


def _model(mesh, config):
  if not _CHECKPOINT.value:
    return init_model(config, mesh=mesh, dtype=jnp.bfloat16, tp_reduce_dtype=_REDUCE.value)
  from models.saved_params import restore_params
  model = restore_params(_CHECKPOINT.value, dtype=jnp.bfloat16, mesh=mesh)
  model.tp_reduce_dtype = jnp.dtype(_REDUCE.value)
  return model


def main(argv):
  del argv
  overrides = {'num_layers': _LAYERS.value} if _LAYERS.value else {}
  config = None if _CHECKPOINT.value else get_config(_PRESET.value, **overrides)
  prompts = _learned_prompts() if config is None else _prompts(config.vocab_size)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  records, reference = [], None
  sampling = SamplingParams(top_logprobs=2)
  for spec in [m.strip() for m in _MESHES.value.split(';') if m.strip()]:
    mesh = parse_mesh(spec)
    model = _model(mesh, config)
    out = generate(model, prompts, max_new_tokens=_NEW.value, impl=_IMPL.value,
                   sampling=sampling)
    tokens, lp = np.asarray(out.tokens), np.asarray(out.top_logprobs)
    if reference is None:
      reference, ref_lp, ref_top = tokens, lp, np.asarray(out.top_tokens)
    same = bool(np.array_equal(tokens, reference))
    diffs = first_differences(tokens, reference, ref_lp, ref_top)
    margins = sorted(d['margin'] for d in diffs)
    records.append(dict(mesh=spec, model=_CHECKPOINT.value or f'random {_PRESET.value}',
                        layers=model.config.num_layers,
                        impl=_IMPL.value, rows=int(tokens.shape[0]), new_tokens=_NEW.value,
                        identical_to_first=same,
                        rows_differing=int((tokens != reference).any(axis=1).sum()),
                        tp_reduce_dtype=_REDUCE.value, first_difference=diffs,
                        max_margin_at_difference=margins[-1] if margins else None,
                        smallest_margin=float(np.min(lp[..., 0] - lp[..., 1])),
                        device=jax.devices()[0].device_kind))
    logging.info('%s', records[-1])
  with open(os.path.join(_WORKDIR.value, 'results.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  report.write_workdir_readme(_WORKDIR.value, 'Greedy tokens across meshes', markdown_table(
      records, [('mesh', 'mesh'), ('identical to the first mesh', 'identical_to_first'),
                ('rows differing', 'rows_differing'), ('largest margin where they part',
                                                       'max_margin_at_difference'),
                ('smallest top-2 margin of its own tokens', 'smallest_margin')]))
  if not all(r['identical_to_first'] for r in records):
    raise SystemExit('greedy tokens differ between meshes: see results.jsonl')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
