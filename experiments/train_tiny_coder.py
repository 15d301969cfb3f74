r"""Trains a tiny byte-level Llama on the embedded APPS problems' own solutions.

With random weights pass@k is 0, which proves nothing about the evaluation path. This model is
trained (optax AdamW, a few CPU minutes) on exactly the sequences `experiments.apps_eval` will
prompt with: [few-shot examples][problem prompt][reference solution][EOS], loss on the solution
and EOS only. It memorises the embedded problems' solutions: an overfit model, on purpose, so that
the default `apps_eval` run generates programs that really pass, and the sampling, tree decoding,
decoding of bytes, sandboxed checking and pass@k are all exercised end to end. Its pass@k says
nothing about generalisation (it has seen every test problem's solution).

The checkpoint (orbax, saved in bfloat16 by `models.saved_params.save_params`, about 0.3 MB) goes to
--out; the loss curve, JSONL log and a README to --workdir.

  python -m experiments.train_tiny_coder --out=experiments/data/tiny_coder \
      --workdir=workdir/train_tiny_coder
"""

import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments import apps_workload as aw
from experiments import cli
from experiments.benchmarking import JsonlWriter, progress
from hydrajax.evaluation import ByteTokenizer, load_problems
from models.config import LlamaConfig
from models.saved_params import save_params
from models.llama import Llama
from models.training.forward import causal_logits

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')

FLAGS = flags.FLAGS
flags.DEFINE_string('problems', os.path.join(DATA, 'apps_mini.jsonl'), 'APPS problems to learn')
flags.DEFINE_string('fewshot', os.path.join(DATA, 'apps_fewshot.jsonl'), 'few-shot examples')
flags.DEFINE_integer('fewshot_examples', 1, 'few-shot examples in the prompt (apps_eval uses '
                     'the same flag; the tiny model is trained with 1 to keep CPU training short)')
flags.DEFINE_integer('steps', 300, 'optimizer steps')
flags.DEFINE_integer('batch', 8, 'sequences per step')
flags.DEFINE_float('learning_rate', 3e-3, 'peak learning rate (warm-up, then cosine decay)')
flags.DEFINE_float('max_minutes', 15.0, 'stop early after this many minutes (0: no limit)')
flags.DEFINE_integer('seed', 0, 'initialisation and batch order seed')
flags.DEFINE_integer('dim', 64, 'model width D')
flags.DEFINE_integer('layers', 2, 'decoder layers')
flags.DEFINE_integer('mlp_dim', 192, 'MLP hidden width F')
flags.DEFINE_integer('head_dim', 0, 'head dim (0: D / 4; the Mosaic GPU kernels take 64 or 128)')
flags.DEFINE_string('out', os.path.join(DATA, 'tiny_coder'), 'checkpoint folder (orbax)')
_WORKDIR = cli.workdir_flag('train_tiny_coder', 'log, loss plot and README')
cli.at_least(1, 'steps', 'batch', 'dim', 'layers', 'mlp_dim')
cli.at_least(0, 'fewshot_examples', 'max_minutes', 'head_dim')
cli.at_least(1e-12, 'learning_rate')
flags.register_validator('problems', os.path.exists, message='no such file or folder')
flags.register_validator('fewshot', os.path.exists, message='no such file')

ALIGN = 64  # sequence lengths are padded to a multiple of this (few compiles)


def tiny_coder_config(dim: int = 64, layers: int = 2, mlp_dim: int = 192,
                      head_dim: int = 0) -> LlamaConfig:
  return LlamaConfig(vocab_size=ByteTokenizer.vocab_size, dim=dim, num_layers=layers,
                     num_heads=4, num_kv_heads=2, head_dim=head_dim or dim // 4, mlp_dim=mlp_dim,
                     norm_eps=1e-5, rope_theta=10_000.0, max_position_embeddings=4096,
                     name='tiny_coder')


def training_examples(problems, fewshot, tokenizer) -> list[tuple[list[int], int]]:
  """(tokens, index of the first target token) per (problem, solution)."""
  prefix = tokenizer.encode(aw.fewshot_text(fewshot))
  out = []
  for p in problems:
    prompt = prefix + tokenizer.encode(aw.problem_prompt(p), add_bos=False)
    for s in p.solutions:
      out.append((prompt + tokenizer.encode(s, add_bos=False) + [tokenizer.eos_id], len(prompt)))
  return out


def _batch(examples, index, length=None):
  if length is None:
    length = -(-max(len(examples[i][0]) for i in index) // ALIGN) * ALIGN
  tokens = np.zeros((len(index), length), np.int32)
  mask = np.zeros((len(index), length), np.float32)
  for r, i in enumerate(index):
    seq, start = examples[i]
    tokens[r, :len(seq)] = seq
    mask[r, start - 1:len(seq) - 1] = 1.0  # position t predicts token t + 1
  return jnp.asarray(tokens), jnp.asarray(mask)




def loss_fn(model: Llama, tokens, mask):
  logits = causal_logits(model, tokens)
  targets = jnp.roll(tokens, -1, axis=1)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(nll * mask) / jnp.sum(mask)


@nnx.jit
def train_step(model, optimizer, tokens, mask):
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, mask)
  optimizer.update(model, grads)
  return loss


def main(argv):
  del argv
  os.makedirs(FLAGS.workdir, exist_ok=True)
  tokenizer = ByteTokenizer()
  problems = load_problems(FLAGS.problems)
  fewshot = load_problems(FLAGS.fewshot)[:FLAGS.fewshot_examples]
  examples = training_examples(problems, fewshot, tokenizer)
  logging.info('%d training sequences, longest %d tokens', len(examples),
               max(len(e[0]) for e in examples))
  config = tiny_coder_config(FLAGS.dim, FLAGS.layers, FLAGS.mlp_dim, FLAGS.head_dim)
  model = Llama(config, rngs=nnx.Rngs(FLAGS.seed), dtype=jnp.float32)
  warmup = min(20, FLAGS.steps // 4)
  schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.learning_rate, warmup, FLAGS.steps,
                                                FLAGS.learning_rate / 20)
  optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                               optax.adamw(schedule, weight_decay=0.0)),
                            wrt=nnx.Param)
  writer = JsonlWriter(os.path.join(FLAGS.workdir, 'train.jsonl'))
  rng = np.random.default_rng(FLAGS.seed)
  length = -(-max(len(e[0]) for e in examples) // ALIGN) * ALIGN  # one shape: one compile
  start = time.perf_counter()
  losses = []
  for step in progress(range(FLAGS.steps), total=FLAGS.steps, desc='train'):
    index = rng.choice(len(examples), size=min(FLAGS.batch, len(examples)), replace=False)
    loss = float(train_step(model, optimizer, *_batch(examples, index, length)))
    losses.append(loss)
    elapsed = time.perf_counter() - start
    if step % 10 == 0 or step == FLAGS.steps - 1:
      writer.append(dict(step=step, loss=loss, elapsed_s=elapsed))
      logging.info('step %d loss %.4f (%.0f s)', step, loss, elapsed)
    if FLAGS.max_minutes and elapsed > 60 * FLAGS.max_minutes:
      logging.warning('stopping at step %d: past --max_minutes', step)
      break
  full = [float(loss_fn(model, *_batch(examples, [i]))) for i in range(len(examples))]
  logging.info('final mean loss over every sequence: %.4f (max %.4f)', np.mean(full), max(full))
  bf16 = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
  save_params(bf16, FLAGS.out)
  _report(losses, full, time.perf_counter() - start, writer.meta, config)


def _report(losses, full, seconds, meta, config):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(losses)
  ax.set_yscale('log')
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats/token, solution tokens)')
  ax.set_title('tiny_coder training')
  fig.tight_layout()
  fig.savefig(os.path.join(FLAGS.workdir, 'loss.png'), dpi=100)
  plt.close(fig)
  with open(os.path.join(FLAGS.workdir, 'README.md'), 'w') as f:
    f.write(f'# tiny_coder training\n\ncommand: `{meta["command"]}`\n\ncommit: '
            f'{meta.get("git_commit")}, device: {meta["device"]}, {seconds:.0f} s, '
            f'{len(losses)} steps, {config.num_params()} parameters\n\n'
            f'final loss over every training sequence: mean {np.mean(full):.4f}, '
            f'max {max(full):.4f} nats/token\n\ncheckpoint: {FLAGS.out}\n\n'
            'The model memorises the embedded problems\' solutions (overfit on purpose; see '
            'the module docstring of experiments/train_tiny_coder.py).\n')


if __name__ == '__main__':
  cli.run(main, workdir=_WORKDIR)
