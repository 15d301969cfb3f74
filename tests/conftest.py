"""Shared helpers of the core tests: random sharing trees, random inputs, tolerances, the oracle."""

import os

# Eight fake CPU devices for the tensor/data parallel tests (set before jax starts its backends;
# the other tests run on device 0 as before).
if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

# CPU computations run inline, not dispatched asynchronously. An interpret-mode kernel runs in
# XLA host callbacks that call JAX themselves; when the test's thread dispatched more JAX work
# while such a kernel was still running, the two deadlocked: seen in a clean-clone run in
# session 25, whose stacks (faulthandler) showed the test thread in a jnp op and the kernel's
# callback in another (test_llama_generate.py::test_the_models_attention_config_reaches_its_plans);
# the CI of stop 23, held to its 90-minute limit, stopped the same way. (Only the config flag
# does this; JAX does not read it from the environment, so subprocesses keep async dispatch:
# none of them runs an interpret-mode kernel.)
jax.config.update('jax_cpu_enable_async_dispatch', False)

# Each test process keeps its compiled programs on disk for the run: tests build the same
# small models and engines again and again (and `_free_compiled_programs` drops the in-memory
# copies), and a program compiled once is then loaded, not compiled. Seen on 2 cores: 8 engine
# tests in 70-87 s against 135-169 s. One folder per process (no two writers), removed at exit.
_COMPILED_PROGRAMS = tempfile.mkdtemp(prefix='hydrajax-test-programs-')
atexit.register(shutil.rmtree, _COMPILED_PROGRAMS, ignore_errors=True)
jax.config.update('jax_compilation_cache_dir', _COMPILED_PROGRAMS)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)

import jax.numpy as jnp  # noqa: E402
import numpy as np
import pytest

import hydrajax as hj


def _free_compiled_programs():
  jax.clear_caches()
  gc.collect()


def _mapped_regions() -> int:
  """The process's memory mappings (0 where /proc is not there)."""
  try:
    with open('/proc/self/maps', 'rb') as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


# An XLA CPU executable holds a few memory mappings for its code, and a test worker compiles
# thousands of programs: interpret-mode kernels compile one per kernel call. The kernel's limit
# is vm.max_map_count (65530); near it XLA cannot start a thread or map code (a worker once
# aborted mid-compile). An xdist worker peaked at 19.7K mappings in one CI run, and the
# interpret tests of test_mosaic_gpu_kernels.py alone add about 60 a second; how many of a
# module's tests a worker gets depends on the run. So compiled programs are dropped after any
# test that leaves more than this many mappings, and after every module. Fixtures recompile
# what they need.
MAX_MAPPINGS = 12_000


@pytest.fixture(scope='module', autouse=True)
def _free_compiled_programs_after_each_module():
  yield
  _free_compiled_programs()


@pytest.fixture(autouse=True)
def _bound_memory_mappings():
  yield
  if _mapped_regions() > MAX_MAPPINGS:
    _free_compiled_programs()


# `make test` (CI) must finish within 30 minutes on a 2-core machine, and some tests are slow
# there: interpret mode runs a kernel op by op in host callbacks (30-170 s a case of the Mosaic
# GPU kernel tests), a model sharded over 8 fake CPU devices compiles for each mesh (30-40 s a
# case), experiments' end-to-end runs compile many programs. A test class, or a module, may name
# in `representative_cases` ({test name: ids to keep}) the cases of its many-case tests that
# `make test` runs: chosen to cover each kv-head fold (MHA, GQA, MQA), T > 1, padded rows, each
# knob, each kind of mesh; an empty tuple leaves a whole test (parametrized or not) to the full
# run, where another test of the default run covers the same path more cheaply. The compiled
# kernel classes run every case on a GPU, and `--all-cases` (HYDRAJAX_ALL_CASES=1, `make
# test-all`) runs every case anywhere.
def pytest_addoption(parser):
  parser.addoption('--all-cases', action='store_true',
                   help='run every case, not only the `representative_cases` of slow tests')


def representative_cases(item) -> tuple[str, ...] | None:
  """The ids of `item`'s test that a default run keeps (its class's, else its module's), or
  None: all."""
  table = getattr(item.cls, 'representative_cases', None)
  if table is None:
    table = getattr(item.module, 'representative_cases', {})
  return table.get(getattr(item, 'originalname', None))


def pytest_collection_modifyitems(config, items):
  if config.getoption('--all-cases') or os.environ.get('HYDRAJAX_ALL_CASES'):
    return
  kept, dropped = [], []
  for item in items:
    cases = representative_cases(item)
    case = getattr(getattr(item, 'callspec', None), 'id', None)
    (dropped if cases is not None and case not in cases else kept).append(item)
  if dropped:
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


# Per-dtype tolerances of a fast path against the naive oracle (which computes in float32).
# bf16: the probabilities are rounded to bf16 before the PV product, and the output is bf16.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
}
# The lse of bf16 inputs is a float32 softmax over exactly the same (bf16) scores.
LSE_TOLERANCES = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=1e-4, atol=1e-4),
}

# The oracle, jitted so that a case pays one compile instead of one per op.
naive_tree_attention = jax.jit(hj.naive_tree_attention, static_argnames=('plan', 'scale'))


def assert_states_close(actual: hj.PartialState, expected: hj.PartialState, dtype=None, **tol):
  """out and lse agree within the dtype's tolerance; NaN never passes; -inf must match exactly."""
  dtype = jnp.dtype(dtype or expected.out.dtype)
  out_tol = tol or TOLERANCES[dtype]
  lse_tol = tol or LSE_TOLERANCES[dtype]
  a_out, e_out = (np.asarray(x.out, np.float32) for x in (actual, expected))
  a_lse, e_lse = (np.asarray(x.lse, np.float32) for x in (actual, expected))
  assert a_out.shape == e_out.shape and a_lse.shape == e_lse.shape
  assert actual.lse.dtype == jnp.float32
  assert not np.isnan(a_out).any(), 'NaN in out'
  assert not np.isnan(a_lse).any(), 'NaN in lse'
  assert not np.isnan(e_out).any() and not np.isnan(e_lse).any(), 'NaN in the expected state'
  np.testing.assert_allclose(a_out, e_out, err_msg='out', **out_tol)
  # assert_allclose treats -inf == -inf as equal and -inf vs a finite value as a mismatch.
  np.testing.assert_allclose(a_lse, e_lse, err_msg='lse', **lse_tol)


def fresh_rng() -> np.random.Generator:
  """A generator on a fresh seed, printed (pytest shows it on failure) so a failing case can
  be replayed with `np.random.default_rng(seed)`."""
  seed = int(np.random.default_rng().integers(1 << 30))
  print(f'seed={seed}')
  return np.random.default_rng(seed)


def random_length(rng: np.random.Generator, max_len: int = 300) -> int:
  """A segment length in 0..max_len, with 0 and 1 drawn often."""
  kind = rng.choice(4, p=[0.15, 0.1, 0.3, 0.45])
  if kind == 0:
    return 0
  if kind == 1:
    return 1
  if kind == 2:
    return int(rng.integers(2, 21))
  return int(rng.integers(21, max_len + 1))


def random_tree(
    rng: np.random.Generator,
    depth: int,
    rows: int,
    *,
    max_fanout: int = 5,
    max_len: int = 300,
    leaf_early: float = 0.2,
) -> hj.PromptNode:
  """A random sharing tree of at most `depth` levels over exactly `rows` rows.

  Every inner node draws its own fan-out in 1..max_fanout (capped by its rows) and
  splits its rows among its children at random; a leaf's rows are its samples.
  The first root-to-leaf path always reaches `depth` levels.
  """

  def node(level: int, n: int, on_first_path: bool) -> hj.PromptNode:
    length = random_length(rng, max_len)
    last = level == depth - 1
    if last or (not on_first_path and rng.random() < leaf_early):
      return hj.PromptNode(length, num_samples=n)
    fan = int(rng.integers(1, min(max_fanout, n) + 1))
    cuts = np.sort(rng.choice(np.arange(1, n), fan - 1, replace=False)) if fan > 1 else []
    sizes = np.diff(np.concatenate([[0], cuts, [n]])).astype(int)
    return hj.PromptNode(
        length,
        children=tuple(
            node(level + 1, int(s), on_first_path and i == 0) for i, s in enumerate(sizes)
        ),
    )

  return node(0, rows, True)


def tree_depth(node: hj.PromptNode) -> int:
  return 1 + max((tree_depth(c) for c in node.children), default=0)


def fanouts(node: hj.PromptNode) -> list[int]:
  """The fan-out of every inner node."""
  inner = [len(node.children)] if node.children else []
  return inner + [f for c in node.children for f in fanouts(c)]


def segment_lengths(node: hj.PromptNode) -> list[int]:
  return [node.length] + [n for c in node.children for n in segment_lengths(c)]


def random_inputs(
    seed: int, plan: hj.SharingPlan, t: int, n: int, k: int, h: int, dtype, extra_kv: int = 0
):
  """q [B, T, N, H], k_cache, v_cache [L, K, H], standard normal from a numpy Generator(seed).

  Drawn on the host: a jax.random draw compiles once per shape, which would dominate
  the cost of the many small random cases.
  """
  rng = np.random.default_rng(seed)

  def draw(shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype)))

  length = plan.kv_tokens + extra_kv
  return draw((plan.num_rows, t, n, h)), draw((length, k, h)), draw((length, k, h))
