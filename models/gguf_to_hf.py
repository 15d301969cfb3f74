"""A GGUF Llama file -> a HF folder (model.safetensors, config.json, tokenizer.json) transformers loads.

  python -m models.gguf_to_hf --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --out=/tmp/smollm2-hf \
      [--dtype=float32]

The weights are dequantized (`gguf.quants.dequantize`), llama.cpp's Q/K row order is
undone, and each tensor is written under its HF name; the tokenizer is the one
`tokenizer_from_gguf` builds, with its BOS/EOS and chat template in
tokenizer_config.json. `load_hf_checkpoint` and transformers' `from_pretrained` both
read the folder.
"""

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from hydrajax import command_line
from models.gguf_loading import config_from_reader, hf_tensor_reader, open_gguf
from models.gguf_tokenizer import tokenizer_from_gguf
from models.hf_loading import expected_hf_shapes

DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16, 'float16': np.float16}


def convert(gguf_path: str | os.PathLike, out: str | os.PathLike, *,
            dtype: str = 'float32') -> None:
  """Writes the HF folder `out` (created if needed) for the GGUF Llama file `gguf_path`."""
  if dtype not in DTYPES:
    raise ValueError(f'dtype must be one of {sorted(DTYPES)}, got {dtype!r}')
  reader = open_gguf(gguf_path)
  config = config_from_reader(reader)
  get = hf_tensor_reader(reader, config)
  tokenizer = tokenizer_from_gguf(gguf_path)
  out = os.fspath(out)
  os.makedirs(out, exist_ok=True)
  tensors = {name: np.ascontiguousarray(get(name).astype(DTYPES[dtype]))
             for name in expected_hf_shapes(config)}
  save_file(tensors, os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
  tok = tokenizer.tokenizer
  name_of = lambda i: None if i is None else tok.id_to_token(i)
  hf = config.to_hf_dict()
  hf.update(torch_dtype=dtype, bos_token_id=tokenizer.bos_id, eos_token_id=(
      list(tokenizer.eos_ids) if len(tokenizer.eos_ids) != 1 else tokenizer.eos_ids[0]))
  _write_json(os.path.join(out, 'config.json'), hf)
  tok.save(os.path.join(out, 'tokenizer.json'))
  tok_config = dict(tokenizer_class='PreTrainedTokenizerFast', add_bos_token=tokenizer.bos_id
                    is not None, bos_token=name_of(tokenizer.bos_id),
                    eos_token=name_of(tokenizer.eos_ids[0] if tokenizer.eos_ids else None),
                    clean_up_tokenization_spaces=False, model_max_length=config.max_position_embeddings)
  if tokenizer.chat_template is not None:
    tok_config['chat_template'] = tokenizer.chat_template
  _write_json(os.path.join(out, 'tokenizer_config.json'),
              {k: v for k, v in tok_config.items() if v is not None})


def _write_json(path: str, content: dict) -> None:
  with open(path, 'w') as f:
    json.dump(content, f, indent=1, ensure_ascii=False)


def main(argv):
  del argv
  convert(FLAGS.gguf, FLAGS.out, dtype=FLAGS.dtype)
  print(FLAGS.out)


if __name__ == '__main__':
  from absl import flags

  FLAGS = flags.FLAGS
  flags.DEFINE_string('gguf', None, 'the .gguf file', required=True)
  flags.DEFINE_string('out', None, 'the HF folder to write', required=True)
  flags.DEFINE_enum('dtype', 'float32', sorted(DTYPES), 'dtype of the written weights')
  command_line.run(main)
