"""Every experiment refuses a bad flag before any work: one line naming the flag, exit status 1;
`--help` exits 0. All runs in one subprocess (tests/experiment_flags_driver.py): an experiment's
flags are parsed by its own `main` (through experiments.cli.run) as `python -m` would."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
_NO_SUCH = '/no/such/path'

# experiment -> [(flags, words the error must hold)]
BAD = {
    'apps_eval': [(['--samples=-2'], 'flag --samples=-2: must be >= 1'),
                  (['--impl=flash'], 'flag --impl=flash: value should be one of'),
                  (['--modes=two_level,both'], 'flag --modes'),
                  (['--k=0'], 'flag --k'),
                  ([f'--problems={_NO_SUCH}'], f'flag --problems={_NO_SUCH}: no such file'),
                  ([f'--checkpoint={_NO_SUCH}'], f'--checkpoint={_NO_SUCH} does not exist'),
                  (['--model=hf'], '--model=hf needs --checkpoint')],
    'break_even': [(['--lengths=64,-4'], 'flag --lengths'), (['--repeats=0'], 'flag --repeats')],
    'demo': [(['--questions=0'], 'flag --questions'), (['--new_tokens=0'], 'flag --new_tokens')],
    'tpu_cache_layout': [(['--num_layers=2,-1'], 'flag --num_layers'),
                         (['--preset=gpt2'], 'flag --preset')],
    'real_model_agreement': [(['--questions=65'], 'flag --questions'),
                             (['--impls=flash'], 'flag --impls'),
                             (['--dtypes=int8'], 'flag --dtypes')],
    'host_overhead': [(['--batch=0'], 'flag --batch=0: must be >= 1')],
    'microbench': [(['--repeats=0'], 'flag --repeats=0')],
    'needle_qa': [(['--new_tokens=2'], 'flag --new_tokens=2'),
                  (['--questions=1,-8'], 'flag --questions'),
                  (['--impl=flash'], 'flag --impl'),
                  ([f'--checkpoint={_NO_SUCH}'], f'--checkpoint={_NO_SUCH} does not exist')],
    'sandbox_overhead': [(['--repeats=0'], 'flag --repeats=0: must be >= 1')],
    'server_start': [(['--timeout_s=0'], 'flag --timeout_s=0.0: must be >= 1')],
    'tpu_aot': [(['--batch=0'], 'flag --batch=0: must be >= 1'),
                (['--programs=decode,bogus'], 'flag --programs')],
    'serving': [(['--num_requests=0'], 'flag --num_requests=0'), (['--rates=4,-1'], '--rates')],
    'throughput': [(['--batches=-4'], 'flag --batches'),
                   (['--preset=llama2_7b', '--prefixes=8192'],
                    "--prefixes: a prompt of 8192 tokens is longer than the model's maximum "
                    'position (4096'),
                   (['--impls=flash'], 'flag --impls')],
    'tp_greedy_check': [(['--samples=0'], 'flag --samples=0')],
    'tp_scaling': [([], 'flag --tp1')],
    'tpu_block_sizes': [(['--generations=v4'], 'flag --generations')],
    'train_bench': [(['--repeats=0'], 'flag --repeats=0')],
    'train_grpo_toy': [(['--steps=0'], 'flag --steps=0')],
    'train_parallel_step': [(['--devices=1'], 'flag --devices=1: must be >= 2')],
    'train_tiny_coder': [(['--steps=0'], 'flag --steps=0')],
    'train_tree_bench': [(['--repeats=0'], 'flag --repeats=0')],
    'train_tree_step': [(['--repeats=0'], 'flag --repeats=0')],
    'xla_programs': [(['--batch=0'], 'flag --batch=0')],
}
COMMANDS = sorted(p.stem for p in (ROOT / 'experiments').glob('*.py')
                  if 'cli.run(main' in p.read_text())


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  cases = {name: [flags for flags, _ in BAD.get(name, [])] + [['--help']] for name in COMMANDS}
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, str(ROOT / 'tests' / 'experiment_flags_driver.py'),
                         json.dumps(cases)], cwd=tmp_path_factory.mktemp('cwd'), env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  out = {}
  for line in done.stdout.splitlines():
    if line.startswith('{'):
      r = json.loads(line)
      out[r['experiment'], tuple(r['argv'])] = r
  return out


def test_every_experiment_command_is_covered():
  assert set(BAD) == set(COMMANDS), 'add the new experiment to BAD (a flag it must refuse)'


@pytest.mark.parametrize('name, flags, words', [(n, f, w) for n, cases in BAD.items()
                                                for f, w in cases])
def test_a_bad_flag_is_refused_before_any_work(runs, name, flags, words):
  r = runs[name, tuple(flags)]
  assert not r['timed_out'], f'{name} {flags} ran instead of refusing the flag'
  assert r['code'] == 1 and words in r['stderr'], r
  assert 'Traceback' not in r['stderr']


@pytest.mark.parametrize('name', COMMANDS)
def test_help_exits_0(runs, name):
  assert runs[name, ('--help',)]['code'] == 0, runs[name, ('--help',)]
