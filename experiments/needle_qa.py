r"""Long-document question answering: many questions share one document (Hydragen 4.3, fig. 6).

A synthetic document (hydrajax/evaluation/needle.py: seeded filler with planted facts "The dog
named X has fur that is C.", five few-shot Q/A examples at its end) is the shared prefix; Q
questions are answered in one batch. For each Q: decode time of

  tree          the document stored once, every question's tokens private (Hydragen)
  no_sharing    every question stores and reads its own copy of the document (run where it fits
                --memory_budget_gb)
  no_attention  the tree cache and every projection without the attention product (ceiling)

Decode time is measured after one warm-up step (compiles) and scaled to --new_tokens; prefill of
the document is excluded, as in the paper, and reported apart. The document is prefilled once, at
the first tree point, and its KV copied into every later tree and no-attention cache (its prefill
does not depend on Q; a 20K-token prefill per point was most of an H200 run's time). Greedy answers of tree and
no_sharing are compared token for token at every Q where both ran, and their accuracy reported.
Writes results.jsonl, table.md, time_vs_questions.png and README.md to --workdir, and each
point's answers (answers/<mode>_q<Q>.npy). `--resume` keeps the points of an earlier run in the
same --workdir (with the same model and document) and runs only the rest, so a sweep cut by a
time limit goes on where it stopped; the token-identity check then also compares with the answers
kept.

CPU default (--smoke, the default on a CPU): SmolLM2-135M-Instruct, the real model fetched once by
`make model` (models.pretrained), in float32 on a 1K-token document, Q = 1 and 8 (several
minutes: each point compiles the 30-layer model's programs).
Its accuracy is printed with what it means (chance is 1 in 10: ten colours):

  python -m experiments.needle_qa                # writes workdir/needle_qa

Paper scale on one H200 (random weights of Yi-6B's shape: Llama-2-7B with 4 KV heads and a 64K
vocabulary; a 20K-token document; Q = 1..1024; no sharing up to Q = 64):

  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  python -m experiments.needle_qa --nosmoke --model=random --preset=llama2_7b \
      --num_kv_heads=4 --vocab_size=64000 --doc_tokens=20000 --questions=1,4,16,64,256,1024 \
      --new_tokens=32 --no_sharing_max_questions=64 --impl=auto --workdir=workdir/needle_qa
"""

import os

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import apps_workload as aw
from experiments import cli
from hydrajax import AttentionImpl
from experiments.benchmarking import (
    JsonlWriter, markdown_table, plot_sweeps, progress, resume_records, write_workdir_readme)
from hydrajax.evaluation import ByteTokenizer, needle
from models import pretrained
from models import prompt_plan as pp
from models.llama import ModelMode
from models.sampling import SamplingParams

FLAGS = flags.FLAGS
MODES = ('tree', 'no_sharing', 'no_attention')
flags.DEFINE_bool('smoke', None, 'small settings for a CPU (default: on when the backend is the '
                  'CPU); flags given explicitly win')
flags.DEFINE_integer('doc_tokens', 20000, 'document length in tokens (few-shot examples included)')
flags.DEFINE_list('questions', ['1', '4', '16', '64', '256', '1024'], 'numbers of questions Q')
flags.DEFINE_integer('new_tokens', 32, 'tokens generated per question (>= 3)')
flags.DEFINE_list('modes', ['tree', 'no_sharing', 'no_attention'], 'modes, in run order')
flags.DEFINE_enum('model', 'random', ['smollm2', 'tiny_coder', 'random', 'hf'],
                  'smollm2: SmolLM2-135M-Instruct (models.pretrained); tiny_coder: the small '
                  'byte model trained on code; random: --preset with random weights; '
                  'hf: --checkpoint')
flags.DEFINE_string('tiny_checkpoint', os.path.join(aw.DATA, 'tiny_coder'), 'the tiny model')
flags.DEFINE_string('checkpoint', '', 'a .gguf file or a local HF Llama folder (with its '
                    'tokenizer)')
flags.DEFINE_string('preset', 'llama2_7b', 'model shape for --model=random')
flags.DEFINE_enum('dtype', None, ['bfloat16', 'float32'],
                  'weights and KV (default: float32 for smollm2 and tiny_coder, bfloat16 '
                  'otherwise; the '
                  'GPU kernels take bfloat16; in float32 greedy near-ties that bfloat16 '
                  'rounding breaks one way or the other stay apart)')
flags.DEFINE_integer('num_kv_heads', 0, 'override the preset\'s KV heads (Yi-6B: 4)')
flags.DEFINE_integer('vocab_size', 0, 'override the preset\'s vocabulary (Yi-6B: 64000)')
flags.DEFINE_enum('impl', 'auto', [i.value for i in AttentionImpl],
                  'attention of tree and no_sharing')
flags.DEFINE_float('memory_budget_gb', 0.0, 'KV budget deciding where no_sharing runs (0: device '
                   'memory minus weights, less 15%; 1 GiB on CPU)')
flags.DEFINE_integer('no_sharing_max_questions', 0, 'run no_sharing only up to this Q (0: where '
                     'it fits); its prefill of Q document copies is slow')
flags.DEFINE_integer('prefill_chunk', 2048, 'prefill tokens per model call, over all its rows')
flags.DEFINE_integer('seed', 0, 'document seed')
WORKDIR = cli.workdir_flag('needle_qa')
flags.DEFINE_bool('resume', False, 'keep the points of --workdir/results.jsonl (same model and '
                  'document) and run only the others')
cli.at_least(3, 'new_tokens')
cli.at_least(0, 'num_kv_heads', 'vocab_size', 'memory_budget_gb', 'no_sharing_max_questions')
cli.at_least(1, 'prefill_chunk')
cli.at_least(64, 'doc_tokens')
cli.int_list('questions', 1)
flags.register_validator('questions', lambda qs: 0 < len(qs) and max(map(int, qs)) <= 1024,
                         message='must be 1 to 1024 questions, comma-separated')
cli.choices('modes', MODES)
cli.check_flags(['model', 'checkpoint', 'tiny_checkpoint'], lambda f: (
    '--model=hf needs --checkpoint' if f['model'] == 'hf' and not f['checkpoint'] else
    f'--checkpoint={f["checkpoint"]} does not exist'
    if f['checkpoint'] and not os.path.exists(f['checkpoint']) else None))

_SMOKE = dict(doc_tokens=1024, questions=['1', '8'], new_tokens=4, model='smollm2')


def _apply_smoke():
  smoke = FLAGS.smoke if FLAGS.smoke is not None else jax.default_backend() == 'cpu'
  if smoke:
    for name, value in _SMOKE.items():
      if not FLAGS[name].present:
        FLAGS[name].value = value
  return smoke


def _load_model():
  from models import saved_params
  dtype = jnp.dtype(FLAGS.dtype or ('float32' if FLAGS.model in ('smollm2', 'tiny_coder') and
                                     not FLAGS.checkpoint else 'bfloat16'))
  suffix = f',dtype={dtype.name}' if FLAGS.dtype else ''
  if FLAGS.model == 'hf' or FLAGS.checkpoint:
    from models.checkpoint import load_checkpoint
    from models.tokenizer import Tokenizer
    model, tokenizer = load_checkpoint(FLAGS.checkpoint, dtype=dtype)
    return (model, tokenizer or Tokenizer.from_file(FLAGS.checkpoint),
            'hf:' + FLAGS.checkpoint + suffix)
  if FLAGS.model == 'smollm2':
    try:
      model, tokenizer = pretrained.load_smollm2(dtype=dtype)
    except pretrained.ModelUnavailableError as e:
      raise SystemExit(f'error: {e}') from None
    return model, tokenizer, 'smollm2' + suffix
  if FLAGS.model == 'tiny_coder':
    return (saved_params.restore_params(FLAGS.tiny_checkpoint, dtype=dtype), ByteTokenizer(),
            'tiny_coder' + suffix)
  from models.config import get_config
  from models.llama import Llama
  overrides = {k: getattr(FLAGS, k) for k in ('num_kv_heads', 'vocab_size') if getattr(FLAGS, k)}
  config = get_config(FLAGS.preset, **overrides)
  name = FLAGS.preset + ''.join(f',{k}={v}' for k, v in overrides.items()) + suffix
  return Llama(config, rngs=nnx.Rngs(0), dtype=dtype), ByteTokenizer(), 'random:' + name


def _budget(model) -> int:
  if FLAGS.memory_budget_gb:
    return int(FLAGS.memory_budget_gb * 2**30)
  if jax.default_backend() == 'cpu':
    return 2**30
  stats = jax.devices()[0].memory_stats() or {}
  params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return int(0.85 * (stats.get('bytes_limit', 16 * 2**30) - params))




def timed_decode(model, forest, *, new_tokens: int, impl, document=None):
  """Prefill, one warm-up decode step (compiles), then the rest timed; greedy, no stop tokens.

  document: a dict reused across calls that keeps the document's KV (`run_batch`'s `root_kv`).
  """
  run = aw.run_batch(model, forest, max_new_tokens=new_tokens, sampling=SamplingParams(), seed=0,
                     stop_tokens=(), impl=impl, prefill_chunk=FLAGS.prefill_chunk,
                     prefill_call_tokens=FLAGS.prefill_chunk, root_kv=document)
  return run.tokens, run.prefill_s, run.decode_s, run.kv_tokens


def main(argv):
  del argv
  smoke = _apply_smoke()
  qs = sorted(int(q) for q in FLAGS.questions)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  model, tokenizer, model_name = _load_model()
  byte_level = isinstance(tokenizer, ByteTokenizer)
  task = needle.make_task(num_chars=FLAGS.doc_tokens * (1 if byte_level else 5),
                          num_questions=qs[-1], seed=FLAGS.seed)
  doc = needle.document_tokens(tokenizer, task, FLAGS.doc_tokens)
  questions = [tokenizer.encode(q, add_bos=False) for q in task.questions]
  per_token = model.config.kv_bytes_per_token(jnp.dtype(model.dtype).itemsize)
  budget = _budget(model)
  private = -(-FLAGS.new_tokens // pp.PRIVATE_ALIGN) * pp.PRIVATE_ALIGN
  logging.info('model %s; document %d tokens; Q %s; KV budget %.2f GiB', model_name, len(doc), qs,
               budget / 2**30)
  path = os.path.join(FLAGS.workdir, 'results.jsonl')
  answers = {}
  records = resume_records(path, _kept(model_name, len(doc), answers) if FLAGS.resume else None)
  writer = JsonlWriter(path)
  document = {}  # the document's KV: prefilled at the first tree point, copied into the rest
  done = {(r['questions'], r['mode']) for r in records}
  cases = [(q, m) for q in qs for m in FLAGS.modes if (q, m) not in done]
  if done:
    logging.info('resuming: %d points kept, %d to run', len(done), len(cases))
  for q, mode in progress(cases, total=len(cases), desc='needle_qa'):
    qids = questions[:q]
    base = dict(mode=mode, questions=q, doc_tokens=len(doc), new_tokens=FLAGS.new_tokens,
                model=model_name, impl=FLAGS.impl)
    if mode == 'no_sharing':
      need = sum(len(doc) + len(x) + private for x in qids) * per_token
      if need > budget or (FLAGS.no_sharing_max_questions and q > FLAGS.no_sharing_max_questions):
        r = dict(base, status='does_not_fit' if need > budget else 'skipped',
                 kv_bytes=need)
        records.append(r)
        writer.append(r)
        continue
      forest = [pp.prompt_node(doc + x) for x in qids]
    else:
      forest = [pp.prompt_node(doc, [pp.prompt_node(x) for x in qids])]
    impl = ModelMode.NO_ATTENTION if mode == 'no_attention' else FLAGS.impl
    try:
      tokens, prefill_s, decode_s, kv = timed_decode(model, forest, new_tokens=FLAGS.new_tokens,
                                                     impl=impl, document=document)
    except Exception as e:  # e.g. out of memory: recorded, the sweep goes on
      logging.exception('%s Q=%d failed', mode, q)
      r = dict(base, status='error', reason=f'{type(e).__name__}: {e}'[:1000])
      records.append(r)
      writer.append(r)
      continue
    got = [needle.answer_of(tokenizer.decode(t)) for t in tokens]
    r = dict(base, status='ok', decode_s=decode_s, prefill_s=prefill_s, kv_bytes=kv * per_token,
             decode_tokens_per_s=q * FLAGS.new_tokens / decode_s,
             accuracy=float(np.mean([a == b for a, b in zip(got, task.answers)])))
    if mode != 'no_attention':
      answers[(mode, q)] = tokens
      _save_answers(mode, q, tokens)
    if mode == 'no_sharing' and ('tree', q) in answers:
      tree = np.asarray(answers[('tree', q)])
      r['identical_to_tree'] = bool(np.array_equal(tokens, tree))
      differ = np.asarray(tokens) != tree  # [Q, new tokens]
      r['identical_questions'] = int((~differ.any(axis=1)).sum())
      if differ.any():  # the earliest token (over the questions) where an answer departs
        r['first_divergence'] = int(differ.any(axis=0).argmax())
    records.append(r)
    writer.append(r)
    logging.info('%s Q=%d: decode %.3f s, %s', mode, q, decode_s, r.get('identical_to_tree', ''))
  _finish(records, writer.meta, model_name, smoke)


def _answers_path(mode: str, q: int) -> str:
  return os.path.join(FLAGS.workdir, 'answers', f'{mode}_q{q}.npy')


def _save_answers(mode: str, q: int, tokens) -> None:
  os.makedirs(os.path.dirname(_answers_path(mode, q)), exist_ok=True)
  np.save(_answers_path(mode, q), np.asarray(tokens))


def _kept(model_name: str, doc_tokens: int, answers: dict):
  """Which records of an earlier run a resumed one keeps: points of this model, document length,
  --new_tokens and --impl that ran or did not fit; tree and no_sharing points only with their
  saved answers, which go into `answers` (a point whose answers are missing runs again)."""
  def keep(r) -> bool:
    if (r.get('model'), r.get('doc_tokens'), r.get('new_tokens'), r.get('impl')) != (
        model_name, doc_tokens, FLAGS.new_tokens, FLAGS.impl):
      return False
    if r.get('status') == 'does_not_fit' or (r.get('status') == 'ok'
                                              and r['mode'] == 'no_attention'):
      return True
    key = (r['mode'], r['questions'])
    if r.get('status') != 'ok' or not os.path.exists(_answers_path(*key)):
      return False
    answers[key] = np.load(_answers_path(*key))
    return True
  return keep


def _finish(records, meta, model_name, smoke):
  columns = [('Q', 'questions'), ('mode', 'mode'), ('status', 'status'), ('decode s', 'decode_s'),
             ('decode tok/s', 'decode_tokens_per_s'), ('prefill s (excluded)', 'prefill_s'),
             ('KV GiB', lambda r: r.get('kv_bytes') and r['kv_bytes'] / 2**30),
             ('accuracy', 'accuracy'), ('same tokens as tree', 'identical_to_tree')]
  rows = sorted(records, key=lambda r: (r['questions'], r['mode']))
  checked = [r for r in records if 'identical_to_tree' in r]
  same = sum(r['identical_to_tree'] for r in checked)
  text = (f'model {model_name}; document {records[0]["doc_tokens"]} tokens; '
          f'{records[0]["new_tokens"]} new tokens per question (greedy)\n\n'
          + markdown_table(rows, columns)
          + f'\nGreedy answers token-identical with and without sharing at {same}/{len(checked)} '
            'values of Q where both ran.\n')
  with open(os.path.join(FLAGS.workdir, 'table.md'), 'w') as f:
    f.write(text)
  ok = [r for r in records if r.get('status') == 'ok']
  plot_sweeps(ok, x='questions', y='decode_s', series='mode', fixed=(),
              path=os.path.join(FLAGS.workdir, 'time_vs_questions.png'),
              title=f'{model_name}: decode time vs questions', ylabel='decode seconds')
  why = accuracy_note(model_name, rows)
  notes = ('\nSmoke settings (CPU). ' if smoke else '\n') + why + '\n'
  paper = ('Paper (Yi-6B-200k, 4x A100-40GB, 19,947-token document): Hydragen answers 256 '
           'questions faster than FlashAttention answers 64, and stays within 60% of the '
           'no-attention time.\n')
  write_workdir_readme(FLAGS.workdir, 'Long-document QA: time vs number of questions',
                       notes + '\n' + text + '\n' + paper, meta=meta)
  print(text)
  print(why)


def accuracy_note(model_name: str, records) -> str:
  """Why the accuracy is what it is: the model, the chance level, what the token check found."""
  scores = [r['accuracy'] for r in records
            if r.get('status') == 'ok' and r['mode'] != 'no_attention' and 'accuracy' in r]
  low, high = (min(scores), max(scores)) if scores else (None, None)
  got = ('no accuracy measured' if not scores else f'accuracy {low:.0%}' if low == high else
         f'accuracy {low:.0%} to {high:.0%}')
  chance = f'chance: {1 / len(needle.COLORS):.0%}, one of {len(needle.COLORS)} colours'
  if model_name.startswith('smollm2'):
    why = ('SmolLM2-135M-Instruct, a small trained model, has to find the sentence "The dog '
           'named X has fur that is C." in the document and answer with C, as the few-shot '
           'examples at its end do; ' + ('it finds every one here' if low == 1 else
                                         'a model of 135M parameters misses some'))
  elif model_name.startswith('random'):
    why = 'random weights answer nothing: the timing is the point, the accuracy means nothing'
  elif model_name.startswith('tiny_coder'):
    why = ('the tiny model was trained on code, not on this task: its accuracy is about 0, '
           'whatever the attention')
  else:
    why = 'a checkpoint of your own: the accuracy is the model\'s'
  checked = [r['identical_to_tree'] for r in records if 'identical_to_tree' in r]
  same = ('tree and no_sharing gave the same greedy tokens at every Q: sharing the document '
          'changes the time, not the answers' if checked and all(checked) else
          f'tree and no_sharing gave the same greedy tokens at {sum(checked)} of {len(checked)} '
          'values of Q (where they differ, a near-tie broke the other way)' if checked else
          'no_sharing did not run: no token check')
  return (f'{got} ({chance}): {why}. Accuracy is the share of questions whose first answer word '
          f'is the planted colour. {same}.')


if __name__ == '__main__':
  cli.run(main, workdir=WORKDIR)
