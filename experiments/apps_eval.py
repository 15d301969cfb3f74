r"""APPS evaluation with hierarchical prompt sharing (Hydragen section 4.4, figure 7).

Every sequence's prompt is [few-shot examples][problem statement]; each problem is sampled n
times. Three sharing modes of the same work run in one invocation (experiments/apps_workload.py):
no_sharing, one_level (few-shot shared), two_level (few-shot and problem shared). For each mode:
the largest number of problems per batch whose KV fits --memory_budget_gb (computed from the
layout's KV tokens), then the whole problem set in batches of that size: total time (prefill +
decode), decode tok/s, peak KV bytes. two_level also runs at one_level's batch ("matched": the
attention-only gain, as the paper separates it). Generated programs are checked in the sandbox
(hydrajax.evaluation) and pass@k reported. Writes results.jsonl, table.md, time.png, kv.png and
README.md to --workdir, and each setting's samples (samples/<setting>.npy): with --resume a run
with the same flags keeps the settings that ran there and runs the rest.

Default (CPU, a few minutes): the tiny byte-level Llama trained on the embedded problems
(experiments/train_tiny_coder.py; it memorised their solutions, so pass@k measures the path,
not a model); the first batch of each setting runs and the total is extrapolated (two_level holds
every problem in one batch: its samples are checked); --time_batches=0 runs every batch:

  python -m experiments.apps_eval            # writes workdir/apps_eval

Validate the harness on a dataset's own solutions (as the APPS authors did):

  python -m experiments.apps_eval --check_solutions --problems=/path/to/APPS/test

A local HF checkpoint (e.g. CodeLlama-7b-Python-hf) on real APPS problems:

  python -m experiments.apps_eval --checkpoint=/models/CodeLlama-7b-hf --problems=APPS/test \
      --difficulty=introductory --num_problems=120 --samples=128 --new_tokens=512 \
      --fewshot_examples=2

Paper scale on one H200 (CodeLlama-7B shape, random weights: timing only; 120 problems x 128
samples x 512 new tokens, a 2.4K-token few-shot prompt, 400-token problems; the first batch of
each setting is timed and the total extrapolated, --time_batches):

  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  python -m experiments.apps_eval --model=random --preset=codellama_7b --num_problems=120 \
      --samples=128 --new_tokens=512 --fewshot_tokens=2400 --problem_tokens=400 \
      --time_batches=1 --impl=auto --workdir=workdir/apps_eval_h200
"""

import dataclasses
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import apps_workload as aw
from experiments import cli
from hydrajax import AttentionImpl
from experiments.benchmarking import (
    JsonlWriter, markdown_table, plot_bars, progress, resume_records, write_workdir_readme)
from hydrajax.evaluation import (
    ByteTokenizer, CheckConfig, SandboxLimits, check_programs, isolation, load_problems,
    mean_pass_at_k,
)
from models.sampling import SamplingParams

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')

FLAGS = flags.FLAGS
flags.DEFINE_string('problems', os.path.join(DATA, 'apps_mini.jsonl'),
                    'APPS problems: a JSONL file, or a folder (the release layout or *.jsonl)')
flags.DEFINE_string('fewshot', os.path.join(DATA, 'apps_fewshot.jsonl'),
                    'few-shot examples (APPS records with a solution)')
flags.DEFINE_integer('fewshot_examples', 1, 'how many few-shot examples the prompt holds')
flags.DEFINE_string('difficulty', '', 'keep only this APPS difficulty (empty: all)')
flags.DEFINE_integer('num_problems', 0, 'problems to run (0: all; more than the file holds '
                     'cycles through them again, for timing)')
flags.DEFINE_integer('samples', 8, 'samples per problem n')
flags.DEFINE_integer('new_tokens', 256, 'tokens generated per sample (fewer after EOS)')
flags.DEFINE_enum('model', 'tiny_coder', ['tiny_coder', 'random', 'hf'],
                  'tiny_coder: the trained byte-level model; random: random weights of --preset '
                  '(timing only); hf: --checkpoint')
flags.DEFINE_string('tiny_checkpoint', os.path.join(DATA, 'tiny_coder'),
                    'the tiny model (experiments/train_tiny_coder.py)')
flags.DEFINE_string('checkpoint', '', 'a .gguf file or a local HF Llama folder (implies '
                    '--model=hf)')
flags.DEFINE_string('preset', 'codellama_7b', 'model shape for --model=random')
flags.DEFINE_integer('fewshot_tokens', 0, 'pad/cut the few-shot prompt to this many tokens '
                     '(0: as written); timing runs use the paper\'s ~2400')
flags.DEFINE_integer('problem_tokens', 0, 'pad/cut every problem prompt to this many tokens '
                     '(0: as written)')
flags.DEFINE_float('temperature', 0.8, 'sampling temperature')
flags.DEFINE_float('top_p', 0.95, 'nucleus sampling')
flags.DEFINE_integer('seed', 0, 'sampling seed')
flags.DEFINE_list('modes', list(aw.MODES), 'sharing modes to run')
flags.DEFINE_enum('impl', 'auto', [i.value for i in AttentionImpl], 'decode attention')
flags.DEFINE_float('memory_budget_gb', 0.0, 'KV memory budget (0: the device\'s memory minus the '
                   'weights, less 15%; 0.03 GiB on CPU)')
flags.DEFINE_integer('max_batch_problems', 0, 'cap on problems per batch (0: none)')
flags.DEFINE_integer('time_batches', 1, 'batches run per setting (0: all); the total is '
                     'extrapolated from them (each batch of a new shape compiles: most of a CPU '
                     'run\'s time); pass@k needs a setting whose batches all ran')
flags.DEFINE_enum('check', 'auto', ['auto', 'true', 'false'],
                  'check generated programs (auto: unless --model=random)')
flags.DEFINE_bool('check_solutions', False, 'check each record\'s own solutions instead of '
                  'generating')
flags.DEFINE_float('test_timeout_s', 4.0, 'per-test timeout of the checker (APPS uses 4)')
flags.DEFINE_integer('check_workers', 2, 'programs checked at once')
flags.DEFINE_list('k', ['1', '2', '4', '8'], 'pass@k values reported (k <= samples)')
flags.DEFINE_integer('prefill_chunk', 2048, 'prefill tokens per node per model call')
WORKDIR = cli.workdir_flag('apps_eval')
flags.DEFINE_bool('resume', False, 'keep the settings of --workdir/results.jsonl that ran with '
                  'these flags (and their saved samples) and run the rest; the check runs again')
cli.at_least(1, 'samples', 'new_tokens', 'prefill_chunk', 'check_workers')
cli.at_least(0, 'fewshot_examples', 'num_problems', 'fewshot_tokens', 'problem_tokens',
             'temperature', 'memory_budget_gb', 'max_batch_problems', 'time_batches')
cli.at_least(0.001, 'test_timeout_s')
cli.int_list('k', 1)
cli.choices('modes', aw.MODES)
flags.register_validator('top_p', lambda v: 0 < v <= 1, message='must be in (0, 1]')
flags.register_validator('problems', os.path.exists, message='no such file or folder')
flags.register_validator('fewshot', os.path.exists, message='no such file')
cli.check_flags(['model', 'checkpoint', 'tiny_checkpoint'], lambda f: (
    '--model=hf needs --checkpoint' if f['model'] == 'hf' and not f['checkpoint'] else
    f'--checkpoint={f["checkpoint"]} does not exist'
    if f['checkpoint'] and not os.path.exists(f['checkpoint']) else
    f'--tiny_checkpoint={f["tiny_checkpoint"]} does not exist: run python -m '
    'experiments.train_tiny_coder first' if f['model'] == 'tiny_coder' and not f['checkpoint']
    and not os.path.exists(f['tiny_checkpoint']) else None))


def _load_model():
  from models import saved_params
  if FLAGS.checkpoint or FLAGS.model == 'hf':
    from models.checkpoint import load_checkpoint
    from models.tokenizer import Tokenizer
    if not FLAGS.checkpoint:
      raise app.UsageError('--model=hf needs --checkpoint')
    model, tokenizer = load_checkpoint(FLAGS.checkpoint, dtype=jnp.bfloat16)
    return model, tokenizer or Tokenizer.from_file(FLAGS.checkpoint), 'hf:' + FLAGS.checkpoint
  if FLAGS.model == 'tiny_coder':
    if not os.path.exists(FLAGS.tiny_checkpoint):
      raise app.UsageError(f'no tiny model at {FLAGS.tiny_checkpoint}: run '
                           'python -m experiments.train_tiny_coder first')
    model = saved_params.restore_params(FLAGS.tiny_checkpoint, dtype=jnp.float32)
    return model, ByteTokenizer(), 'tiny_coder'
  from models.config import get_config
  from models.llama import Llama
  config = get_config(FLAGS.preset)
  model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  return model, ByteTokenizer(), f'random:{FLAGS.preset}'


def _budget_bytes(model) -> int:
  if FLAGS.memory_budget_gb:
    return int(FLAGS.memory_budget_gb * 2**30)
  if jax.default_backend() == 'cpu':
    return int(0.03 * 2**30)
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get('bytes_limit', 16 * 2**30)
  params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return int(0.85 * (limit - params))


def _problems():
  problems = load_problems(FLAGS.problems, difficulty=FLAGS.difficulty or None)
  if not problems:
    raise app.UsageError(f'no problems in {FLAGS.problems} (difficulty={FLAGS.difficulty!r})')
  n = FLAGS.num_problems or len(problems)
  out = []
  for i in range(n):  # cycle, with fresh ids past the first pass
    p = problems[i % len(problems)]
    out.append(p if i < len(problems) else dataclasses.replace(
        p, problem_id=f'{p.problem_id}#{i // len(problems)}'))
  return out


def check_solutions_main():
  problems = load_problems(FLAGS.problems, difficulty=FLAGS.difficulty or None)
  if FLAGS.num_problems:
    problems = problems[:FLAGS.num_problems]
  config = _check_config()
  logging.info('sandbox: %s', isolation())
  writer = JsonlWriter(os.path.join(FLAGS.workdir, 'solutions.jsonl'))
  rows = []
  total = sum(len(p.solutions) for p in problems)
  with _bar(total, 'check solutions') as bar:
    for p in problems:
      report = check_programs(p, p.solutions, config, progress=bar.update)
      row = dict(problem_id=p.problem_id, solutions=len(p.solutions), **report.counts())
      rows.append(row)
      writer.append(row)
  with_solutions = [r for r in rows if r['solutions']]
  all_pass = sum(r['passed'] == r['solutions'] for r in with_solutions)
  summary = (f'{len(problems)} problems, {sum(r["solutions"] for r in rows)} solutions, '
             f'{sum(r["passed"] for r in rows)} pass; {all_pass}/{len(with_solutions)} problems '
             f'with every solution passing; {sum(r["error"] for r in rows)} programs could not be '
             'judged (error)')
  table = markdown_table(rows, [('problem', 'problem_id'), ('solutions', 'solutions'),
                                ('passed', 'passed'), ('failed', 'failed'),
                                ('timed out', 'timed_out'), ('runtime error', 'runtime_error'),
                                ('compile error', 'compile_error'),
                                ('output too large', 'output_too_large'),
                                ('not judged', 'error')])
  _write_readme('APPS harness check on the records\' own solutions', writer.meta,
                summary + '\n\n' + table)
  with open(os.path.join(FLAGS.workdir, 'table.md'), 'w') as f:
    f.write(summary + '\n\n' + table)
  print(summary)


class _bar:
  def __init__(self, total, desc):
    from tqdm import tqdm
    self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)

  def __enter__(self):
    return self.bar

  def __exit__(self, *exc):
    self.bar.close()


def _check_config() -> CheckConfig:
  return CheckConfig(test_timeout_s=FLAGS.test_timeout_s, workers=FLAGS.check_workers,
                     limits=SandboxLimits())


def _settings(max_batch, num_problems):
  """(name, mode, problems per batch) in run order; two_level also at one_level's batch."""
  cap = FLAGS.max_batch_problems or num_problems
  out = []
  for mode in FLAGS.modes:
    out.append((mode, mode, min(max_batch[mode], cap, num_problems)))
  if 'two_level' in FLAGS.modes and 'one_level' in FLAGS.modes:
    matched = min(max_batch['one_level'], cap, num_problems)
    if 0 < matched != min(max_batch['two_level'], cap, num_problems):
      out.append(('two_level_matched', 'two_level', matched))
  return out


def main(argv):
  del argv
  os.makedirs(FLAGS.workdir, exist_ok=True)
  if FLAGS.check_solutions:
    return check_solutions_main()
  for mode in FLAGS.modes:
    if mode not in aw.MODES:
      raise app.UsageError(f'--modes: {mode!r} is not one of {aw.MODES}')
  ks = sorted({int(k) for k in FLAGS.k if int(k) <= FLAGS.samples})
  model, tokenizer, model_name = _load_model()
  problems = _problems()
  fewshot = load_problems(FLAGS.fewshot)[:FLAGS.fewshot_examples]
  fewshot_ids = aw.pad_tokens(tokenizer.encode(aw.fewshot_text(fewshot)), FLAGS.fewshot_tokens)
  problem_ids = [aw.pad_tokens(tokenizer.encode(aw.problem_prompt(p), add_bos=False),
                               FLAGS.problem_tokens) for p in problems]
  itemsize = jnp.dtype(model.dtype).itemsize
  per_token = model.config.kv_bytes_per_token(itemsize)
  budget = _budget_bytes(model)
  lens = [len(p) for p in problem_ids]
  max_batch = {m: aw.max_problems(m, len(fewshot_ids), lens, FLAGS.samples, FLAGS.new_tokens,
                                  per_token, budget) for m in aw.MODES}
  logging.info('model %s, %d problems x %d samples, few-shot %d tokens, problems %d-%d tokens; '
               'KV budget %.2f GiB -> max problems per batch %s', model_name, len(problems),
               FLAGS.samples, len(fewshot_ids), min(lens), max(lens), budget / 2**30, max_batch)
  sampling = SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p)
  stops = () if FLAGS.model == 'random' and not FLAGS.checkpoint else tokenizer.eos_ids
  impl = FLAGS.impl
  path = os.path.join(FLAGS.workdir, 'results.jsonl')
  run_key = dict(samples=FLAGS.samples, problems=len(problems), new_tokens=FLAGS.new_tokens,
                 model=model_name, fewshot_tokens=len(fewshot_ids),
                 mean_problem_tokens=float(np.mean(lens)), budget_bytes=budget, impl=impl,
                 time_batches=FLAGS.time_batches, seed=FLAGS.seed)
  records = resume_records(path, _kept(run_key) if FLAGS.resume else None)
  writer = JsonlWriter(path)
  kept = {r['setting']: r for r in records}
  if kept:
    logging.info('resuming: settings %s kept', sorted(kept))
  samples_for_check = None
  for name, mode, batch in _settings(max_batch, len(problems)):
    base = dict(setting=name, mode=mode, batch_problems=batch, max_batch_problems=max_batch[mode],
                **run_key)
    if name in kept:
      tokens = _load_samples(name)
      if tokens is not None and samples_for_check is None and (
          mode == 'two_level' or name == FLAGS.modes[-1]):
        samples_for_check = tokens
      continue
    if batch == 0:
      need = aw.kv_tokens(mode, len(fewshot_ids), lens[:1], FLAGS.samples, FLAGS.new_tokens)
      r = dict(base, status='does_not_fit', kv_bytes_one_problem=need * per_token)
      logging.info('%s: one problem needs %.2f GiB of KV > budget: not run', name,
                   need * per_token / 2**30)
    else:
      r, tokens = _run_setting(model, mode, batch, fewshot_ids, problem_ids, sampling, stops,
                               impl, per_token)
      r = dict(base, **r)
      if tokens is not None:
        _save_samples(name, tokens)
      if tokens is not None and mode == 'two_level' and samples_for_check is None:
        samples_for_check = tokens
      elif tokens is not None and samples_for_check is None and name == FLAGS.modes[-1]:
        samples_for_check = tokens
    records.append(r)
    writer.append(r)
  check = FLAGS.check == 'true' or (FLAGS.check == 'auto' and FLAGS.model != 'random')
  summary = {}
  if check and samples_for_check is None:
    logging.warning('no setting ran all its batches (--time_batches=%d): programs not checked, '
                    'no pass@k; --time_batches=0 runs them all', FLAGS.time_batches)
  if check and samples_for_check is not None:
    summary = _check(problems, samples_for_check, tokenizer, ks, writer)
  _finish(records, summary, writer.meta, model_name)


def _samples_path(setting: str) -> str:
  return os.path.join(FLAGS.workdir, 'samples', f'{setting}.npy')


def _save_samples(setting: str, tokens) -> None:
  os.makedirs(os.path.dirname(_samples_path(setting)), exist_ok=True)
  np.save(_samples_path(setting), np.asarray(tokens))


def _load_samples(setting: str):
  return np.load(_samples_path(setting)) if os.path.exists(_samples_path(setting)) else None


def _kept(run_key: dict):
  """Which records of an earlier run a resumed one keeps: settings that ran or did not fit with
  the same flags (`run_key`); not the check's rows, which the resumed run writes again."""
  def keep(r) -> bool:
    return (r.get('setting') is not None and r.get('status') in ('ok', 'does_not_fit')
            and all(r.get(k) == v for k, v in run_key.items()))
  return keep


def _run_setting(model, mode, batch, fewshot_ids, problem_ids, sampling, stops, impl, per_token):
  """All batches of one setting: (record, tokens [problems * samples, M] or None if partial)."""
  starts = list(range(0, len(problem_ids), batch))
  timed = starts[:FLAGS.time_batches] if FLAGS.time_batches else starts

  def one(start):
    forest = aw.prompt_forest(fewshot_ids, problem_ids[start:start + batch], FLAGS.samples, mode)
    return aw.run_batch(model, forest, max_new_tokens=FLAGS.new_tokens, sampling=sampling,
                        seed=FLAGS.seed + start, stop_tokens=stops, impl=impl,
                        prefill_chunk=FLAGS.prefill_chunk, warm_prefill=start == timed[0])

  runs, outputs = [], []
  began = time.perf_counter()
  for start in progress(timed, total=len(timed), desc=f'generate {mode} x{batch}'):
    run = one(start)
    runs.append(run)
    outputs.append(run.tokens)
  wall_s = time.perf_counter() - began
  scale = len(starts) / len(timed)
  prefill_s = sum(r.prefill_s for r in runs)
  decode_s = sum(r.decode_s for r in runs)
  generated = int(sum(r.lengths.sum() for r in runs))
  peak_kv = max(r.kv_tokens for r in runs) * per_token
  stats = jax.devices()[0].memory_stats() or {}
  record = dict(
      status='ok', batches=len(starts), batches_timed=len(timed),
      total_s=(prefill_s + decode_s) * scale, decode_s_total=decode_s * scale,
      prefill_s_total=prefill_s * scale, compile_s=sum(r.compile_s for r in runs),
      wall_s=wall_s, decode_tokens_per_s=generated / decode_s,
      generated_tokens_timed=generated, peak_kv_bytes=peak_kv,
      rows_per_batch=batch * FLAGS.samples,
      device_peak_bytes=stats.get('peak_bytes_in_use'), extrapolated=scale != 1.0)
  logging.info('%s x%d: %.2f s steady (%s), %.2f s compiling, decode %.0f tok/s, peak KV '
               '%.3f GiB', mode, batch, record['total_s'],
               'extrapolated' if scale != 1 else 'measured', record['compile_s'],
               record['decode_tokens_per_s'], peak_kv / 2**30)
  tokens = np.concatenate(outputs) if scale == 1.0 else None
  return record, tokens


def _check(problems, tokens, tokenizer, ks, writer):
  n = FLAGS.samples
  config = _check_config()
  counts, per_problem = [], []
  status_totals = {}
  logging.info('sandbox: %s', isolation())
  with _bar(len(problems) * n, 'check programs') as bar:
    for i, p in enumerate(problems):
      programs = [aw.program_from_completion(tokenizer.decode(t)) for t in tokens[i * n:(i + 1) * n]]
      report = check_programs(p, programs, config, progress=bar.update)
      counts.append((n, report.num_correct))
      c = report.counts()
      for key, v in c.items():
        status_totals[key] = status_totals.get(key, 0) + v
      row = dict(kind='check', problem_id=p.problem_id, correct=report.num_correct, samples=n,
                 call_based=p.call_based, **c, example=programs[0][:300])
      per_problem.append(row)
      writer.append(row)
  summary = dict(kind='pass_at_k', problems=len(problems), samples=n,
                 solved=sum(c > 0 for _, c in counts),
                 **{f'pass@{k}': mean_pass_at_k(counts, k) for k in ks}, statuses=status_totals)
  writer.append(summary)
  summary['per_problem'] = per_problem
  return summary


def _finish(records, summary, meta, model_name):
  columns = [
      ('setting', 'setting'), ('problems/batch', 'batch_problems'),
      ('max problems (budget)', 'max_batch_problems'), ('rows/batch', 'rows_per_batch'),
      ('status', 'status'), ('total s (steady)', 'total_s'), ('decode s', 'decode_s_total'),
      ('prefill s', 'prefill_s_total'), ('compile s (apart)', 'compile_s'),
      ('wall s', 'wall_s'), ('decode tok/s', 'decode_tokens_per_s'),
      ('peak KV GiB', lambda r: r.get('peak_kv_bytes') and r['peak_kv_bytes'] / 2**30),
      ('batches (timed)', lambda r: r.get('batches') and f'{r["batches"]} ({r["batches_timed"]})'),
      ('extrapolated', 'extrapolated'),
  ]
  ok = {r['setting']: r for r in records if r.get('status') == 'ok'}
  lines = []
  if 'one_level' in ok and 'two_level' in ok:
    one, two = ok['one_level']['total_s'], ok['two_level']['total_s']
    d1, d2 = ok['one_level']['decode_s_total'], ok['two_level']['decode_s_total']
    lines.append(f'two_level vs one_level (each at its max batch): {100 * (1 - two / one):.1f}% '
                 f'less steady-state time, {100 * (1 - d2 / d1):.1f}% less decode time (paper: '
                 '55%); compiling, apart: '
                 + ', '.join(f'{n} {r["compile_s"]:.1f} s' for n, r in ok.items()))
    if 'two_level_matched' in ok:
      m = ok['two_level_matched']['total_s']
      dm = ok['two_level_matched']['decode_s_total']
      lines.append(f'two_level at one_level\'s batch: {100 * (1 - m / one):.1f}% less steady '
                   f'time, {100 * (1 - dm / d1):.1f}% less decode time (paper: 18%)')
  first = records[0]
  head = (f'model {model_name}; {first["problems"]} problems x {first["samples"]} samples x '
          f'{first["new_tokens"]} new tokens; few-shot {first["fewshot_tokens"]} tokens, '
          f'problems {first["mean_problem_tokens"]:.0f} tokens on average; KV budget '
          f'{first["budget_bytes"] / 2**30:.3g} GiB; decode impl {first["impl"]}')
  text = head + '\n\n' + markdown_table(records, columns)
  if lines:
    text += '\n' + '\n'.join(f'- {l}' for l in lines) + '\n'
  if summary:
    ks = [k for k in summary if k.startswith('pass@')]
    text += ('\n## Checked programs (samples of the two_level run)\n\n'
             f'{summary["solved"]}/{summary["problems"]} problems solved by at least one sample; '
             + ', '.join(f'{k} = {summary[k]:.3f}' for k in ks if summary[k] is not None)
             + f'; verdicts: {summary["statuses"]}\n\n'
             + markdown_table(summary['per_problem'],
                              [('problem', 'problem_id'), ('call-based', 'call_based'),
                               ('correct', 'correct'), ('of', 'samples'),
                               ('failed', 'failed'), ('timed out', 'timed_out'),
                               ('runtime error', 'runtime_error'),
                               ('compile error', 'compile_error'),
                               ('output too large', 'output_too_large'),
                               ('not judged', 'error')]))
  with open(os.path.join(FLAGS.workdir, 'table.md'), 'w') as f:
    f.write(text)
  _plot_time(records, os.path.join(FLAGS.workdir, 'time.png'))
  _plot_kv(records, first['budget_bytes'], os.path.join(FLAGS.workdir, 'kv.png'))
  _write_readme('APPS evaluation with hierarchical prompt sharing', meta, text)
  print(text)


def _plot_time(records, path):
  """Stacked bars a setting: steady-state prefill and decode, then the compile time apart."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  ok = [r for r in records if r.get('status') == 'ok']
  names = [r['setting'] for r in ok]
  prefill = np.array([r['prefill_s_total'] for r in ok])
  decode = np.array([r['decode_s_total'] for r in ok])
  compile_s = np.array([r.get('compile_s', 0.0) for r in ok])
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.bar(names, prefill, label='prefill (steady)', color='tab:blue')
  ax.bar(names, decode, bottom=prefill, label='decode (steady)', color='tab:orange')
  ax.bar(names, compile_s, bottom=prefill + decode, label='compiling (apart)', color='lightgrey',
         hatch='//', edgecolor='grey')
  for x, steady in enumerate(prefill + decode):
    ax.annotate(f'{steady:.1f} s', (x, steady), ha='center', va='bottom', fontsize=8)
  ax.set_ylabel('seconds, whole problem set')
  ax.set_title('APPS evaluation time by sharing mode (labels: steady state)')
  ax.legend(fontsize=8)
  ax.grid(True, axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _plot_kv(records, budget_bytes, path):
  """Left: problems a batch holds under the KV budget. Right: a batch's peak KV against the
  budget (labelled): every mode fills it, sharing fits more problems into it."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  names = [r['setting'] for r in records]
  per_batch = [r.get('batch_problems', 0) for r in records]
  peak = [(r.get('peak_kv_bytes') or 0) / 2**30 for r in records]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
  left.bar(names, per_batch, color='tab:green')
  for x, n in enumerate(per_batch):
    left.annotate(str(n), (x, n), ha='center', va='bottom', fontsize=8)
  left.set_ylabel('problems per batch')
  left.set_title('problems that fit the KV budget')
  right.bar(names, peak, color='tab:purple', label='peak KV of a batch')
  right.axhline(budget_bytes / 2**30, color='k', ls='--', lw=1,
                label=f'KV budget ({budget_bytes / 2**30:.3g} GiB)')
  right.set_ylabel('GiB')
  right.set_title('peak KV per batch')
  right.legend(fontsize=8, loc='lower right')
  for ax in (left, right):
    ax.tick_params(axis='x', labelrotation=30, labelsize=8)
    ax.grid(True, axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _write_readme(title, meta, body):
  notes = ''
  if FLAGS.model == 'tiny_coder' and not FLAGS.checkpoint and not FLAGS.check_solutions:
    notes = ('\nThe tiny model memorised the embedded problems\' solutions (trained on them by '
             'experiments/train_tiny_coder.py): pass@k here shows that sampling, tree decoding, '
             'byte decoding, the sandbox and the estimator work end to end, not that a model '
             'can code.\n')
  if FLAGS.time_batches:
    notes += (f'\nOnly the first {FLAGS.time_batches} batch(es) of each setting ran; totals are '
              'that time times the number of batches.\n')
  about = ('Steady-state time is prefill + decode of every batch, compiles taken out: JAX\'s '
           'compile events inside the timed windows are subtracted (a later batch of a new prompt '
           'shape compiles its prefill), decode runs one untimed step first. Compile time is '
           'reported apart (compile s), and wall s is the whole setting as it ran. Files: '
           'results.jsonl (one record per setting, then per-problem checks and pass@k), table.md, '
           'time.png (steady prefill and decode, compiling stacked apart), kv.png (problems per '
           'batch under the budget; peak KV against the labelled budget).\n')
  write_workdir_readme(FLAGS.workdir, title, about + notes + '\n' + body, meta=meta)


if __name__ == '__main__':
  cli.run(main, workdir=WORKDIR)
