"""Llama-family model configs: one frozen dataclass, named presets, HF config.json parsing.

Covers Llama 2, Llama 3 (with Llama 3.1 RoPE scaling), CodeLlama and the
tiny test configs. Shapes use the legend letters: V vocab, D model dim,
N query heads, K kv heads, H head dim, F MLP hidden.
"""

import dataclasses
import json
import os
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1 RoPE frequency scaling (`rope_type: llama3` in HF configs)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.factor <= 0:
      raise ValueError(f'rope scaling factor must be > 0, got {self.factor}')
    if not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(
          'rope scaling needs 0 < low_freq_factor < high_freq_factor, got '
          f'{self.low_freq_factor} and {self.high_freq_factor}'
      )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shapes and constants of a Llama-family decoder.

  Attributes:
    vocab_size: V.
    dim: D, the residual stream width.
    num_layers: decoder blocks.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (K == N is MHA, K == 1 is MQA).
    head_dim: H.
    mlp_dim: F, the SwiGLU hidden width.
    norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base wavelength.
    rope_scaling: Llama 3.1 frequency scaling, or None.
    tie_embeddings: the output projection reuses the input embedding.
    max_position_embeddings: longest context the checkpoint was made for; a longer prompt is
      refused (`check_prompt_length`): past it a trained model's output is not to be trusted.
    name: preset or checkpoint name, for logs.
  """

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 10_000.0
  rope_scaling: Llama3RopeScaling | None = None
  tie_embeddings: bool = False
  max_position_embeddings: int = 4096
  name: str = ''

  def __post_init__(self):
    for field in ('vocab_size', 'dim', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
                  'mlp_dim'):
      if getattr(self, field) < 1:
        raise ValueError(f'LlamaConfig.{field} must be >= 1, got {getattr(self, field)}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})'
      )
    if self.head_dim % 2:
      raise ValueError(f'head_dim must be even for RoPE, got {self.head_dim}')
    if self.rope_theta <= 0 or self.norm_eps <= 0:
      raise ValueError('rope_theta and norm_eps must be > 0')

  @property
  def group_size(self) -> int:
    """G, query heads per kv head."""
    return self.num_heads // self.num_kv_heads

  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, h = self.dim, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * d * self.mlp_dim
    per_layer = attn + mlp + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_layers * per_layer + d + head

  def check_prompt_length(self, tokens: int, argument: str = 'prompts') -> None:
    """Raises ValueError naming `argument` when a prompt of `tokens` tokens is longer than
    `max_position_embeddings` (the generated tokens may go past it)."""
    if tokens > self.max_position_embeddings:
      raise ValueError(
          f'{argument}: a prompt of {tokens} tokens is longer than the model\'s maximum position '
          f'({self.max_position_embeddings} tokens, max_position_embeddings of '
          f'{self.name or "the model"}); use shorter prompts')

  def kv_bytes_per_token(self, itemsize: int = 2) -> int:
    """Bytes of K and V one token takes over all layers."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

  def to_hf_dict(self) -> dict[str, Any]:
    """A transformers-style config.json dict (v4 keys: rope_theta, rope_scaling)."""
    out = dict(
        architectures=['LlamaForCausalLM'],
        model_type='llama',
        vocab_size=self.vocab_size,
        hidden_size=self.dim,
        intermediate_size=self.mlp_dim,
        num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        rms_norm_eps=self.norm_eps,
        rope_theta=self.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=self.tie_embeddings,
        max_position_embeddings=self.max_position_embeddings,
        hidden_act='silu',
        attention_bias=False,
        mlp_bias=False,
    )
    if self.rope_scaling is not None:
      out['rope_scaling'] = dict(rope_type='llama3', **dataclasses.asdict(self.rope_scaling))
    return out


def from_hf_dict(hf: Mapping[str, Any], *, name: str = '') -> LlamaConfig:
  """Parses a transformers LlamaConfig dict (v4 rope_theta/rope_scaling, v5 rope_parameters)."""
  model_type = hf.get('model_type', 'llama')
  if model_type != 'llama':
    raise ValueError(f"config.json model_type must be 'llama', got {model_type!r}")
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f"hidden_act must be 'silu', got {hf.get('hidden_act')!r}")
  for flag in ('attention_bias', 'mlp_bias'):
    if hf.get(flag, False):
      raise ValueError(f'{flag}=true is not supported (Llama checkpoints have no biases)')
  if hf.get('pretraining_tp', 1) not in (1, None):
    raise ValueError('pretraining_tp != 1 is not supported')
  rope = dict(hf.get('rope_parameters') or {})
  legacy = hf.get('rope_scaling') or {}
  theta = rope.get('rope_theta', hf.get('rope_theta', 10_000.0))
  params = {**legacy, **rope}
  rope_type = params.get('rope_type', params.get('type', 'default'))
  scaling = None
  if rope_type == 'llama3':
    scaling = Llama3RopeScaling(
        factor=float(params['factor']),
        low_freq_factor=float(params['low_freq_factor']),
        high_freq_factor=float(params['high_freq_factor']),
        original_max_position_embeddings=int(params['original_max_position_embeddings']),
    )
  elif rope_type not in ('default', None):
    raise ValueError(f"rope type {rope_type!r} is not supported (only 'default' and 'llama3')")
  heads = int(hf['num_attention_heads'])
  return LlamaConfig(
      vocab_size=int(hf['vocab_size']),
      dim=int(hf['hidden_size']),
      num_layers=int(hf['num_hidden_layers']),
      num_heads=heads,
      num_kv_heads=int(hf.get('num_key_value_heads') or heads),
      head_dim=int(hf.get('head_dim') or hf['hidden_size'] // heads),
      mlp_dim=int(hf['intermediate_size']),
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      rope_theta=float(theta),
      rope_scaling=scaling,
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      max_position_embeddings=int(hf.get('max_position_embeddings', 4096)),
      name=name,
  )


def load_hf_config(path: str | os.PathLike) -> LlamaConfig:
  """Reads `config.json` from a HF model folder (or the file itself)."""
  path = os.fspath(path)
  file = os.path.join(path, 'config.json') if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise ValueError(f'no config.json at {file}')
  with open(file) as f:
    return from_hf_dict(json.load(f), name=os.path.basename(os.path.dirname(os.path.abspath(file))))


_LLAMA3_SCALING = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, LlamaConfig] = {
    # Tiny random configs for tests (CPU, milliseconds).
    'tiny_gqa': LlamaConfig(
        vocab_size=97, dim=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
        mlp_dim=80, norm_eps=1e-6, rope_theta=10_000.0, name='tiny_gqa',
    ),
    'tiny_mha': LlamaConfig(
        vocab_size=89, dim=32, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=8,
        mlp_dim=64, norm_eps=1e-5, rope_theta=500_000.0, name='tiny_mha',
    ),
    'tiny_llama3': LlamaConfig(
        vocab_size=101, dim=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8,
        mlp_dim=48, norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64), tie_embeddings=True,
        name='tiny_llama3',
    ),
    # Real shapes (random weights for benchmarks, or load the checkpoint).
    'llama2_7b': LlamaConfig(
        vocab_size=32_000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        mlp_dim=11_008, norm_eps=1e-5, rope_theta=10_000.0, max_position_embeddings=4096,
        name='llama2_7b',
    ),
    'codellama_7b': LlamaConfig(
        vocab_size=32_016, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        mlp_dim=11_008, norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=16_384,
        name='codellama_7b',
    ),
    'codellama_13b': LlamaConfig(
        vocab_size=32_016, dim=5120, num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
        mlp_dim=13_824, norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=16_384,
        name='codellama_13b',
    ),
    'codellama_34b': LlamaConfig(
        vocab_size=32_000, dim=8192, num_layers=48, num_heads=64, num_kv_heads=8, head_dim=128,
        mlp_dim=22_016, norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=16_384,
        name='codellama_34b',
    ),
    'llama3_8b': LlamaConfig(
        vocab_size=128_256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        mlp_dim=14_336, norm_eps=1e-5, rope_theta=500_000.0, max_position_embeddings=8192,
        name='llama3_8b',
    ),
    'llama3_1_8b': LlamaConfig(
        vocab_size=128_256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        mlp_dim=14_336, norm_eps=1e-5, rope_theta=500_000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131_072, name='llama3_1_8b',
    ),
    'llama3_1_70b': LlamaConfig(
        vocab_size=128_256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
        mlp_dim=28_672, norm_eps=1e-5, rope_theta=500_000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131_072, name='llama3_1_70b',
    ),
    'llama3_2_1b': LlamaConfig(
        vocab_size=128_256, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        mlp_dim=8192, norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), tie_embeddings=True,
        max_position_embeddings=131_072, name='llama3_2_1b',
    ),
}


def get_config(name: str, **overrides) -> LlamaConfig:
  """A preset by name, with optional field overrides (e.g. num_layers=2)."""
  if name not in PRESETS:
    raise ValueError(f'unknown preset {name!r}; known: {sorted(PRESETS)}')
  return dataclasses.replace(PRESETS[name], **overrides)
