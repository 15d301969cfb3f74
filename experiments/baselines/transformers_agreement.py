"""transformers' bf16 greedy agreement with its own float32 reference: the peer measurement for
experiments/real_model_agreement.py.

real_model_agreement.py measures how often hydrajax's bf16 greedy decoding of a real model parts
from its float32 reference, and how near a tie the reference was where it does. This script asks
the same of transformers on the same GGUF file, prompts and definitions, so that hydrajax's
numbers can be read against what an established implementation shows: a bf16 model that parts
from float32 only at near ties is doing what bf16 rounding allows, not worse.

It imports torch and transformers at top level, so it runs only in a side environment that has
torch (CPU), transformers 5.x and gguf, never the project's venv (nothing imports it):

  python -m venv /tmp/side && /tmp/side/bin/pip install torch transformers gguf accelerate
  PYTHONPATH=. python -m models.pretrained        # the GGUF file (prints its path)
  /tmp/side/bin/python experiments/baselines/transformers_agreement.py [--gguf=<that path>]

Mirrors real_model_agreement.py: the prompt of question q is `encode(FEWSHOT)` followed by
`encode(f'Question: {q}\\nAnswer:', add_bos=False)` (the two tokenized separately; BOS first only
where the GGUF file says to add it, as hydrajax's `tokenizer_from_gguf`), `--new_tokens` greedy
tokens each with no stop token. The reference is transformers' model in float32 (an argmax loop
over its forward with its KV cache, one question at a time, batch 1, no padding; the shared
prompt is run once and each question starts from a copy of its cache, as hydrajax's prompt tree
computes it once: `--no-share_prefix` runs each whole prompt), recording the top-2 log-probs at
every generated position; the same model cast to bfloat16 (log-probs from its logits upcast to
float32) is then compared with it: identical sequences, first divergences, the reference's top-1
minus top-2 margin there, and the margin error where a row still follows the reference.

Before decoding, the float32 model must reproduce the greedy tokens of the first prompt of
tests/fixtures/smollm2/greedy.json (transformers float32 made them too); it aborts if not.

Writes agreement.jsonl (a record a dtype), divergences.jsonl (one a first divergence), table.md
and greedy.npz (both dtypes' tokens and top-2 ids and log-probs) to --workdir.
"""

import argparse
import copy
import json
import os
import pathlib
import sys
import time
import types

import gguf
import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments import agreement_metrics  # noqa: E402  (numpy alone)
from experiments.qa_prompts import FEWSHOT, QUESTIONS  # noqa: E402  (no imports of its own)

DEFAULT_GGUF = os.path.expanduser('~/.cache/hydrajax/SmolLM2-135M-Instruct.Q4_1.gguf')
FIXTURE = ROOT / 'tests' / 'fixtures' / 'smollm2' / 'greedy.json'
IMPL = 'transformers'


def gguf_bos(path: str) -> int | None:
  """The BOS id hydrajax's `tokenizer_from_gguf` prepends: None where the file says not to."""
  reader = gguf.GGUFReader(path)

  def field(key):
    f = reader.fields.get(key)
    return None if f is None else f.parts[f.data[0]].tolist()[0]

  bos = field('tokenizer.ggml.bos_token_id')
  add_bos = field('tokenizer.ggml.add_bos_token')
  add_bos = bos is not None if add_bos is None else bool(add_bos)
  return int(bos) if add_bos and bos is not None else None


def prompts(tok, bos: int | None, questions) -> tuple[list[int], list[list[int]]]:
  """The shared prefix (with BOS where hydrajax adds it) and each question's own tokens."""
  shared = ([] if bos is None else [bos]) + tok.encode(FEWSHOT, add_special_tokens=False)
  own = [tok.encode(f'Question: {q}\nAnswer:', add_special_tokens=False) for q in questions]
  return shared, own


@torch.no_grad()
def greedy(model, ids: list[int], new: int, cache=None):
  """An argmax loop over transformers' forward with its KV cache (no stop token), `ids` after
  what `cache` holds: the tokens and, at each generated position, the top-2 ids and their
  float32 log-probs."""
  tokens, top_ids, top_lp, feed = [], [], [], list(ids)
  for _ in range(new):
    out = model(torch.tensor([feed]), past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    top = torch.topk(logprobs, 2)
    top_ids.append(top.indices.tolist())
    top_lp.append(top.values.tolist())
    tokens.append(int(top.indices[0]))
    feed = tokens[-1:]
  return tokens, top_ids, top_lp


@torch.no_grad()
def decode_all(model, shared, own, new: int, label: str, share_prefix: bool):
  """Every question's greedy decode, as real_model_agreement's outputs (tokens [R, M],
  top_tokens [R, M, 2], top_logprobs [R, M, 2]). With `share_prefix` the shared prompt is run
  once and each question starts from a copy of its KV cache (as hydrajax's prompt tree computes
  it once); otherwise each question runs its whole prompt."""
  rows, start = [], time.perf_counter()
  prefix = None
  if share_prefix:
    prefix = model(torch.tensor([shared]), use_cache=True, logits_to_keep=1).past_key_values
  for r, ids in enumerate(own):
    if share_prefix:
      rows.append(greedy(model, ids, new, copy.deepcopy(prefix)))
    else:
      rows.append(greedy(model, shared + ids, new))
    if (r + 1) % 8 == 0 or r + 1 == len(own):
      print(f'  {label}: {r + 1}/{len(own)} questions, {time.perf_counter() - start:.1f}s',
            flush=True)
  out = types.SimpleNamespace(tokens=np.array([t for t, _, _ in rows]),
                              top_tokens=np.array([i for _, i, _ in rows]),
                              top_logprobs=np.array([lp for _, _, lp in rows], np.float32))
  return out, time.perf_counter() - start


def check_fixture(model) -> None:
  """The float32 model's greedy tokens of the fixture's first prompt must be the fixture's."""
  fixture = json.loads(FIXTURE.read_text())
  first = fixture['prompts'][0]
  got, _, _ = greedy(model, first['ids'], len(first['greedy']))
  if got != first['greedy']:
    raise SystemExit(f'sanity check failed: transformers float32 greedy tokens of the first '
                     f'prompt of {FIXTURE} are {got}, the fixture has {first["greedy"]} (made '
                     f'with {fixture["versions"]}); this environment does not reproduce it')
  print(f'fixture check passed: {len(got)} greedy tokens of {FIXTURE.name} prompt 0 match',
        flush=True)


def compare(out, ref, dtype, questions, tok, args, decode_s, extra):
  """real_model_agreement's record and divergences of one dtype against the reference."""
  fields, at = agreement_metrics.compare(out, ref, args.margin)
  record = dict(impl=IMPL, dtype=dtype, **fields, decode_s=decode_s, **extra)
  divergences = [dict(impl=IMPL, dtype=dtype, question=questions[r], position=i, margin=m,
                      reference=tok.decode(ref.tokens[r, :i + 1].tolist()),
                      got=tok.decode(out.tokens[r, :i + 1].tolist()))
                 for r, i, m in at]
  print(f'  {dtype}: {record["identical"]}/{record["sequences"]} identical; {len(at)} diverge, '
        f'{record["over_margin"]} where the float32 margin > {args.margin:g}', flush=True)
  return record, divergences


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--gguf', default=DEFAULT_GGUF, help='SmolLM2-135M-Instruct.Q4_1.gguf')
  parser.add_argument('--questions', type=int, default=64, help=f'1 to {len(QUESTIONS)}')
  parser.add_argument('--new_tokens', type=int, default=64, help='tokens per question (no stop)')
  parser.add_argument('--margin', type=float, default=0.1, help='a divergence where the float32 '
                      'top-2 margin is above this counts against the target')
  parser.add_argument('--threads', type=int, default=1, help='torch CPU threads')
  parser.add_argument('--share_prefix', action=argparse.BooleanOptionalAction, default=True,
                      help='run the shared prompt once and copy its KV cache for each question '
                      '(bf16 matmuls are slow on a CPU without bf16 instructions)')
  parser.add_argument('--workdir', default=os.path.join('workdir', 'transformers_agreement'))
  args = parser.parse_args()
  if not 1 <= args.questions <= len(QUESTIONS) or args.new_tokens < 1:
    parser.error(f'--questions must be 1 to {len(QUESTIONS)}, --new_tokens at least 1')
  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  os.makedirs(args.workdir, exist_ok=True)
  start = time.perf_counter()

  folder, name = os.path.split(os.path.abspath(args.gguf))
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32).eval()
  check_fixture(model)
  questions = QUESTIONS[:args.questions]
  bos = gguf_bos(args.gguf)
  shared, own = prompts(tok, bos, questions)
  print(f'{len(questions)} questions after a {len(shared)}-token shared prompt (BOS '
        f'{"none" if bos is None else bos}), {args.new_tokens} tokens each; transformers '
        f'{transformers.__version__}, torch {torch.__version__}, {args.threads} threads',
        flush=True)
  extra = dict(torch_version=torch.__version__, transformers_version=transformers.__version__,
               device='cpu', threads=args.threads, shared_prompt_tokens=len(shared),
               share_prefix=args.share_prefix)

  print('reference: float32 ...', flush=True)
  ref, ref_s = decode_all(model, shared, own, args.new_tokens, 'float32', args.share_prefix)
  print('bfloat16 ...', flush=True)
  out, out_s = decode_all(model.to(torch.bfloat16), shared, own, args.new_tokens, 'bfloat16',
                          args.share_prefix)

  records, divergences = [], []
  for dtype, got, seconds in (('float32', ref, ref_s), ('bfloat16', out, out_s)):
    record, diverged = compare(got, ref, dtype, questions, tok, args, seconds,
                               dict(extra, fixture_check='passed'))
    records.append(record)
    divergences += diverged

  with open(os.path.join(args.workdir, 'agreement.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  with open(os.path.join(args.workdir, 'divergences.jsonl'), 'w') as f:
    f.writelines(json.dumps(d) + '\n' for d in divergences)
  np.savez(os.path.join(args.workdir, 'greedy.npz'), shared=np.array(shared),
           **{f'{d}_{k}': getattr(o, k) for d, o in (('float32', ref), ('bfloat16', out))
              for k in ('tokens', 'top_tokens', 'top_logprobs')})
  text = agreement_metrics.table(records)
  with open(os.path.join(args.workdir, 'table.md'), 'w') as f:
    f.write(text)
  print('\n' + text)
  print(f'float32 is the reference itself (identical by construction); '
        f'{time.perf_counter() - start:.0f}s in all. Wrote {args.workdir}.')


if __name__ == '__main__':
  main()
