"""Tests of experiments.benchmarking and the microbenchmark entry point (CPU, fast)."""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax
from experiments.benchmarking import gpu_clock, report, roofline, sweep, timing, workloads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _sleeps(seconds: float):
  """x -> x after sleeping on the host: a device time with a lower bound on every machine."""
  def fn(x):
    return jax.pure_callback(lambda v: (time.sleep(seconds), v)[1],
                             jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  return fn


def test_device_time_counts_what_the_function_does():
  t = timing.device_time(_sleeps(1e-3), jnp.ones(4), repeats=3, target_s=0.05)
  assert len(t.samples_s) == 3 and t.iterations >= 3 and 'empty loop' in t.method
  assert all(np.isfinite(t.samples_s))
  assert t.flush_bytes == timing.CPU_FLUSH_BYTES and t.median_us == t.median_s * 1e6


def test_device_time_subtracts_the_empty_loop(monkeypatch):
  # A fake clock instead of the machine's (a loaded machine stalls either loop, so no bound on
  # real times holds): n calls of 2 ms in a loop of 0.5 ms an iteration.
  with_fn, without_fn = object(), object()
  monkeypatch.setattr(timing, '_make_loops', lambda fn: (with_fn, without_fn))
  monkeypatch.setattr(timing, '_wall', lambda program, n, flush, args: int(n) * (
      2.5e-3 if program is with_fn else 0.5e-3))
  t = timing.device_time(jnp.sin, jnp.ones(4), repeats=3, target_s=0.05, min_iters=3)
  assert t.iterations == 20  # target_s / (per call + loop) = 0.05 / 2.5e-3
  assert t.samples_s == pytest.approx((2e-3,) * 3) and t.median_s == pytest.approx(2e-3)


def test_device_time_rejects_bad_arguments():
  with pytest.raises(ValueError, match='repeats'):
    timing.device_time(jnp.sin, jnp.ones(4), repeats=0)
  with pytest.raises(ValueError, match='min_iters'):
    timing.device_time(jnp.sin, jnp.ones(4), min_iters=5, max_iters=2)


def test_host_time_is_positive():
  x = jnp.ones((256, 256))
  t = timing.host_time(lambda: x @ x, sync=jax.block_until_ready, repeats=5, warmup=1)
  assert t.median_s > 0 and len(t.samples_s) == 5


def test_floor_hand_worked():
  # B=2 rows, P=4 shared, S=1 private, N=2 q heads, K=1 kv head, H=2, 2-byte dtype.
  # One token's K and V: 2 * K * H * 2 = 8 bytes. Prefix once: 4 * 8 = 32; suffixes:
  # 2 * 1 * 8 = 16; q and out: 2 * B * T * N * H * 2 = 32. Bytes = 80.
  # FLOPs: 4 * B * N * H * (P + S) = 4 * 2 * 2 * 2 * 5 = 160.
  cost = roofline.shared_prefix_cost(2, 4, 1, 2, 1, 2)
  assert (cost.bytes, cost.flops) == (80.0, 160.0)
  assert roofline.floor(80, 160, bandwidth=10, rate=40) == 8.0  # memory-bound: 80/10 > 160/40
  assert roofline.floor(80, 160, bandwidth=100, rate=40) == 4.0  # compute-bound
  # Per-sequence copies: each row reads its own 5 tokens: 2 * 5 * 8 + 32 = 112 bytes.
  assert roofline.per_sequence_cost(2, 4, 1, 2, 1, 2).bytes == 112.0
  # Causal suffix with T=2 query tokens, S=3: the tokens see 6 and 7 keys: 13 in all.
  assert roofline.shared_prefix_cost(1, 4, 3, 1, 1, 1, query_len=2).flops == 4 * 13
  ceilings = roofline.Ceilings(copy_bandwidth=10.0, matmul_rate=40.0)
  assert cost.floor_s(ceilings) == 8.0
  assert ceilings.with_copy_bandwidth(20.0, 'torch').copy_bandwidth == 20.0
  assert ceilings.with_copy_bandwidth(5.0, 'torch').copy_bandwidth == 10.0


@pytest.mark.parametrize('args, match', [
    ((80, 160, 0, 40), 'bandwidth'),
    ((-1, 160, 10, 40), 'bytes'),
])
def test_floor_rejects_bad_input(args, match):
  with pytest.raises(ValueError, match=match):
    roofline.floor(*args)


def test_cost_rejects_bad_heads_and_query_len():
  with pytest.raises(ValueError, match='num_q_heads'):
    roofline.shared_prefix_cost(1, 4, 1, 3, 2, 8)
  with pytest.raises(ValueError, match='query_len'):
    roofline.shared_prefix_cost(1, 4, 1, 2, 1, 8, query_len=2)


def test_measure_ceilings_small():
  c = roofline.measure_ceilings(copy_bytes=2**24, matmul_size=256, repeats=3, target_s=0.01)
  assert c.copy_bandwidth > 0 and c.matmul_rate > 0
  assert set(c.details['copy_bandwidth_by_variant']) == {'uint32 x+1', 'bf16 x*2'}


@pytest.mark.parametrize('shape', [
    workloads.Shape(3, 40, 1, 4, 2, head_dim=16, dtype='float32'),
    workloads.Shape(2, 0, 5, 4, 1, head_dim=8, query_len=3, dtype='float32'),  # nothing shared
], ids=['gqa_prefix=40', 'mqa_prefix=0_query_len=3'])
def test_problem_oracle_matches_tree_attention(shape):
  problem = workloads.make_problem(shape, seed=3)
  rows = workloads.check_rows(shape.batch, 2)
  expected = problem.oracle(rows)
  got = hydrajax.tree_attention_xla(problem.q, problem.k_cache, problem.v_cache, problem.layout)
  np.testing.assert_allclose(got.out[np.asarray(rows)], expected.out, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got.lse[np.asarray(rows)], expected.lse, rtol=1e-5, atol=1e-5)


def test_per_sequence_kv_padding_and_halves():
  shape = workloads.Shape(3, 8, 2, 2, 1, head_dim=4, dtype='float32')
  problem = workloads.make_problem(shape, seed=4)
  k, v = problem.per_sequence_kv(pad_to=4)
  assert k.shape == (3, 12, 1, 4)
  pk, _ = problem.prefix_kv()
  sk, sv = problem.suffix_kv()
  np.testing.assert_array_equal(k[1, :8], pk)
  np.testing.assert_array_equal(k[1, 8:10], sk[1])
  np.testing.assert_array_equal(v[2, 8:10], sv[2])
  np.testing.assert_array_equal(k[0, 10:], np.broadcast_to(problem.k_cache[0], (2, 1, 4)))


def test_grids():
  assert [s.batch for s in workloads.grid(['smoke'])] == [4, 8, 8, 8]
  targets = workloads.grid(['targets'])
  assert any((s.batch, s.prefix, s.heads) == (1024, 32 * 1024, '8/1') for s in targets)
  chunk = workloads.grid(['chunkattention'])
  assert {(s.prefix, s.suffix) for s in chunk if s.label == 'chunkattention 75%'} == {
      (768, 257), (1536, 513), (3072, 1025)}
  both = workloads.grid(['targets', 'targets'])
  assert len(both) == len(targets)  # duplicates dropped
  with pytest.raises(ValueError, match='unknown grid'):
    workloads.grid(['nope'])


def test_jsonl_markdown_and_plots(tmp_path):
  path = str(tmp_path / 'out' / 'r.jsonl')
  writer = report.JsonlWriter(path)
  recs = [dict(impl=i, batch=b, prefix=64, time_us=float(b * (i + 1)), extra=float('inf'))
          for i in range(2) for b in (1, 2, 4)]
  for r in recs:
    writer.append(r)
  with open(path) as f:
    lines = [json.loads(line) for line in f]  # every line is valid JSON
  assert len(lines) == 6 and lines[0]['extra'] == 'inf'
  assert lines[0]['meta']['backend'] == jax.default_backend()
  assert lines[0]['meta']['jax_version'] == jax.__version__
  assert 'timestamp' in lines[0] and lines[0]['meta']['command']
  assert report.read_jsonl(path)[3]['time_us'] == 2.0

  table = report.markdown_table(lines[:2], [('impl', 'impl'), ('µs', 'time_us'), ('x2', lambda r: 2 * r['batch'])])
  assert table.splitlines() == ['| impl | µs | x2 |', '|---|---|---|', '| 0 | 1 | 2 |', '| 0 | 2 | 4 |']

  png = str(tmp_path / 'sweep.png')
  assert report.plot_sweeps(lines, x='batch', y='time_us', series='impl', fixed=('prefix',), path=png)
  with open(png, 'rb') as f:
    assert f.read(8) == PNG_MAGIC
  assert not report.plot_sweeps(lines[:1], x='batch', y='time_us', series='impl', fixed=(),
                                path=str(tmp_path / 'none.png'))
  assert not os.path.exists(tmp_path / 'none.png')
  bars = str(tmp_path / 'bars.png')
  report.plot_bars(['a', 'b'], {'x': [1.0, None], 'y': [2.0, 3.0]}, path=bars, ylabel='t', hline=1.0)
  with open(bars, 'rb') as f:
    assert f.read(8) == PNG_MAGIC


def test_run_metadata_takes_the_commit_from_the_environment(monkeypatch):
  monkeypatch.setenv('HYDRAJAX_GIT_COMMIT', 'abc1234')
  meta = report.run_metadata()
  assert meta['git_commit'] == 'abc1234' and meta['backend'] == jax.default_backend()
  monkeypatch.delenv('HYDRAJAX_GIT_COMMIT')
  assert report.run_metadata()['git_commit'] != 'abc1234'


def test_run_point_reports_wrong_without_timing():
  shape = workloads.Shape(4, 16, 1, 2, 1, head_dim=8, dtype='float32')

  def never_timed():
    raise AssertionError('a wrong implementation must not be timed')

  def wrong(problem, options):
    out = np.zeros(problem.q.shape, np.float32)
    return sweep.Candidate(run=lambda: out, time=never_timed)

  def right(problem, options):
    fn = lambda: np.asarray(hydrajax.tree_attention_xla(
        problem.q, problem.k_cache, problem.v_cache, problem.layout).out, np.float32)
    t = timing.Timing(1e-5, (1e-5,), 1, 'fake', 0)
    return sweep.Candidate(run=fn, time=lambda: t)

  def missing(problem, options):
    raise sweep.Unsupported('not here')

  def broken(problem, options):
    raise RuntimeError('boom')

  ceilings = roofline.Ceilings(1e9, 1e9)
  records = sweep.run_point(shape, dict(wrong=wrong, right=right, missing=missing, broken=broken),
                            None, ceilings)
  by = {r['impl']: r for r in records}
  assert by['wrong']['status'] == 'wrong' and by['wrong']['rel_error'] > 0.5 and 'time_us' not in by['wrong']
  assert by['right']['status'] == 'ok' and by['right']['rel_error'] < 1e-5
  assert by['right']['time_us'] == pytest.approx(10.0)
  floor_us = max(shape.shared_cost().bytes, shape.shared_cost().flops) / 1e9 * 1e6
  assert by['right']['floor_us'] == pytest.approx(floor_us)
  assert by['right']['time_over_floor'] == pytest.approx(10.0 / floor_us)
  assert (by['missing']['status'], by['missing']['reason']) == ('unsupported', 'not here')
  assert by['broken']['status'] == 'failed' and 'boom' in by['broken']['reason']
  records.append(dict(records[1], impl='slow', time_us=40.0))
  sweep.add_speedups(records, ours=('right',))
  assert by['right']['speedup_vs_slow'] == pytest.approx(4.0)


@pytest.mark.parametrize('timer', [
    lambda: timing.device_time(lambda x: x * 2, jnp.ones(8), repeats=2, target_s=1e-4),
    lambda: timing.host_time(lambda: jnp.ones(8) * 2, sync=jax.block_until_ready, repeats=2,
                             warmup=1),
], ids=['device_time', 'host_time'])
def test_timers_sample_the_clock_of_their_repeats(monkeypatch, timer):
  """`Timing.clock` is the sampler's summary over the timed repeats (every read in it)."""
  reads = []

  def read():
    reads.append(1)
    return [gpu_clock.Reading(1755, 690.0, gpu_clock.POWER_CAP)]

  fake_gpu = lambda backend, interval_s=0.01: gpu_clock.ClockSampler(read, 1e-3)
  monkeypatch.setattr(gpu_clock.ClockSampler, 'for_backend', staticmethod(fake_gpu))
  t = timer()
  assert t.clock['sm_mhz_median'] == 1755 and t.clock['power_cap_fraction'] == 1.0
  assert t.clock['clock_samples'] == len(reads) >= 1


def test_run_point_records_the_clock_its_timing_ran_at():
  """A timed implementation's record carries its `Timing.clock`; an untimed one none."""
  shape = workloads.Shape(2, 16, 1, 2, 1, head_dim=8, dtype='float32')
  clock = {'sm_mhz_min': 1500, 'sm_mhz_median': 1755, 'power_cap_fraction': 1.0}

  def build(wrong):
    def candidate(problem, options):
      out = np.asarray(hydrajax.tree_attention_xla(
          problem.q, problem.k_cache, problem.v_cache, problem.layout).out, np.float32)
      t = timing.Timing(4e-6, (4e-6,), 3, 'fake', 0, clock)
      return sweep.Candidate(run=lambda: out * (0 if wrong else 1), time=lambda: t)
    return candidate

  records = sweep.run_point(shape, {'right': build(False), 'wrong': build(True)}, None,
                            roofline.Ceilings(1e9, 1e9))
  by = {r['impl']: r for r in records}
  assert by['right']['sm_mhz_median'] == 1755 and by['right']['power_cap_fraction'] == 1.0
  assert by['wrong']['status'] == 'wrong' and 'sm_mhz_median' not in by['wrong']


def test_run_point_reports_a_non_positive_time_as_untimeable():
  shape = workloads.Shape(2, 16, 1, 2, 1, head_dim=8, dtype='float32')

  def timed_at(median_s):
    def build(problem, options):
      fn = lambda: np.asarray(hydrajax.tree_attention_xla(
          problem.q, problem.k_cache, problem.v_cache, problem.layout).out, np.float32)
      given = timing.Timing(median_s, (median_s,), 3, 'fake', 0)
      return sweep.Candidate(run=fn, time=lambda: given)
    return build

  records = sweep.run_point(shape, dict(zero=timed_at(0.0), negative=timed_at(-2e-6),
                                        fine=timed_at(4e-6)), None, roofline.Ceilings(1e9, 1e9))
  by = {r['impl']: r for r in records}
  for name in ('zero', 'negative'):
    assert by[name]['status'] == 'untimeable' and by[name]['reason'] == sweep.UNTIMEABLE
    assert 'time_us' not in by[name] and 'time_over_floor' not in by[name]
    assert by[name]['rel_error'] < 1e-5  # checked before timing, as every implementation
  assert by['negative']['samples_us'] == [-2.0]
  assert by['fine']['status'] == 'ok' and by['fine']['time_us'] == pytest.approx(4.0)
  sweep.add_speedups(records, ours=('fine',))
  assert not any(k.startswith('speedup') for k in by['fine'])  # untimeable: no baseline time


def test_summarize_table_and_plots_from_given_records(tmp_path):
  ceilings = roofline.Ceilings(1e12, 1e14, {'copy_bandwidth_source': 'given'})
  meta = dict(device='cpu', backend='cpu', jax_version=jax.__version__, command='given')

  def point(batch, impl, status, time_us=None):
    r = dict(kind='point', name=f'B={batch}', label='given', batch=batch, prefix=64, suffix=2,
             heads='4/2', impl=impl, status=status, floor_us=1.0, floor_bound='memory',
             timestamp='now', meta=meta)
    if status == 'ok':
      r.update(time_us=time_us, time_over_floor=time_us)
    if status == 'untimeable':
      r['reason'] = sweep.UNTIMEABLE
    return r

  records = [point(2, 'ours', 'ok', 4.0), point(2, 'base', 'ok', 8.0),
             point(4, 'ours', 'ok', 6.0), point(4, 'base', 'untimeable')]
  sweep.add_speedups(records[:2], ours=('ours',))
  paths = sweep.summarize(records, str(tmp_path), impls=['ours', 'base'], ours=('ours',),
                          ceilings=ceilings, title='given')
  table = (tmp_path / 'table.md').read_text()
  assert '| B=2 | given | 1 (mem) | 4 (4.0x) | 8 (8.0x) |' in table
  assert '| B=4 | given | 1 (mem) | 6 (6.0x) | untimeable |' in table
  assert f'- base: untimeable: {sweep.UNTIMEABLE}' in table
  assert '| B=2 | ours | 2 |' in table  # the speedup table: 8 / 4
  assert set(paths) == {'table', 'time_vs_batch', 'time_over_floor', 'speedup'}
  for what, path in paths.items():
    if what != 'table':
      assert open(path, 'rb').read(8) == PNG_MAGIC


def test_relative_error_flags_nan():
  assert sweep.relative_error(np.array([np.nan, 1.0]), np.ones(2)) == float('inf')
  assert sweep.relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.0


def test_microbench_smoke_end_to_end(tmp_path):
  """--grid=smoke with the smoke settings (small ceilings). Times on a loaded CPU can be noise:
  a point is 'ok' or 'untimeable'; only what does not depend on the machine is asserted."""
  workdir = tmp_path / 'mb'
  cmd = [sys.executable, '-m', 'experiments.microbench', '--grid=smoke', f'--workdir={workdir}',
         '--impls=xla_tree,paged_jnp,mosaic_gpu', '--repeats=1', '--target_ms=1']
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  records = report.read_jsonl(str(workdir / 'results.jsonl'))
  ceilings = records[0]
  assert ceilings['kind'] == 'ceilings' and ceilings['copy_bandwidth'] > 0
  # Smoke sizes, not the H200's 2 GB copy and 8192 matmul.
  assert ceilings['details']['copy_bytes'] == 16_000_000
  assert ceilings['details']['matmul_size'] == 256
  points = [r for r in records if r['kind'] == 'point']
  assert len(points) == 4 * 3
  timed = [r for r in points if r['impl'] in ('xla_tree', 'paged_jnp')]
  assert {r['status'] for r in timed} <= {'ok', 'untimeable'}
  assert all(r['rel_error'] < 2e-3 and r['floor_us'] > 0 for r in timed)  # checked vs the oracle
  assert all(len(r['samples_us']) == 1 for r in timed)  # --repeats=1 given: it wins over smoke's
  assert all(r['time_us'] > 0 for r in timed if r['status'] == 'ok')  # never a negative time
  assert {r['status'] for r in points if r['impl'] == 'mosaic_gpu'} == {'unsupported'}  # no GPU
  table = (workdir / 'table.md').read_text()
  assert '| B=8 P=64 S=5 heads=4/4 |' in table and 'experiments.microbench' in table
  assert (workdir / 'time_over_floor.png').read_bytes()[:8] == PNG_MAGIC
  assert 'experiments.microbench' in (workdir / 'README.md').read_text()


def _host_overhead(*flags, timeout=300):
  cmd = [sys.executable, '-m', 'experiments.host_overhead', *flags]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize('flags, match', [
    (['--steps=500'], '--steps=500, --new_tokens=512'),  # 500 + 20 warm-up > 512
    (['--new_tokens=40', '--steps=30'], '--steps=30, --new_tokens=40'),
    (['--batch=0'], '--batch=0: must be >= 1'),
], ids=['steps_plus_warmup_over_new_tokens', 'small', 'batch=0'])
def test_host_overhead_checks_flags_before_any_work(flags, match):
  done = _host_overhead(*flags)
  assert done.returncode != 0 and match in done.stderr
  assert done.stdout == ''  # nothing measured (the first line is printed before any work)


def test_host_overhead_laptop_settings_run(tmp_path):
  done = _host_overhead('--batch=8', '--system_len=64', '--user_len=8', '--new_tokens=48',
                        '--steps=20', '--chunk_size=16', '--kv_piece=64', f'--workdir={tmp_path}')
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  assert lines[0].startswith('batch 8, 4 system prompts x 64 tokens')
  assert '0 of 20 steps changed the tree' in lines[2]  # without churn nothing changes
  assert lines[4].startswith('engine, model call stub') and 'requests finished' in lines[4]
  records = [json.loads(line) for line in open(tmp_path / 'results.jsonl')]
  assert [r['kind'] for r in records] == ['settings', 'layout_rebuild', 'cache', 'cache', 'engine']
  readme = (tmp_path / 'README.md').read_text()
  assert 'experiments.host_overhead' in readme and lines[4] in readme


def test_workdir_readme_names_the_run_and_its_files(tmp_path):
  from experiments.benchmarking import run_metadata, write_workdir_readme
  (tmp_path / 'table.md').write_text('# a table\n| x |\n')
  meta = dict(run_metadata(), command='python -m experiments.example --flag', git_commit='abc1234')
  path = write_workdir_readme(str(tmp_path), 'Example', '# a table\n| x |\n', meta)
  text = open(path).read()
  assert text.startswith('# Example\n\ncommand: `python -m experiments.example --flag`')
  assert 'commit: abc1234' in text and '| x |' in text and '# a table' not in text
  assert 'files: `table.md`' in text


# ---------------------------------------------------------------------------
# hlo_launches: a compiled program's launches per loop iteration


def test_step_launches_reads_the_loop_body_of_a_compiled_program():
  from experiments.benchmarking import hlo_launches

  def program(x, w):
    def body(_, x):
      return jnp.tanh(x @ w) * 2.0 + jnp.sin(x)
    return jax.lax.fori_loop(0, 3, body, x)

  x = jnp.ones((8, 16), jnp.float32)
  text = jax.jit(program).lower(x, jnp.ones((16, 16), jnp.float32)).compile().as_text()
  launches = hlo_launches.step_launches(text)
  assert launches and all(l.base in text for l in launches)
  summary = hlo_launches.summarize(launches)
  assert summary['launches'] == len(launches) and summary['remat_launches'] == 0
  assert sum(summary['by_category'].values()) == len(launches)
  with pytest.raises(ValueError, match='hlo_text'):
    hlo_launches.step_launches('')


def test_step_launches_counts_rematerialized_and_repeated_work():
  from experiments.benchmarking import hlo_launches
  text = '''HloModule m
%fused_table (p: s32[8]) -> s32[8] {
  %p = s32[8]{0} parameter(0)
  ROOT %c = s32[8]{0} concatenate(%p), dimensions={0}
}
%body (s: (s32[8], f32[4])) -> (s32[8], f32[4]) {
  %s = (s32[8], f32[4]) parameter(0)
  %t = s32[8]{0} fusion(%g), kind=kInput, calls=%fused_table
  %k = (f32[4]{0}, f32[4]{0}) custom-call(%t), custom_call_target="mosaic_gpu_v2"
  %t.remat = s32[8]{0} fusion(%g), kind=kInput, calls=%fused_table
  %k.1 = (f32[4]{0}, f32[4]{0}) custom-call(%t.remat), custom_call_target="mosaic_gpu_v2"
  %t.remat2 = s32[8]{0} fusion(%g), kind=kInput, calls=%fused_table
  %m = f32[4]{0} custom-call(%t.remat2), custom_call_target="__cublas$lt$matmul"
  ROOT %r = (s32[8], f32[4]) tuple(%t, %m)
}
ENTRY %main (a: (s32[8], f32[4])) -> (s32[8], f32[4]) {
  %a = (s32[8], f32[4]) parameter(0)
  ROOT %w = (s32[8], f32[4]) while(%a), condition=%cond, body=%body
}
'''
  launches = hlo_launches.step_launches(text)
  assert [l.name for l in launches] == ['t', 'k', 't.remat', 'k.1', 't.remat2', 'm']
  assert [l.base for l in launches] == ['t', 'k', 't', 'k.1', 't', 'm']
  assert launches[0].what == 'concatenate -> s32[8]{0}' and launches[0].kind == 'kInput'
  summary = hlo_launches.summarize(launches)
  assert summary == dict(launches=6, by_category={'fusion': 3, 'mosaic': 2, 'gemm': 1},
                         remat_launches=2, repeated={'t': 3})

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_microbench_smoke_end_to_end': (),
}
