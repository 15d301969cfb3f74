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

CPU smoke run (the tiny model, a 2K-token document, Q = 1..8; --smoke is the default on CPU):

  python -m experiments.needle_qa --workdir=/tmp/hydrajax/needle_qa

Paper scale on one H200 (random weights of Yi-6B's shape: Llama-2-7B with 4 KV heads and a 64K
vocabulary; a 20K-token document; Q = 1..1024; no sharing up to Q = 64):

  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  python -m experiments.needle_qa --nosmoke --model=random --preset=llama2_7b \
      --num_kv_heads=4 --vocab_size=64000 --doc_tokens=20000 --questions=1,4,16,64,256,1024 \
      --new_tokens=32 --no_sharing_max_questions=64 --impl=auto --workdir=$OUT/needle_qa
"""

import os

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import apps_workload as aw
from experiments.benchmarking import (
    JsonlWriter, markdown_table, plot_sweeps, progress, resume_records, write_workdir_readme)
from hydrajax.evaluation import ByteTokenizer, needle
from models import generate as gen
from models.llama import NO_ATTENTION
from models.sampling import SamplingConfig

FLAGS = flags.FLAGS
flags.DEFINE_bool('smoke', None, 'small settings for a CPU (default: on when the backend is the '
                  'CPU); flags given explicitly win')
flags.DEFINE_integer('doc_tokens', 20000, 'document length in tokens (few-shot examples included)')
flags.DEFINE_list('questions', ['1', '4', '16', '64', '256', '1024'], 'numbers of questions Q')
flags.DEFINE_integer('new_tokens', 32, 'tokens generated per question (>= 3)')
flags.DEFINE_list('modes', ['tree', 'no_sharing', 'no_attention'], 'modes, in run order')
flags.DEFINE_enum('model', 'random', ['tiny_coder', 'random', 'hf'],
                  'tiny_coder: the small trained byte model; random: --preset with random weights; '
                  'hf: --checkpoint')
flags.DEFINE_string('tiny_checkpoint', os.path.join(aw.DATA, 'tiny_coder'), 'the tiny model')
flags.DEFINE_string('checkpoint', '', 'local HF Llama folder (with its tokenizer)')
flags.DEFINE_string('preset', 'llama2_7b', 'model shape for --model=random')
flags.DEFINE_enum('dtype', None, ['bfloat16', 'float32'],
                  'weights and KV (default: float32 for tiny_coder, bfloat16 otherwise; the '
                  'GPU kernels take bfloat16; in float32 greedy near-ties that bfloat16 '
                  'rounding breaks one way or the other stay apart)')
flags.DEFINE_integer('num_kv_heads', 0, 'override the preset\'s KV heads (Yi-6B: 4)')
flags.DEFINE_integer('vocab_size', 0, 'override the preset\'s vocabulary (Yi-6B: 64000)')
flags.DEFINE_string('impl', 'auto', 'attention of tree and no_sharing: auto, xla, mosaic_gpu')
flags.DEFINE_float('memory_budget_gb', 0.0, 'KV budget deciding where no_sharing runs (0: device '
                   'memory minus weights, less 15%; 1 GiB on CPU)')
flags.DEFINE_integer('no_sharing_max_questions', 0, 'run no_sharing only up to this Q (0: where '
                     'it fits); its prefill of Q document copies is slow')
flags.DEFINE_integer('prefill_chunk', 2048, 'prefill tokens per model call, over all its rows')
flags.DEFINE_integer('seed', 0, 'document seed')
flags.DEFINE_string('workdir', '/tmp/hydrajax/needle_qa', 'output folder')
flags.DEFINE_bool('resume', False, 'keep the points of --workdir/results.jsonl (same model and '
                  'document) and run only the others')

_SMOKE = dict(doc_tokens=2048, questions=['1', '2', '4', '8'], new_tokens=8, model='tiny_coder')


def _apply_smoke():
  smoke = FLAGS.smoke if FLAGS.smoke is not None else jax.default_backend() == 'cpu'
  if smoke:
    for name, value in _SMOKE.items():
      if not FLAGS[name].present:
        FLAGS[name].value = value
  return smoke


def _load_model():
  from models import hf_loading
  dtype = jnp.dtype(FLAGS.dtype or ('float32' if FLAGS.model == 'tiny_coder' and not
                                     FLAGS.checkpoint else 'bfloat16'))
  suffix = f',dtype={dtype.name}' if FLAGS.dtype else ''
  if FLAGS.model == 'hf' or FLAGS.checkpoint:
    from models.tokenizer import Tokenizer
    return (hf_loading.load_hf_checkpoint(FLAGS.checkpoint, dtype=dtype),
            Tokenizer.from_file(FLAGS.checkpoint), 'hf:' + FLAGS.checkpoint + suffix)
  if FLAGS.model == 'tiny_coder':
    return (hf_loading.restore_params(FLAGS.tiny_checkpoint, dtype=dtype), ByteTokenizer(),
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
  run = aw.run_batch(model, forest, max_new_tokens=new_tokens, sampling=SamplingConfig(), seed=0,
                     stop_tokens=(), impl=impl, prefill_chunk=FLAGS.prefill_chunk,
                     prefill_call_tokens=FLAGS.prefill_chunk, root_kv=document)
  return run.tokens, run.prefill_s, run.decode_s, run.kv_tokens


def main(argv):
  del argv
  smoke = _apply_smoke()
  if FLAGS.new_tokens < 3:
    raise app.UsageError(f'--new_tokens must be >= 3 (one warm-up step), got {FLAGS.new_tokens}')
  qs = sorted(int(q) for q in FLAGS.questions)
  if not qs or qs[0] < 1 or qs[-1] > 1024:
    raise app.UsageError(f'--questions must be in 1..1024, got {FLAGS.questions}')
  for mode in FLAGS.modes:
    if mode not in ('tree', 'no_sharing', 'no_attention'):
      raise app.UsageError(f'--modes: unknown mode {mode!r}')
  os.makedirs(FLAGS.workdir, exist_ok=True)
  model, tokenizer, model_name = _load_model()
  byte_level = isinstance(tokenizer, ByteTokenizer)
  task = needle.make_task(num_chars=FLAGS.doc_tokens * (1 if byte_level else 5),
                          num_questions=qs[-1], seed=FLAGS.seed)
  doc = needle.document_tokens(tokenizer, task, FLAGS.doc_tokens)
  questions = [tokenizer.encode(q, add_bos=False) for q in task.questions]
  per_token = model.config.kv_bytes_per_token(jnp.dtype(model.dtype).itemsize)
  budget = _budget(model)
  private = -(-FLAGS.new_tokens // gen.PRIVATE_ALIGN) * gen.PRIVATE_ALIGN
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
      forest = [gen.prompt_node(doc + x) for x in qids]
    else:
      forest = [gen.prompt_node(doc, [gen.prompt_node(x) for x in qids])]
    impl = NO_ATTENTION if mode == 'no_attention' else FLAGS.impl
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
  notes = ('\nSmoke settings (CPU). ' if smoke else '\n') + (
      'With random weights accuracy is meaningless (the timing is the point); the tiny model was '
      'trained on code, not on this task, so its accuracy is ~0 too; the token-identity check '
      'holds for any weights.\n')
  paper = ('Paper (Yi-6B-200k, 4x A100-40GB, 19,947-token document): Hydragen answers 256 '
           'questions faster than FlashAttention answers 64, and stays within 60% of the '
           'no-attention time.\n')
  write_workdir_readme(FLAGS.workdir, 'Long-document QA: time vs number of questions',
                       notes + '\n' + text + '\n' + paper, meta=meta)
  print(text)


if __name__ == '__main__':
  app.run(main)
