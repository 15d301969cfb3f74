"""Chat messages -> the prompt text a model was tuned on (its chat template).

A checkpoint's chat template is a Jinja2 program (`tokenizer.chat_template` in
GGUF metadata, `chat_template` in HF's tokenizer_config.json). With jinja2
installed it runs in jinja2's sandbox, as transformers runs it. Without it,
the ChatML template of SmolLM2 (one `<|im_start|>role\\ncontent<|im_end|>\\n`
block per message, a default system message first when the conversation has
none) is rendered by `render_chatml`; any other template then asks for jinja2.
"""

from typing import Mapping, Sequence

try:  # optional: any template but SmolLM2's ChatML needs it
  from jinja2.exceptions import TemplateError
  from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
  TemplateError = ImmutableSandboxedEnvironment = None

SMOLLM2_SYSTEM = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face'

# The template SmolLM2-Instruct ships (GGUF metadata and HF tokenizer_config.json alike).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

_HAVE_JINJA2 = ImmutableSandboxedEnvironment is not None


def check_messages(messages: Sequence[Mapping[str, str]]) -> None:
  """Each message a mapping with string `role` and `content` (a ValueError naming the message)."""
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
    raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...}')
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get('role'), str) or not isinstance(
        m.get('content'), str):
      raise ValueError(f'messages[{i}] must have string "role" and "content", got {m!r}')


def render_chatml(messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                  default_system: str | None = SMOLLM2_SYSTEM) -> str:
  """ChatML text: SMOLLM2_TEMPLATE's output, without Jinja2."""
  check_messages(messages)
  parts = []
  if default_system is not None and messages[0]['role'] != 'system':
    parts.append(f'<|im_start|>system\n{default_system}<|im_end|>\n')
  parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
  if add_generation_prompt:
    parts.append('<|im_start|>assistant\n')
  return ''.join(parts)


def _render_jinja2(template: str, messages, add_generation_prompt: bool, **variables) -> str:
  def raise_exception(message):
    raise TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals['raise_exception'] = raise_exception
  return env.from_string(template).render(
      messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
      **variables)


def apply_chat_template(template: str, messages: Sequence[Mapping[str, str]], *,
                        add_generation_prompt: bool = True, **variables) -> str:
  """The prompt text of `messages` under `template` (a Jinja2 chat template).

  `variables` (e.g. bos_token) reach the template as globals when jinja2 renders it.
  """
  check_messages(messages)
  if _HAVE_JINJA2:
    return _render_jinja2(template, messages, add_generation_prompt, **variables)
  if template.strip() == SMOLLM2_TEMPLATE:
    return render_chatml(messages, add_generation_prompt=add_generation_prompt)
  raise ValueError('this chat template needs jinja2 (pip install jinja2); without it only '
                   "SmolLM2's ChatML template renders")
