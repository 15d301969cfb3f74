"""The decode benchmark's modes: same KV per row, same logits, records, derived numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarking import Ceilings
from experiments import decode_benchmark as db
from hydrajax.evaluation import ByteTokenizer
from models.config import get_config
from models.generate import decode, start_decode
from models.llama import Llama, ModelMode

PREFIX, NEW, PAGE, BATCH = 32, 6, 8, 3


@pytest.fixture(scope='module')
def setup():
  model = Llama(get_config('tiny_gqa'), rngs=nnx.Rngs(21), dtype=jnp.float32)
  k, v, first, seconds = db.prefill_prefix(
      model, db.random_prompt(model.config.vocab_size, PREFIX, seed=22), chunk=16)
  return model, (k, v), first, seconds


@pytest.mark.parametrize('mode', ['tree', 'paged', 'no_sharing'])
def test_modes_give_every_row_the_same_context(mode):
  setup = db.decode_setup(db.Case(mode, 'xla', BATCH, PREFIX, NEW), PAGE)
  indices, lengths = setup.plan.row_token_indices()
  np.testing.assert_array_equal(lengths, [PREFIX] * BATCH)  # before decoding: the prompt
  base = np.asarray(setup.rows.write_base)
  for b in range(BATCH):
    prefix_slots = indices[b, :PREFIX]
    if mode == 'no_sharing':  # its own copy
      np.testing.assert_array_equal(prefix_slots, setup.prefix_dest[b] + np.arange(PREFIX))
    else:  # the one stored copy
      np.testing.assert_array_equal(prefix_slots, np.arange(PREFIX))
    # Generated token j goes to the row's private slot base + j, inside its own pages.
    size = setup.plan.page_size
    own = (np.array(setup.plan.private_pages[b])[:, None] * size + np.arange(size)).reshape(-1)
    assert set(base[b] + np.arange(NEW)) <= set(own)
  assert setup.kv_tokens % PAGE == 0 and setup.plan.page_size % PAGE == 0


@pytest.mark.parametrize('length', [700, 1001])
def test_a_text_prompt_has_its_length_and_ends_with_a_question(length):
  tokenizer = ByteTokenizer()
  tokens = db.text_prompt(tokenizer, length)
  assert len(tokens) == length
  text = tokenizer.decode(tokens)
  assert 'The dog named' in text and text.endswith('?\nAnswer:')


def test_all_modes_decode_the_same_tokens(setup):
  model, prefix_kv, first, _ = setup
  graphdef, params = nnx.split(model)
  key, stops = jax.random.key(0), jnp.zeros((0,), jnp.int32)
  results = {}
  for mode, impl in (('tree', 'xla'), ('paged', 'xla'), ('no_sharing', 'xla'),
                     ('no_attention', ModelMode.NO_ATTENTION)):
    s = db.decode_setup(db.Case(mode, 'xla', BATCH, PREFIX, NEW), PAGE)
    cache = db._build_cache(*prefix_kv, s.kv_tokens, s.prefix_dest)
    logits = jnp.broadcast_to(first, (BATCH, first.shape[-1]))
    state = start_decode(cache, logits, s.rows, key, stops, max_new_tokens=NEW, sampling=db.GREEDY)
    state = decode(graphdef, params, state, s.plan.to_device(), s.rows, key, stops,
                   jnp.int32(NEW), sampling=db.GREEDY, impl=impl)
    results[mode] = (np.asarray(state.tokens), np.asarray(state.logprobs))
  tree_tokens, tree_logprobs = results['tree']
  for mode in ('paged', 'no_sharing'):
    np.testing.assert_array_equal(results[mode][0], tree_tokens)
    np.testing.assert_allclose(results[mode][1], tree_logprobs, rtol=1e-4, atol=1e-5)
  assert not np.allclose(results['no_attention'][1], tree_logprobs)


def test_run_case_records_and_memory_checks(setup):
  model, prefix_kv, first, _ = setup
  case = db.Case('tree', 'xla', BATCH, PREFIX, NEW)
  r = db.run_case(model, case, prefix_kv, first, page_size=PAGE, memory_limit=2**30,
                  max_decode_s=0.05)
  assert r['status'] == 'ok' and r['resolved_impl'] == 'xla'
  assert 1 <= r['steps_timed'] <= NEW - 3 and r['first_step'] == 3  # a warm-up and a 1-step call
  assert r['step_s'] > 0 and r['call_overhead_s'] >= 0 and r['one_step_call_s'] > 0
  assert r['tokens_per_s'] == pytest.approx(BATCH / r['step_s'])
  assert r['program_bytes'] >= r['cache_bytes'] + r['weights_bytes']
  small = db.run_case(model, db.Case('no_sharing', 'xla', BATCH, PREFIX, NEW), prefix_kv, first,
                      page_size=PAGE, memory_limit=r['weights_bytes'] + 1, max_decode_s=0.05)
  assert small['status'] == 'does_not_fit' and 'KV cache' in small['reason']
  kernel = db.run_case(model, db.Case('tree', 'mosaic_gpu', BATCH, PREFIX, NEW), prefix_kv, first,
                       page_size=PAGE, memory_limit=2**30, max_decode_s=0.05)
  if jax.default_backend() == 'cpu':
    assert kernel['status'] == 'unsupported' and 'MOSAIC_GPU' in kernel['reason']


def test_derived_numbers():
  config = get_config('codellama_7b')
  ceilings = Ceilings(copy_bandwidth=4e12, matmul_rate=8e14)

  def rec(name, mode, step_s):
    return dict(name=name, mode=mode, batch=1024, prefix=16384, status='ok', step_s=step_s,
                tokens_per_s=1024 / step_s, suffix_mid=64.0, program_bytes=90 * 2**30,
                weights_bytes=13 * 2**30, memory_limit_bytes=130 * 2**30)

  records = [rec('no_attention', 'no_attention', 0.020), rec('tree_xla', 'tree', 0.050),
             rec('paged_xla', 'paged', 1.0)]
  db.add_derived(records, config, ceilings)
  ceiling, tree, paged = records
  # Tree attention floor, by hand: prefix FLOPs 4*B*N*H*(P+S) per layer = 2.77e11 at 8e14 FLOP/s
  # (0.346 ms) beats the bytes (16384 prefix + 1024*64 suffix tokens of 16 KiB: 1.35 GB, 0.34 ms).
  flops = 4 * 1024 * 32 * 128 * (16384 + 64)
  assert tree['attention_floor_s'] == pytest.approx(32 * flops / 8e14, rel=1e-6)
  assert tree['attention_s'] == pytest.approx(0.030)
  assert tree['speedup_vs_paged_xla'] == pytest.approx(20.0)
  assert tree['fraction_of_ceiling'] == pytest.approx(0.4)
  assert ceiling['matmul_efficiency'] == pytest.approx(
      db.decode_matmul_flops(config, 1024) / 0.020 / 8e14)
  assert paged['attention_floor_s'] > tree['attention_floor_s'] * 10  # it reads the prefix B times
  assert 'attention_kernel_s' not in tree  # no kernel profile in these records
  # With one step's device time of both (CUPTI): the share in device time too.
  ceiling['kernel_step_s'], tree['kernel_step_s'] = 0.018, 0.024
  db.add_derived(records, config, ceilings)
  assert tree['attention_kernel_s'] == pytest.approx(0.006)
  assert tree['attention_kernel_floor_s'] == pytest.approx(tree['attention_floor_s'])
  assert tree['attention_kernel_over_floor'] == pytest.approx(0.006 / tree['attention_floor_s'])
  # The profiled step holds more private tokens than the timed steps' mean: its floor is taken
  # there, with the implementation's own kernels against it too.
  tree.update(kernel_suffix=128, impl_kernels_s=0.005)
  db.add_derived(records, config, ceilings)
  # 128 tokens a row: now the bytes bound it (16384 + 1024*128 tokens of 16 KiB, q and out).
  later = 32 * ((16384 + 1024 * 128) * 16384 + 2 * 1024 * 32 * 128 * 2) / 4e12
  assert tree['attention_kernel_floor_s'] == pytest.approx(later, rel=1e-6)
  assert tree['attention_floor_s'] == pytest.approx(32 * flops / 8e14, rel=1e-6)  # unchanged
  assert tree['attention_kernel_over_floor'] == pytest.approx(0.006 / later)
  assert tree['impl_kernels_over_floor'] == pytest.approx(0.005 / later)
  assert 'attention_kernel_matched_s' not in tree  # no full profiles in these records
  # With every kernel of both steps: the GEMMs both launch alike (one drifted 0.5 ms slower in
  # the tree's step) drop out; fusions named apart, or launched a different number of times,
  # stay on their sides.
  ceiling['kernel_profile'] = [['nvjet_a', 8000.0, 64], ['fusion_1', 200.0, 32],
                               ['scatter', 40.0, 32]]
  tree['kernel_profile'] = [['nvjet_a', 8500.0, 64], ['private_kernel', 2000.0, 32],
                            ['fusion_9', 210.0, 32], ['scatter', 50.0, 96]]
  db.add_derived(records, config, ceilings)
  assert tree['attention_kernel_matched_s'] == pytest.approx((2000 + 210 + 50 - 200 - 40) * 1e-6)
  assert tree['attention_kernel_matched_over_floor'] == pytest.approx(
      tree['attention_kernel_matched_s'] / later)
  (estimate,) = [e for e in db.max_batch_estimates(records, config) if e['name'] == 'tree_xla']
  shared = config.kv_bytes_per_token(2) * 16384
  per_row = (90 * 2**30 - 13 * 2**30 - shared) / 1024
  assert estimate['max_batch'] == int((130 * 2**30 - 13 * 2**30 - shared) // per_row)


def test_summary_lists_measured_points_and_their_costliest_kernels():
  records = [
      dict(status='ok', name='tree_mosaic_gpu', batch=1024, prefix=1024, step_s=0.02512,
           program_bytes=3 * 2**30, attention_over_floor=1.97,
           attention_kernel_matched_over_floor=None,
           top_kernels=[['gemm', 4222.4, 64], ['private', 2703.0, 32], ['merge', 10.0, 1]]),
      dict(status='does_not_fit', name='paged_xla', batch=1024, prefix=1024),
      # A GPU run's record: the clock its timed steps ran at (`gpu_clock.ClockSampler`).
      {'status': 'ok', 'name': 'no_attention', 'batch': 1024, 'prefix': 1024, 'step_s': 0.011,
       'program_bytes': 2 * 2**30, 'attention_over_floor': 0.0, 'sm_mhz_min': 1725.0,
       'sm_mhz_median': 1860.0, 'power_cap_fraction': 0.25},
  ]
  assert db.summary_lines(records, kernels=2) == [
      'tree_mosaic_gpu B=1024 P=1024: step 25.12 ms, program 3.0 GiB, attn/floor 1.97, '
      'matched/floor 0.00',
      '       4222 us x64   gemm',
      '       2703 us x32   private',
      ('no_attention B=1024 P=1024: step 11.00 ms, program 2.0 GiB, attn/floor 0.00, '
       'matched/floor 0.00, SM clock 1725-1860 MHz (min-median), power cap 25% of samples'),
  ]


def test_floors_on_a_mesh_are_one_devices_share():
  """At tp:2 each device attends half the heads and runs half the matmuls; dp splits the rows."""
  config = get_config('codellama_13b')
  ceilings = Ceilings(copy_bandwidth=4e12, matmul_rate=8e14)

  def floors(mesh):
    r = dict(name='tree_mosaic_gpu', mode='tree', batch=1024, prefix=16384, status='ok',
             step_s=0.04, tokens_per_s=1024 / 0.04, suffix_mid=64.0, mesh=mesh)
    n = dict(r, name='no_attention', mode='no_attention', step_s=0.03)
    db.add_derived([n, r], config, ceilings)
    return r['attention_floor_s'], n['matmul_efficiency'], r['devices']

  one, eff, devices = floors('none')
  assert devices == 1 and eff == pytest.approx(db.decode_matmul_flops(config, 1024) / 0.03 / 8e14)
  half, half_eff, devices = floors('tp:2')
  assert devices == 2 and half == pytest.approx(one / 2) and half_eff == pytest.approx(eff / 2)
  rows, _, devices = floors('dp:2,tp:2')
  assert devices == 4 and rows < half  # half the rows, the same prefix on each shard


def test_experiment_writes_its_outputs_and_rebuilds(tmp_path):
  import json
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get('PYTHONPATH', ''))
  # The runs, one after another, share their compiled programs (one writer at a time): a later
  # run loads what an earlier one compiled (the model, its prefill, the points kept).
  env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'programs'),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  base = [sys.executable, '-m', 'experiments.throughput', '--preset=tiny_mha']
  run = lambda *args: subprocess.run(base + list(args), cwd=root, env=env, capture_output=True,
                                     text=True, timeout=600)
  out = run('--batches=2', '--prefixes=16', '--new_tokens=4', '--modes=no_attention,tree',
            '--impls=xla', '--page_size=8', '--max_decode_s=0.05', f'--workdir={tmp_path / "a"}')
  assert out.returncode == 0, out.stderr[-3000:]
  names = {'raw.jsonl', 'throughput.jsonl', 'table.md', 'max_batch.md', 'README.md'}
  assert names <= set(os.listdir(tmp_path / 'a'))
  with open(tmp_path / 'a' / 'throughput.jsonl') as f:
    records = [json.loads(line) for line in f]
  assert [(r['name'], r['status'], r['fuse_qkv']) for r in records] == [
      ('no_attention', 'ok', True), ('tree_xla', 'ok', True)]  # one q/k/v weight by default
  assert records[1]['attention_s'] == pytest.approx(records[1]['step_s'] - records[0]['step_s'])
  # The rebuild takes the model from the records (tiny_mha), not from --preset's default.
  out = subprocess.run(base[:-1] + [f'--rebuild={tmp_path / "a" / "raw.jsonl"}',
                                    f'--workdir={tmp_path / "b"}'],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  table = lambda d: [l for l in (tmp_path / d / 'table.md').read_text().splitlines()
                     if l.startswith('| ')]
  assert table('a') == table('b') and len(table('a')) == 3
  remat_on = '{"xla_disable_hlo_passes": ""}'  # XLA's default passes (a CPU has no remat pass)
  out = run('--batches=2', '--prefixes=16', '--new_tokens=4', '--modes=tree', '--impls=xla',
            '--page_size=8', '--max_decode_s=0.05', '--nofuse_qkv', f'--compiler_options={remat_on}',
            f'--workdir={tmp_path / "c"}')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / 'c' / 'raw.jsonl') as f:
    apart = [json.loads(line) for line in f]
  assert [(r['status'], r['fuse_qkv'], r['compiler_options']) for r in apart] == [
      ('ok', False, remat_on)]
  out = run('--batches=2', '--prefixes=16', '--compiler_options=[1]', f'--workdir={tmp_path / "d"}')
  assert out.returncode != 0 and '--compiler_options must be a JSON object' in out.stderr
  # --resume keeps the points that ran and runs the new one (a second batch size).
  with open(tmp_path / 'a' / 'raw.jsonl') as f:
    first = [json.loads(line) for line in f]
  out = run('--batches=2,3', '--prefixes=16', '--new_tokens=4', '--modes=no_attention,tree',
            '--impls=xla', '--page_size=8', '--max_decode_s=0.05', '--resume',
            f'--workdir={tmp_path / "a"}')
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'resuming: 2 points kept, 2 to run' in out.stderr
  with open(tmp_path / 'a' / 'raw.jsonl') as f:
    resumed = [json.loads(line) for line in f]
  assert [(r['name'], r['batch']) for r in resumed] == [
      ('no_attention', 2), ('tree_xla', 2), ('no_attention', 3), ('tree_xla', 3)]
  assert [r['timestamp'] for r in resumed[:2]] == [r['timestamp'] for r in first]

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_experiment_writes_its_outputs_and_rebuilds': (),
}
