"""Damaged HF checkpoint folders (issue 13): clear errors naming the file and what is wrong.

Each case copies a tiny fixture into tmp_path and breaks one thing.
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import hf_loading
from models.hf_loading import CheckpointError

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')


def _copy(tmp_path, name='tiny_gqa'):
  folder = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, f'hf_{name}'), folder)
  return folder


def test_truncated_safetensors_names_the_file(tmp_path):
  folder = _copy(tmp_path)
  file = folder / 'model.safetensors'
  data = file.read_bytes()
  file.write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match=r'model\.safetensors.*truncated or corrupt'):
    hf_loading.load_hf_checkpoint(folder)
  file.write_bytes(data[:5])  # not even a header
  with pytest.raises(CheckpointError, match=r'model\.safetensors.*truncated or corrupt'):
    hf_loading.load_hf_checkpoint(folder)


def test_bad_config_json_names_the_file(tmp_path):
  folder = _copy(tmp_path)
  (folder / 'config.json').write_text('{"vocab_size": 97,')
  with pytest.raises(CheckpointError, match=r'config\.json: the model config is not valid JSON'):
    hf_loading.load_hf_checkpoint(folder)
  (folder / 'config.json').write_text('[1, 2]')
  with pytest.raises(CheckpointError, match=r'config\.json: must hold a JSON object'):
    hf_loading.load_hf_checkpoint(folder)
  with open(os.path.join(FIXTURES, 'hf_tiny_gqa', 'config.json')) as f:
    config = json.load(f)
  del config['hidden_size']
  (folder / 'config.json').write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"config\.json: missing field 'hidden_size'"):
    hf_loading.load_hf_checkpoint(folder)


def test_bad_index_json_names_the_file(tmp_path):
  folder = _copy(tmp_path, 'tiny_mha')
  index = folder / hf_loading.INDEX_FILE
  index.write_text('{"weight_map": ')
  with pytest.raises(CheckpointError, match=r'index\.json: the shard index is not valid JSON'):
    hf_loading.load_hf_checkpoint(folder)
  index.write_text('{"metadata": {}}')
  with pytest.raises(CheckpointError, match=r'index\.json: needs a non-empty "weight_map"'):
    hf_loading.load_hf_checkpoint(folder)


def _edit_index(folder, edit):
  index = folder / hf_loading.INDEX_FILE
  content = json.loads(index.read_text())
  edit(content['weight_map'])
  index.write_text(json.dumps(content))


def test_index_naming_a_wrong_or_missing_shard(tmp_path):
  folder = _copy(tmp_path, 'tiny_mha')
  name = 'model.layers.0.mlp.up_proj.weight'
  files = sorted(set(json.loads((folder / hf_loading.INDEX_FILE).read_text())['weight_map']
                     .values()))

  def wrong(weight_map):
    weight_map[name] = next(f for f in files if f != weight_map[name])

  _edit_index(folder, wrong)
  with pytest.raises(CheckpointError, match=rf'maps {name} to model-0000\d-of-00005.*wrong shard'):
    hf_loading.load_hf_checkpoint(folder)
  _edit_index(folder, lambda m: m.__setitem__(name, 'model-00009-of-00005.safetensors'))
  with pytest.raises(CheckpointError, match='lists model-00009-of-00005.safetensors, which is not'):
    hf_loading.load_hf_checkpoint(folder)


@pytest.mark.parametrize('target', ['../outside.safetensors', '/etc/passwd', 'sub/../../x'])
def test_index_pointing_outside_the_folder_is_refused(tmp_path, target):
  folder = _copy(tmp_path, 'tiny_mha')
  (tmp_path / 'outside.safetensors').write_bytes(b'')
  _edit_index(folder, lambda m: m.__setitem__('model.norm.weight', target))
  with pytest.raises(CheckpointError, match='points outside the checkpoint folder'):
    hf_loading.load_hf_checkpoint(folder)


def test_int32_weights_are_refused(tmp_path):
  folder = _copy(tmp_path)
  tensors = load_file(str(folder / 'model.safetensors'))
  name = 'model.layers.1.self_attn.k_proj.weight'
  tensors[name] = tensors[name].astype(np.int32)
  save_file(tensors, str(folder / 'model.safetensors'))
  with pytest.raises(CheckpointError, match=rf'tensor {name} has dtype I32.*refused'):
    hf_loading.load_hf_checkpoint(folder)


@pytest.mark.parametrize('bad', [np.nan, np.inf])
def test_non_finite_weights_are_refused(tmp_path, bad):
  folder = _copy(tmp_path)
  tensors = load_file(str(folder / 'model.safetensors'))
  name = 'model.layers.0.mlp.down_proj.weight'
  tensors[name][3, 5] = bad
  save_file(tensors, str(folder / 'model.safetensors'))
  with pytest.raises(CheckpointError, match=rf'model\.safetensors: tensor {name} holds NaN or inf'):
    hf_loading.load_hf_checkpoint(folder)
