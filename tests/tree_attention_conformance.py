"""One conformance suite for every tree-attention backend.

A backend's test class subclasses `TreeAttentionConformance` and sets `impl`, `interpret`,
`head_dim`, `dtypes` and its `cases` (few for slow interpret-mode kernels). Every case is a
fresh random forest from one generator (`random_problem`): lengths that are not block or page
multiples, empty segments, GQA/MQA/MHA, T = 1 and T > 1, private KV in scattered pages. Each is
checked against the naive oracle with one tolerance table per dtype, and the same class checks
that garbage (NaN, inf) in tokens no row attends never reaches an output, and that a layer at a
`kv_offset` of a stacked buffer gives that layer's attention.

Test modules that define subclasses import `pytest_generate_tests` from here (it parametrizes
`case` from the class's `cases`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from tests.conftest import random_tree

# (out, lse) tolerances of a fast path against the naive oracle (float32 inside), per dtype.
# bf16/f16: probabilities are rounded to the input dtype before the PV product, and the output
# is in the input dtype; the lse is a float32 softmax over the same (rounded) scores.
TOLERANCES = {
    jnp.dtype(jnp.float32): (dict(rtol=2e-5, atol=2e-5), dict(rtol=2e-5, atol=2e-5)),
    jnp.dtype(jnp.bfloat16): (dict(rtol=2e-2, atol=2e-2), dict(rtol=2e-3, atol=2e-3)),
    jnp.dtype(jnp.float16): (dict(rtol=4e-3, atol=4e-3), dict(rtol=1e-3, atol=1e-3)),
}

# The oracle, jitted so that a case pays one compile instead of one per op.
naive_tree_attention = jax.jit(hj.naive_tree_attention, static_argnames=('plan', 'scale'))


@dataclasses.dataclass(frozen=True)
class Case:
  """One random problem: the seed draws the forest, the lengths and the inputs."""

  seed: int
  depth: int  # levels of the deepest tree
  heads: tuple[int, int]  # (N, K)
  t: int  # query tokens per row
  dtype_index: int = 0  # into the class's dtypes
  max_len: int = 40  # longest shared segment (>= 21: see conftest.random_length)
  max_rows: int = 5  # rows per tree
  max_trees: int = 2
  shared: bool = True  # False: no shared segment at all (plain paged decode)

  @property
  def id(self) -> str:
    n, k = self.heads
    fold = 'mha' if n == k else ('mqa' if k == 1 else 'gqa')
    tree = f'depth={self.depth}' if self.shared else 'unshared'
    return f'{tree}_{fold}_N={n}_K={k}_T={self.t}_dtype{self.dtype_index}_seed={self.seed}'


def pytest_generate_tests(metafunc):
  if 'case' in metafunc.fixturenames and metafunc.cls is not None:
    cases = metafunc.cls.cases
    metafunc.parametrize('case', cases, ids=[c.id for c in cases])


@dataclasses.dataclass(frozen=True)
class Problem:
  plan: hj.SharingPlan
  q: jax.Array
  k: jax.Array
  v: jax.Array


def paged_plan(roots, rng, *, page_size: int, t: int, max_private: int) -> hj.SharingPlan:
  """Plans `roots` with each row's private KV in scattered pages of `page_size` tokens.

  Private lengths are ragged in [t, max_private] (one row exactly t, one a page multiple),
  some rows get a spare page, and the buffer is a whole number of pages.
  """
  base = hj.plan_tree(roots, private_capacity=0)
  first_page = -(-base.shared_tokens() // page_size)
  lengths = rng.integers(t, max_private + 1, size=base.num_rows)
  lengths[0] = t
  if base.num_rows > 1:
    lengths[1] = max(t, min(max_private, 2 * page_size))
  counts = [-(-int(n) // page_size) + int(rng.integers(0, 2)) for n in lengths]
  ids = first_page + rng.permutation(sum(counts))
  pages, start = [], 0
  for c in counts:
    pages.append(tuple(int(p) for p in ids[start : start + c]))
    start += c
  return hj.SharingPlan(
      base.num_rows, base.segments, page_size, tuple(pages), tuple(int(n) for n in lengths),
      (first_page + sum(counts)) * page_size,
  )


def random_problem(case: Case, *, head_dim: int, dtype, page_size: int) -> Problem:
  """The case's random forest, paged plan and inputs (numpy draws: no per-shape compiles)."""
  rng = np.random.default_rng(case.seed)
  trees = int(rng.integers(1, case.max_trees + 1))
  roots = tuple(
      random_tree(rng, case.depth if i == 0 else int(rng.integers(1, case.depth + 1)),
                  int(rng.integers(1, case.max_rows + 1)), max_fanout=3, max_len=case.max_len)
      for i in range(trees)
  )
  if not case.shared:  # the forest's rows, each with only its private KV
    roots = (hj.PromptNode(0, num_samples=hj.plan_tree(roots, private_capacity=0).num_rows),)
  plan = paged_plan(roots, rng, page_size=page_size, t=case.t, max_private=2 * page_size + 3)
  if not case.shared:
    plan = dataclasses.replace(plan, segments=())
  n, k = case.heads

  def draw(shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)

  kv_shape = (plan.kv_tokens, k, head_dim)
  return Problem(plan, draw((plan.num_rows, case.t, n, head_dim)), draw(kv_shape), draw(kv_shape))


def assert_close(got: hj.PartialState, expected: hj.PartialState, dtype, tolerances=TOLERANCES):
  out_tol, lse_tol = tolerances[jnp.dtype(dtype)]
  assert got.out.shape == expected.out.shape and got.lse.shape == expected.lse.shape
  assert got.out.dtype == jnp.dtype(dtype) and got.lse.dtype == jnp.float32
  got_out, got_lse = np.asarray(got.out, np.float32), np.asarray(got.lse)
  assert not np.isnan(got_out).any() and not np.isnan(got_lse).any(), 'NaN in the result'
  np.testing.assert_allclose(got_out, np.asarray(expected.out, np.float32), err_msg='out',
                             **out_tol)
  np.testing.assert_allclose(got_lse, np.asarray(expected.lse), err_msg='lse', **lse_tol)


def unattended_tokens(plan: hj.SharingPlan) -> np.ndarray:
  """[L] bool: tokens that no row attends (page tails, spare pages, gaps)."""
  indices, lengths = plan.row_token_indices()
  used = np.zeros(plan.kv_tokens, bool)
  for row, n in zip(indices, lengths):
    used[row[:n]] = True
  return ~used


class TreeAttentionConformance:
  """The cases every backend passes. Subclasses set the class attributes below."""

  impl: hj.AttentionImpl = hj.AttentionImpl.XLA
  interpret: bool = False
  config = None  # the backend's config (None: its default)
  head_dim: int = 16
  page_size: int = 8
  dtypes: tuple = (jnp.float32, jnp.bfloat16)
  tolerances = TOLERANCES
  cases: tuple[Case, ...] = (
      Case(1, 1, (4, 4), 1, 0),
      Case(2, 2, (4, 2), 3, 1),
  )

  @pytest.fixture(autouse=True)
  def _skip_unless_runnable(self):
    reason = self.skip_reason()
    if reason:
      pytest.skip(reason)

  @classmethod
  def skip_reason(cls) -> str | None:
    return None

  def dtype(self, case: Case):
    return self.dtypes[case.dtype_index % len(self.dtypes)]

  def problem(self, case: Case) -> Problem:
    return random_problem(case, head_dim=self.head_dim, dtype=self.dtype(case),
                          page_size=self.page_size)

  def prepare(self, layout, q, k):
    return hj.prepare_attention(layout, hj.AttentionShapes.of(q, k), impl=self.impl,
                                config=self.config, interpret=self.interpret)

  def attention(self, q, k, v, layout, *, scale=None):
    return hj.tree_attention(q, k, v, layout, impl=self.impl, scale=scale, config=self.config,
                             interpret=self.interpret)

  def test_random_tree_matches_oracle(self, case: Case):
    p = self.problem(case)
    got = self.attention(p.q, p.k, p.v, p.plan.to_device())
    assert_close(got, naive_tree_attention(p.q, p.k, p.v, p.plan), self.dtype(case),
                 self.tolerances)

  def test_the_plan_runs_what_was_asked(self):
    p = self.problem(self.cases[0])
    plan = self.prepare(p.plan.to_device(), p.q, p.k)
    assert plan.impl is self.impl and plan.interpret == bool(self.interpret)
    assert plan.shapes == hj.AttentionShapes.of(p.q, p.k)

  def test_garbage_in_unattended_tokens_never_reaches_outputs(self):
    case = dataclasses.replace(self.cases[0], t=2, max_len=30)
    p = self.problem(case)
    unused = unattended_tokens(p.plan)
    assert unused.any()
    expected = naive_tree_attention(p.q, p.k, p.v, p.plan)
    layout = p.plan.to_device()
    for garbage in (jnp.nan, jnp.inf, -jnp.inf):
      mask = jnp.asarray(unused)[:, None, None]
      k, v = (jnp.where(mask, jnp.asarray(garbage, x.dtype), x) for x in (p.k, p.v))
      got = self.attention(p.q, k, v, layout)
      assert_close(got, expected, self.dtype(case), self.tolerances)

  def test_nan_in_an_attended_token_shows_where_plain_attention_shows_it(self):
    """A NaN key makes the out and lse of exactly the queries that see it NaN, a NaN value their
    out, as plain softmax attention does: a corrupt cache shows, never read as an empty state.
    A NaN value may also reach rows that share a kernel tile with them (0 * NaN in the PV
    product); every row left finite is exact."""
    case = dataclasses.replace(self.cases[0], t=2, max_len=30)
    p = self.problem(case)
    indices, lengths = p.plan.row_token_indices()
    row = int(np.flatnonzero(lengths > 0)[-1])
    token = int(indices[row][lengths[row] - 1])  # the last row's last token: few rows see it
    layout = p.plan.to_device()
    for name in ('k', 'v'):
      k, v = (x.at[token].set(jnp.nan) if x_name == name else x
              for x_name, x in (('k', p.k), ('v', p.v)))
      expected = naive_tree_attention(p.q, k, v, p.plan)
      got = self.attention(p.q, k, v, layout)
      want_out = np.isnan(np.asarray(expected.out, np.float32))
      got_out = np.isnan(np.asarray(got.out, np.float32))
      assert want_out[row].any(), name
      np.testing.assert_array_equal(np.isnan(np.asarray(got.lse)),
                                    np.isnan(np.asarray(expected.lse)), name)
      if name == 'k':
        np.testing.assert_array_equal(got_out, want_out, name)
      else:
        assert (got_out | ~want_out).all(), 'a NaN value read as if unseen'
      finite = lambda s: hj.PartialState(jnp.where(got_out, 0, s.out).astype(s.out.dtype),
                                         jnp.where(jnp.isnan(s.lse), 0, s.lse))
      assert_close(finite(got), finite(expected), self.dtype(case), self.tolerances)

  def test_a_layer_at_a_kv_offset_of_a_stacked_buffer(self):
    """Layer 1 of three stacked layers (the others garbage) equals attention over layer 1 alone."""
    case = self.cases[-1]
    p = self.problem(case)
    length = p.plan.kv_tokens
    nan = jnp.full(p.k.shape, jnp.nan, p.k.dtype)
    k_all = jnp.concatenate([-p.k, p.k, nan])  # [3 * L, K, H]
    v_all = jnp.concatenate([nan, p.v, -p.v])
    plan = self.prepare(p.plan.to_device(), p.q, p.k)  # once for every layer
    expected = naive_tree_attention(p.q, p.k, p.v, p.plan)
    got = hj.attend(p.q, k_all, v_all, plan, kv_offset=length)
    assert_close(got, expected, self.dtype(case), self.tolerances)
    # The offset as a traced scalar: one compile serves every layer.
    fn = jax.jit(functools.partial(hj.attend))
    got = fn(p.q, k_all, v_all, plan, kv_offset=jnp.int32(length))
    assert_close(got, expected, self.dtype(case), self.tolerances)
