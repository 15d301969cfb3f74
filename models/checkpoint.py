"""One entry point for every checkpoint format: a `.gguf` file or a HF Llama folder.

`load_checkpoint` returns the model and, where the checkpoint carries one, its
tokenizer (a GGUF file always does; a HF folder when it holds tokenizer.json).
"""

import os

import jax.numpy as jnp

from models.gguf_loading import load_gguf
from models.gguf_tokenizer import tokenizer_from_gguf
from models.hf_loading import CheckpointError, load_hf_checkpoint
from models.llama import Llama
from models.tokenizer import Tokenizer


def is_gguf(path: str | os.PathLike) -> bool:
  """Whether `path` names a GGUF file (by its `.gguf` suffix)."""
  return os.fspath(path).lower().endswith('.gguf')


def load_checkpoint(path: str | os.PathLike, *, dtype=jnp.float32, mesh=None,
                    fuse_qkv: bool | None = None) -> tuple[Llama, Tokenizer | None]:
  """(model, tokenizer or None) from a `.gguf` file or a HF folder (config.json + safetensors).

  dtype, mesh and fuse_qkv as in `load_gguf` / `load_hf_checkpoint`. A path that is
  neither raises `CheckpointError` naming it.
  """
  path = os.fspath(path)
  if is_gguf(path):
    return (load_gguf(path, dtype=dtype, mesh=mesh, fuse_qkv=fuse_qkv),
            tokenizer_from_gguf(path))
  if not os.path.isdir(path):
    raise CheckpointError(f'{path}: not a .gguf file or a HF checkpoint folder')
  model = load_hf_checkpoint(path, dtype=dtype, mesh=mesh, fuse_qkv=fuse_qkv)
  has_tokenizer = os.path.exists(os.path.join(path, 'tokenizer.json'))
  return model, Tokenizer.from_file(path) if has_tokenizer else None
