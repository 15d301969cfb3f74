"""Bad layouts and bad attention inputs raise ValueError with a message naming what is wrong."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from hydrajax.validation import check_tree_attention_inputs

# SharingPlan checks


def _plan(
    segments=(), *, num_rows=2, page_size=4, pages=((3,), (4,)), lengths=(1, 2), kv_tokens=20
):
  return hj.SharingPlan(num_rows, tuple(segments), page_size, pages, lengths, kv_tokens)


def test_a_valid_plan_passes():
  plan = _plan([hj.Segment(0, 8, 0, 2), hj.Segment(8, 4, 1, 2, parent=0)])
  assert plan.path(1) == [0, 1]


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(segments=[hj.Segment(0, 4, 1, 1)]), r'segment 0: rows \[1, 1\) not in \[0, 2\)'),
        (dict(segments=[hj.Segment(0, 4, 0, 3)]), r'segment 0: rows \[0, 3\) not in \[0, 2\)'),
        (dict(segments=[hj.Segment(0, 4, -1, 1)]), r'segment 0: rows \[-1, 1\)'),
        (
            dict(segments=[hj.Segment(10, 11, 0, 2)]),
            r'segment 0: tokens \[10, 21\) not in the buffer of 20',
        ),
        (dict(segments=[hj.Segment(-1, 2, 0, 2)]), r'segment 0: tokens \[-1, 1\)'),
        (dict(segments=[hj.Segment(0, -3, 0, 2)]), r'segment 0: tokens \[0, -3\)'),
        (
            dict(segments=[hj.Segment(0, 4, 0, 2), hj.Segment(4, 4, 0, 1, parent=1)]),
            r'segment 1: parent 1 must come before it',
        ),
        (
            dict(segments=[hj.Segment(0, 4, 0, 1), hj.Segment(4, 4, 0, 2, parent=0)]),
            r'segment 1: rows not inside those of its parent 0',
        ),
        (
            dict(num_rows=3, pages=((0,), (1,), (2,)), lengths=(1, 1, 1),
                 segments=[hj.Segment(0, 4, 0, 2), hj.Segment(4, 4, 1, 3)]),
            r'segments 0 \(rows \[0, 2\)\) and 1 \(rows \[1, 3\)\) overlap without nesting',
        ),
        (dict(lengths=(1, 5)), r'row 1: private length 5 must be in \[0, 4\]'),
        (dict(lengths=(-1, 0)), r'row 0: private length -1'),
        (dict(pages=((3,), (5,))), r'row 1: private page ids must be in \[0, 5\)'),
        (dict(pages=((3,),)), r'private_pages and private_lengths need one entry per row \(2\)'),
        (dict(num_rows=0, pages=(), lengths=()), r'num_rows must be >= 1, got 0'),
        (dict(page_size=0), r'page_size must be >= 1, got 0'),
    ],
    ids=[
        'empty_row_range',
        'rows_past_batch',
        'negative_row',
        'tokens_past_buffer',
        'negative_start',
        'negative_length',
        'parent_after_child',
        'rows_outside_parent',
        'overlapping_roots',
        'private_over_capacity',
        'negative_private_length',
        'page_outside_buffer',
        'private_arrays_short',
        'no_rows',
        'zero_page_size',
    ],
)
def test_bad_plans_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _plan(**kwargs)


def test_to_device_rejects_too_few_private_pages():
  plan = _plan(pages=((2, 3), (4,)), lengths=(5, 2))
  match = r'max_private_pages=1 is below the widest private page table \(2\)'
  with pytest.raises(ValueError, match=match):
    plan.to_device(max_private_pages=1)


# Builders


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(length=-1), r'PromptNode.length must be >= 0, got -1'),
        (dict(length=3, num_samples=0), r'PromptNode.num_samples must be >= 1, got 0'),
        (
            dict(length=3, children=(hj.PromptNode(1),), num_samples=2),
            r'num_samples applies to leaves only',
        ),
    ],
    ids=['negative_length', 'no_samples', 'samples_on_inner_node'],
)
def test_bad_prompt_nodes_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    hj.PromptNode(**kwargs)


@pytest.mark.parametrize(
    'roots, kwargs, match',
    [
        ([], dict(private_capacity=2), r'roots must be a PromptNode or a non-empty sequence'),
        (
            hj.PromptNode(3, num_samples=2),
            dict(private_capacity=2, private_lengths=[1]),
            r'needs 2 entries, got 1',
        ),
        (
            hj.PromptNode(3),
            dict(private_capacity=2, private_lengths=3),
            r'private_lengths must be in \[0, private_capacity=2\]',
        ),
        (
            hj.PromptNode(3),
            dict(private_capacity=2, private_lengths=-1),
            r'private_lengths must be in \[0, private_capacity=2\]',
        ),
    ],
    ids=['no_roots', 'lengths_count', 'length_over_capacity', 'negative_length'],
)
def test_bad_plan_tree_arguments_raise(roots, kwargs, match):
  with pytest.raises(ValueError, match=match):
    hj.plan_tree(roots, **kwargs)


def test_bad_plan_from_tokens_arguments_raise():
  with pytest.raises(ValueError, match='needs at least one sequence'):
    hj.plan_from_tokens([])
  with pytest.raises(ValueError, match='max_new_tokens must be >= 0, got -1'):
    hj.plan_from_tokens([[1, 2]], max_new_tokens=-1)


# check_tree_attention_inputs, directly and through every entry point

B, T, N, K, H = 3, 2, 8, 2, 16


@pytest.fixture(scope='module')
def layout():
  plan = hj.plan_tree(hj.PromptNode(5, num_samples=B), private_capacity=4, private_lengths=T)
  return plan.to_device()


def _inputs(
    q_shape=(B, T, N, H),
    kv_shape=(40, K, H),
    v_shape=None,
    q_dtype=jnp.float32,
    kv_dtype=jnp.float32,
    v_dtype=None,
):
  """q, k_cache, v_cache of these shapes and dtypes (v like k unless given)."""
  return (
      jnp.zeros(q_shape, q_dtype),
      jnp.zeros(kv_shape, kv_dtype),
      jnp.zeros(v_shape or kv_shape, v_dtype or kv_dtype),
  )


BAD_INPUTS = {
    'q_rank': (_inputs(q_shape=(B, N, H)), r'q must be \[B, T, N, H\], got shape \(3, 8, 16\)'),
    'k_rank': (
        _inputs(kv_shape=(1, 40, K, H)),
        r'k_cache must be \[L, K, H\], got shape \(1, 40, 2, 16\)',
    ),
    'v_rank': (_inputs(v_shape=(40 * K * H,)), r'v_cache must be \[L, K, H\], got shape \(1280,\)'),
    'kv_shapes_differ': (
        _inputs(v_shape=(41, K, H)),
        r'k_cache \(40, 2, 16\) and v_cache \(41, 2, 16\) must have one shape',
    ),
    'head_dim': (_inputs(kv_shape=(40, K, 8)), r'head dim H differs: q has 16, k_cache has 8'),
    'heads_not_multiple': (
        _inputs(kv_shape=(40, 3, H)),
        r'query heads N=8 must be a multiple of kv heads K=3',
    ),
    'batch_vs_layout': (_inputs(q_shape=(B + 1, T, N, H)), r'q has B=4 rows but the layout has 3'),
    'no_query_tokens': (_inputs(q_shape=(B, 0, N, H)), r'q must have B, T, H >= 1'),
    'int_q': (_inputs(q_dtype=jnp.int32), r'q must be float32, bfloat16 or float16, got int32'),
    'int_k': (
        _inputs(kv_dtype=jnp.int8, v_dtype=jnp.float32),
        r'k_cache must be float32, bfloat16 or float16, got int8',
    ),
    'int_v': (
        _inputs(v_dtype=jnp.int32),
        r'v_cache must be float32, bfloat16 or float16, got int32',
    ),
    'kv_dtypes_differ': (
        _inputs(v_dtype=jnp.bfloat16),
        r'k_cache \(float32\) and v_cache \(bfloat16\) must share a dtype',
    ),
    'buffer_below_a_page': (
        _inputs(kv_shape=(3, K, H)),
        r'k_cache holds 3 tokens, less than one page of 4',
    ),
}


@pytest.mark.parametrize('name', list(BAD_INPUTS))
def test_bad_attention_inputs_raise(name, layout):
  (q, k_cache, v_cache), match = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=match):
    check_tree_attention_inputs(q, k_cache, v_cache, layout)
  for impl in ('xla', hj.AttentionImpl.AUTO, hj.AttentionImpl.MOSAIC_GPU):  # before any dispatch
    with pytest.raises(ValueError, match=match):
      hj.tree_attention(q, k_cache, v_cache, layout, impl=impl)
  with pytest.raises(ValueError, match=match):  # also at trace time of the jitted XLA path
    hj.tree_attention_xla(q, k_cache, v_cache, layout)


def test_layout_must_be_a_tree_layout(layout):
  q, k_cache, v_cache = _inputs()
  plan = hj.plan_tree(hj.PromptNode(5, num_samples=B), private_capacity=4, private_lengths=T)
  match = re.escape('layout must be a TreeLayout (SharingPlan.to_device()), got SharingPlan')
  with pytest.raises(ValueError, match=match):
    hj.tree_attention(q, k_cache, v_cache, plan)
  check_tree_attention_inputs(q, k_cache, v_cache, layout)  # the good inputs pass


def test_good_inputs_in_every_float_dtype_pass(layout):
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    q, k_cache, v_cache = _inputs(q_dtype=dtype, kv_dtype=dtype)
    check_tree_attention_inputs(q, k_cache, v_cache, layout)
  # Shapes only: abstract values validate too (the check runs at trace time).
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs()]
  check_tree_attention_inputs(*abstract, layout)


# Hardening (issue 13): what used to be silently clamped, wrong, or a RecursionError.


def _small_problem(t=1, lengths=(2, 3)):
  plan = hj.plan_tree(hj.PromptNode(5, num_samples=2), private_capacity=4, private_lengths=lengths)
  q = jnp.ones((2, t, 4, 8), jnp.float32)
  kv = jnp.ones((plan.kv_tokens, 2, 8), jnp.float32)
  return plan, q, kv


def test_a_buffer_shorter_than_the_plan_raises():
  plan, q, kv = _small_problem()
  short = kv[: plan.kv_tokens - 4]  # still whole pages: it used to be silently clamped
  match = rf'holds {plan.kv_tokens - 4} tokens per layer, but the layout indexes {plan.kv_tokens}'
  for impl in ('xla', 'auto'):
    with pytest.raises(ValueError, match=match):
      hj.tree_attention(q, short, short, plan.to_device(), impl=impl)
  with pytest.raises(ValueError, match=match):
    hj.prepare_attention(plan.to_device(), hj.AttentionShapes.of(q, short))
  layout_plan = hj.prepare_attention(plan.to_device(), hj.AttentionShapes.of(q, kv))
  with pytest.raises(ValueError, match='fewer than the planned kv_tokens'):
    hj.attend(q, short, short, layout_plan)


def test_more_query_tokens_than_a_rows_private_length_raises():
  plan, q, kv = _small_problem(t=3, lengths=(2, 4))  # row 0: 2 private tokens, T = 3
  with pytest.raises(ValueError, match='T=3 query tokens per row, but a row has only 2 private'):
    hj.tree_attention(q, kv, kv, plan.to_device())
  plan, q, kv = _small_problem(t=2, lengths=(0, 2))  # a padding row (length 0) is fine
  hj.tree_attention(q, kv, kv, plan.to_device())


@pytest.mark.parametrize('scale', [float('nan'), float('inf'), 0.0, -1.0],
                         ids=['nan', 'inf', 'zero', 'negative'])
def test_bad_scale_raises(scale):
  plan, q, kv = _small_problem()
  with pytest.raises(ValueError, match='scale must be finite and > 0'):
    hj.tree_attention(q, kv, kv, plan.to_device(), scale=scale)
  with pytest.raises(ValueError, match='scale must be finite and > 0'):
    hj.tree_attention_xla(q, kv, kv, plan.to_device(), scale=scale)


def test_bad_kv_block_raises():
  plan, q, kv = _small_problem()
  with pytest.raises(ValueError, match='kv_block must be >= 1, got 0'):
    hj.tree_attention_xla(q, kv, kv, plan.to_device(), kv_block=0)
  with pytest.raises(ValueError, match='kv_block must be an integer'):
    hj.XlaConfig(kv_block=2.5)


def test_bad_kv_offset_raises():
  plan, q, kv = _small_problem()
  stacked = jnp.concatenate([kv, kv])
  p = hj.prepare_attention(plan.to_device(), hj.AttentionShapes.of(q, kv))
  for offset in (3, -4, plan.kv_tokens + 4):  # not a page multiple; negative; past the end
    with pytest.raises(ValueError, match='kv_offset must be a multiple of page_size=4'):
      hj.attend(q, stacked, stacked, p, kv_offset=offset)
  with pytest.raises(ValueError, match='kv_offset must be a Python int or an int32 scalar'):
    hj.attend(q, stacked, stacked, p, kv_offset=jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize(
    'make, match',
    [
        (lambda: hj.Segment(0, 2.5, 0, 1), r'Segment.kv_length must be an integer, got 2.5'),
        (lambda: hj.Segment(0.0, 2, 0, 1), r'Segment.kv_start must be an integer'),
        (lambda: hj.PromptNode(2.5), r'PromptNode.length must be an integer'),
        (lambda: hj.plan_tree(hj.PromptNode(2), private_capacity=2, private_lengths=1.5),
         r'private_lengths must be an integer'),
        (lambda: _plan(lengths=(1, 2.0)), r'SharingPlan.private_lengths\[1\] must be an integer'),
        (lambda: _plan(page_size=4.0), r'SharingPlan.page_size must be an integer'),
    ],
    ids=['segment_length', 'segment_start', 'prompt_node', 'plan_tree_lengths',
         'plan_lengths', 'page_size'],
)
def test_float_lengths_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_concrete_array_kv_offsets_are_range_checked():
  plan, q, _ = _small_problem()
  layers = jax.random.normal(jax.random.key(7), (2 * plan.kv_tokens, 2, 8))
  p = hj.prepare_attention(plan.to_device(), hj.AttentionShapes.of(q, layers[:plan.kv_tokens]))
  for offset in (jnp.int32(10**6), jnp.int32(-4), np.array(3)):
    with pytest.raises(ValueError, match='kv_offset must be a multiple of page_size=4'):
      hj.attend(q, layers, layers, p, kv_offset=offset)
  second = hj.attend(q, layers, layers, p, kv_offset=jnp.int32(plan.kv_tokens))
  expected = hj.tree_attention(q, layers[plan.kv_tokens:], layers[plan.kv_tokens:], plan.to_device())
  np.testing.assert_allclose(second.out, expected.out, rtol=1e-6, atol=1e-6)


def test_bad_private_lengths_of_a_prepared_plan_raise():
  plan, q, kv = _small_problem()
  p = hj.prepare_attention(plan.to_device(), hj.AttentionShapes.of(q, kv))
  b, capacity = plan.num_rows, p.layout.max_private_tokens
  for lengths, match in [
      (jnp.full((b,), capacity + 1, jnp.int32),
       rf'lengths must be 0 or in \[T=1, capacity={capacity}\].*got {capacity + 1} at row 0'),
      (np.full((b,), -5, np.int32), 'got -5 at row 0'),
      (jnp.ones((b,), jnp.float32), rf'lengths must be an integer array of shape \({b},\)'),
      (jnp.ones((b + 3,), jnp.int32), rf'of shape \({b},\)'),
  ]:
    with pytest.raises(ValueError, match=match):
      p.with_private_lengths(lengths)
  swapped = p.with_private_lengths([1] * b)  # a list is a host array
  assert swapped.layout.private_lengths.tolist() == [1] * b
  padded = p.with_private_lengths(np.array([0] + [1] * (b - 1), np.int32))  # 0: a padding row
  assert padded.layout.private_lengths[0] == 0
  # check=False (the engine's step, whose cache built the page table): the shape is checked,
  # the values are not.
  unchecked = p.with_private_lengths(np.full((b,), capacity + 1, np.int32), check=False)
  assert unchecked.layout.private_lengths[0] == capacity + 1
  with pytest.raises(ValueError, match=rf'of shape \({b},\)'):
    p.with_private_lengths(np.ones((b + 3,), np.int32), check=False)


def test_prepared_plans_refuse_what_tree_attention_refuses():
  plan, q, kv = _small_problem()
  with pytest.raises(ValueError, match='q must be float32, bfloat16 or float16, got int32'):
    hj.AttentionShapes.of(q.astype(jnp.int32), kv)
  with pytest.raises(ValueError, match='k_cache must be float32, bfloat16 or float16'):
    hj.AttentionShapes.of(q, kv.astype(jnp.int32))
  with pytest.raises(ValueError, match='AttentionShapes.kv_dtype must be float32'):
    hj.AttentionShapes(1, 1, 1, 1, 1, 1, jnp.float32, jnp.int8)
  with pytest.raises(ValueError, match='AttentionShapes.dtype must be a dtype'):
    hj.AttentionShapes(1, 1, 1, 1, 1, 1, 'foo')
  with pytest.raises(ValueError, match=r'q must be \[B, T, N, H\]'):
    hj.AttentionShapes.of(q[0], kv)
  with pytest.raises(ValueError, match='head dim H differs'):
    hj.AttentionShapes.of(q, kv[..., :2])
  p = hj.prepare_attention(plan.to_device(), hj.AttentionShapes.of(q, kv))
  with pytest.raises(ValueError, match='q must be an array'):
    hj.attend(q.tolist(), kv, kv, p)


@pytest.mark.parametrize('kwargs, match', [
    (dict(impl='foo'), r"impl must be an AttentionImpl or one of \['auto', 'xla'"),
    (dict(impl=3), 'impl must be'),
    (dict(config=3), 'config must be a backend config'),
    (dict(config=(hj.XlaConfig(), 'x')), 'config must be a backend config'),
    (dict(interpret='no'), 'interpret must be True or False'),
])
def test_bad_implementation_arguments_raise(kwargs, match):
  plan, q, kv = _small_problem()
  with pytest.raises(ValueError, match=match):
    hj.tree_attention(q, kv, kv, plan.to_device(), **kwargs)


def test_impl_names_in_any_case():
  assert hj.AttentionImpl('XLA') is hj.AttentionImpl.XLA
  assert hj.AttentionImpl('Mosaic_GPU') is hj.AttentionImpl.MOSAIC_GPU


def test_bad_merges_raise():
  state = hj.PartialState(jnp.ones((1, 2)), jnp.zeros((1,)))
  with pytest.raises(ValueError, match=r'states must share one shape.*states\[1\]'):
    hj.merge(state, hj.PartialState(jnp.ones((1, 3)), jnp.zeros((1,))))
  with pytest.raises(ValueError, match="a: lse must have out's shape without its last axis"):
    hj.merge(hj.PartialState(state.out, jnp.zeros((1, 2))), state)
  with pytest.raises(ValueError, match=r'states\[0\] must be a PartialState or an \(out, lse\)'):
    hj.merge_many([state.out])
  pair = hj.merge((state.out, state.lse), (state.out, state.lse))  # a pair is a state
  np.testing.assert_allclose(pair.out, state.out)
  np.testing.assert_allclose(pair.lse, np.log(2.0), rtol=1e-6)


@pytest.mark.parametrize('make, match', [
    (lambda: hj.plan_from_tokens([[1.9, 2.5], [1.2, 2.0]]), r'sequences\[0\] must hold integer token ids \(not float\)'),
    (lambda: hj.plan_from_tokens(['12', '13']), r'sequences\[0\] must be a 1-D sequence of integer'),
    (lambda: hj.plan_from_tokens([[True, False]]), r'sequences\[0\] must hold integer token ids \(not bool\)'),
    (lambda: hj.plan_from_tokens([[1, -2]]), r'sequences\[0\] must hold token ids >= 0, got -2'),
    (lambda: hj.plan_from_tokens([np.ones((2, 2), int)]), r'sequences\[0\] must be 1-D'),
    (lambda: hj.plan_from_tokens([np.ones(2)]), r'sequences\[0\] must hold integer token ids, got dtype float64'),
    (lambda: hj.plan_from_tokens([1, 2]), r'sequences\[0\] must be a 1-D sequence'),
    (lambda: hj.plan_from_tokens('abc'), 'sequences must be a list of token-id lists'),
    (lambda: hj.plan_from_tokens([[1, 2]], max_new_tokens=2.5), 'max_new_tokens must be an integer'),
    (lambda: hj.PromptNode(2, tokens=(1.7, 2.2)), r'PromptNode.tokens must hold integer token ids \(not float\)'),
    (lambda: hj.PromptNode(4, children=(5,)), 'PromptNode.children must be PromptNodes'),
    (lambda: hj.plan_tree(None, private_capacity=4), 'roots must be a PromptNode'),
    (lambda: hj.SharingPlan(1, (), 1, ((0,),), (0,), 2**33), 'kv_tokens must be at most'),
    (lambda: _plan().to_device(policy='pow2'), 'policy must be a LayoutPolicy'),
    (lambda: _plan().to_device(max_private_pages=2.5), 'max_private_pages must be an integer'),
    (lambda: hj.bucket_size(10.5), 'n must be an integer'),
    (lambda: hj.render_plan(_plan().to_device()), 'plan must be a SharingPlan'),
    (lambda: hj.SharingPolicy.default().apply(None), 'plan must be a SharingPlan'),
    (lambda: hj.naive_attention(jnp.ones((1, 1, 3, 4)), jnp.ones((1, 2, 2, 4)),
                                jnp.ones((1, 2, 2, 4)), jnp.ones(1, jnp.int32)), 'K divides N=3'),
])
def test_bad_builder_and_helper_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_builders_take_what_users_pass():
  node = hj.PromptNode(4, children=hj.PromptNode(2))  # one child without a tuple
  assert node.children == (hj.PromptNode(2),)
  plan = hj.plan_tree(node, private_capacity=4, private_lengths=np.array(1))  # a 0-d array
  assert plan.private_lengths == (1,)
  tokens = hj.plan_from_tokens([np.array([1, 2, 3]), (1, 2, 4)])  # numpy ids
  assert tokens.segment_tokens == ((1, 2),)


def test_deep_prefix_chains_plan_without_recursion():
  depth = 1200  # RecursionError at about 1000 before
  node = hj.PromptNode(1, num_samples=2)
  for _ in range(depth - 1):
    node = hj.PromptNode(1, children=(node,))
  plan = hj.plan_tree(node, private_capacity=1, private_lengths=1)
  assert len(plan.segments) == depth and plan.segments[-1].parent == depth - 2
  assert plan.private_position(1) == depth
  sequences = [list(range(n)) for n in range(1, depth + 1)]  # nested prefixes: a chain
  tp = hj.plan_from_tokens(sequences, max_new_tokens=1)
  assert len(tp.plan.segments) == depth - 1 and tp.order == tuple(range(depth))
  assert tp.plan.page_size % 8 == 0


def test_token_ids_is_one_check_for_every_api():
  """plan_from_tokens, PromptNode, generate, Engine.submit, SamplingParams and ChunkCache all
  check token ids here."""
  from hydrajax.validation import token_ids
  assert token_ids(np.array([3, 0, 7]), 'x', vocab_size=8) == (3, 0, 7)
  assert token_ids([np.int32(5), 2], 'x') == (5, 2) and token_ids((), 'x') == ()
  assert token_ids(jnp.arange(3), 'x') == (0, 1, 2)
  for value, match in (([8], r'x token ids must be in \[0, 8\), got 8'),
                       ([], 'x must hold at least one token id'), (5, 'x must be a 1-D sequence'),
                       (b'ab', 'x must be a 1-D sequence'), ([[1]], r'x must hold integer token ids \(not list\)')):
    with pytest.raises(ValueError, match=match):
      token_ids(value, 'x', vocab_size=8, allow_empty=False)
