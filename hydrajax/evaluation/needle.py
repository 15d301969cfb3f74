"""A long synthetic document with planted facts, and questions about them (Hydragen section 4.3).

The paper embeds facts "The dog named {name} has fur that is {color}." in an excerpt of War and
Peace. No book ships with this project, so the filler here is generated offline from a fixed word
list by a seeded generator (deterministic: same seed, same text). Few-shot question/answer
examples about some of the dogs follow the document, as in the paper; each question asks for one
dog's colour, and its expected answer is known.
"""

import dataclasses

import numpy as np

COLORS = ('black', 'white', 'brown', 'golden', 'grey', 'red', 'cream', 'spotted', 'silver',
          'tan')
_SYLLABLES = ('ba', 'ko', 'ri', 'mu', 'te', 'lo', 'sa', 'vi', 'den', 'pa', 'ru', 'mi', 'zo',
              'ka', 'ne', 'tor', 'li', 'fa', 'go', 'she')
_WORDS = ('the', 'old', 'house', 'stood', 'near', 'river', 'where', 'soldiers', 'walked', 'in',
          'silence', 'and', 'evening', 'light', 'fell', 'across', 'fields', 'of', 'wheat', 'while',
          'prince', 'spoke', 'quietly', 'about', 'war', 'peace', 'letters', 'from', 'moscow',
          'winter', 'carriage', 'count', 'ball', 'music', 'candles', 'distant', 'guns', 'morning',
          'officer', 'horse', 'road', 'village', 'snow', 'long', 'table', 'dinner', 'guests',
          'laughed', 'remembered', 'summer', 'garden', 'trees', 'a', 'with', 'his', 'her', 'their')


@dataclasses.dataclass(frozen=True)
class NeedleTask:
  """The document (with few-shot examples at its end) and the questions.

  Attributes:
    document: the shared prefix text.
    questions: question suffixes, each ending where the answer starts.
    answers: the expected colour of each question.
    facts: name -> colour of every planted dog.
  """

  document: str
  questions: tuple[str, ...]
  answers: tuple[str, ...]
  facts: dict


def _name(rng) -> str:
  return ''.join(rng.choice(_SYLLABLES, size=3)).capitalize()


def question_text(name: str) -> str:
  return f'Question: What color is the fur of the dog named {name}?\nAnswer:'


def make_task(*, num_chars: int, num_questions: int, num_facts: int | None = None,
              fewshot: int = 5, seed: int = 0) -> NeedleTask:
  """A document of about `num_chars` characters with planted facts, and `num_questions` questions.

  Questions cycle through the dogs (so more questions than dogs repeat questions; the paper's
  batch of questions is likewise a workload, not a test set).
  """
  if num_chars < 200:
    raise ValueError(f'num_chars must be >= 200, got {num_chars}')
  if num_questions < 1:
    raise ValueError(f'num_questions must be >= 1, got {num_questions}')
  rng = np.random.default_rng(seed)
  num_facts = num_facts or max(fewshot + 1, min(256, num_chars // 80))
  names: list[str] = []
  while len(names) < num_facts:
    n = _name(rng)
    if n not in names:
      names.append(n)
  facts = {n: str(rng.choice(COLORS)) for n in names}
  sentences = []
  length = 0
  while length < num_chars:
    words = rng.choice(_WORDS, size=int(rng.integers(6, 16)))
    s = ' '.join(words).capitalize() + '.'
    sentences.append(s)
    length += len(s) + 1
  slots = np.sort(rng.choice(len(sentences), size=num_facts, replace=False))
  for name, slot in zip(names, slots):
    sentences[slot] += f' The dog named {name} has fur that is {facts[name]}.'
  text = ' '.join(sentences)
  shots = ''.join(f'\n{question_text(n)} {facts[n]}\n' for n in names[:fewshot])
  asked = names[fewshot:] or names
  questions = tuple('\n' + question_text(asked[i % len(asked)]) for i in range(num_questions))
  answers = tuple(facts[asked[i % len(asked)]] for i in range(num_questions))
  return NeedleTask(text + '\n' + shots, questions, answers, facts)


def answer_of(completion: str) -> str:
  """The first word of a completion, lower-cased, without punctuation."""
  words = completion.strip().split()
  return words[0].strip('.,;:!?').lower() if words else ''


def document_tokens(tokenizer, task: NeedleTask, length: int) -> list[int]:
  """The document's tokens cut to `length` (the filler is cut, the few-shot tail kept)."""
  split = task.document.index('\nQuestion:')
  body, shots = task.document[:split], task.document[split:]
  body_ids = tokenizer.encode(body)
  shot_ids = tokenizer.encode(shots, add_bos=False)
  keep = length - len(shot_ids)
  if keep < 16:
    raise ValueError(f'doc_tokens={length} leaves no room for the document before the few-shot '
                     f'examples ({len(shot_ids)} tokens)')
  return body_ids[:keep] + shot_ids
