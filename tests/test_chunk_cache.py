"""The chunked KV cache: tree operations vs a brute-force model, retention, attention over it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hydrajax as hj
from hydrajax.chunk_cache import CapacityError, ChunkCache, ChunkCacheConfig, copy_slots
from hydrajax.layout import LayoutPolicy


def cached_prefixes(cache: ChunkCache) -> list[tuple[list[int], int]]:
  """(tokens from the root to the end of the chunk, chunk) of every cached chunk, LRU first."""
  out = []
  for node in cache._lru:
    chunk, chunks = node.chunk, []
    while node.chunk >= 0:
      chunks.append(node.chunk)
      node = node.parent
    out.append((cache._tokens[chunks[::-1]].reshape(-1).tolist(), chunk))
  return out


class Model:
  """Brute force: each sequence's tokens, and a fake KV pool that holds token ids at their slots."""

  def __init__(self, cache: ChunkCache):
    self.cache = cache
    self.tokens: dict[int, list[int]] = {}
    self.prompts: dict[int, list[int]] = {}
    self.retained: set[tuple[int, ...]] = set()  # full prompt-chunk prefixes of removed sequences
    self.pool = np.full(cache.config.kv_tokens, -1, np.int64)

  def insert(self, tokens, reserve, samples=1):
    a = self.cache.insert(tokens, reserve_tokens=reserve, num_samples=samples)
    self.pool[a.copy_dst] = self.pool[a.copy_src]
    self.pool[a.prefill_slots] = np.asarray(tokens)[a.prefill_start :]
    self.cache.commit(a.seq_id)
    self.tokens[a.seq_id] = list(tokens)
    self.prompts[a.seq_id] = list(tokens)
    return a

  def append(self, new, deferred=()):
    """Appends; rows in `deferred` first get a placeholder, then `record_tokens` (an engine
    that overlaps decode steps)."""
    rows = self.cache.rows
    version = self.cache.structure_version
    held = np.array(new)
    held[list(deferred)] = -1
    slots = self.cache.append(held)
    if len(deferred):
      lengths = self.cache.lengths()
      self.cache.record_tokens([rows[r] for r in deferred], lengths[deferred] - 1,
                               np.asarray(new)[deferred])
    assert self.cache.rows == rows and self.cache.structure_version == version
    self.pool[slots] = new
    for sid, t in zip(rows, new):
      self.tokens[sid].append(int(t))

  def fork(self, sid, n, reserve):
    f = self.cache.fork(sid, n, reserve_tokens=reserve)
    self.pool[f.copy_dst] = self.pool[f.copy_src]
    for new in f.seq_ids[1:]:
      self.tokens[new] = list(self.tokens[sid])
      self.prompts[new] = self.prompts[sid]
    return f

  def remove(self, sid):
    self.cache.remove(sid)
    del self.tokens[sid]
    prompt, c = self.prompts.pop(sid), self.cache.chunk_size
    self.retained |= {tuple(prompt[: k * c]) for k in range(1, len(prompt) // c + 1)}

  def verify(self):
    cache = self.cache
    cache.check()
    assert set(cache.rows) == set(self.tokens)
    holders: dict[int, list[int]] = {}
    for row, sid in enumerate(cache.rows):
      want = np.array(self.tokens[sid])
      np.testing.assert_array_equal(cache.tokens(sid), want)
      np.testing.assert_array_equal(self.pool[cache.slots(sid)], want)  # KV intact
      for chunk in cache.chunks(sid).tolist():
        holders.setdefault(chunk, []).append(row)
    for chunk, rows in holders.items():  # each chunk's sharers are a contiguous row range
      assert rows == list(range(rows[0], rows[0] + len(rows))), (chunk, rows)
    cached = cached_prefixes(cache)
    c = cache.chunk_size
    for prefix, chunk in cached:  # cached KV intact, and only prompt prefixes are cached
      assert cache.config.retain_prefixes and tuple(prefix) in self.retained
      np.testing.assert_array_equal(self.pool[chunk * c : (chunk + 1) * c], prefix[-c:])
    assert sorted([*holders, *(ch for _, ch in cached)]) == cache.used_chunks().tolist()  # no leak
    assert not set(holders) & {ch for _, ch in cached}
    plan = cache.plan()
    if cache.num_rows:
      indices, lengths = plan.row_token_indices()
      for row, sid in enumerate(cache.rows):
        np.testing.assert_array_equal(indices[row, : lengths[row]], cache.slots(sid))
      for s in plan.segments:
        assert s.num_rows >= 2 and s.kv_length % cache.chunk_size == 0


def expected_match(model: Model, tokens, c):
  """(shared, copied) tokens the tree must find: the best over live sequences and cached chunks."""
  n = len(tokens)
  lcps = []
  for t in list(model.tokens.values()) + [p for p, _ in cached_prefixes(model.cache)]:
    m = 0
    while m < min(n, len(t)) and t[m] == tokens[m]:
      m += 1
    lcps.append((m, len(t)))
  depth = max([min(m // c, (n - 1) // c) for m, _ in lcps], default=0)
  copied = max(
      [min(m, lt, (depth + 1) * c, n - 1) - depth * c for m, lt in lcps if m >= depth * c],
      default=0,
  )
  return depth * c, max(copied, 0)


def random_prompt(rng, model, bases, c, past=()):
  kind = rng.integers(5 if past else 4)
  if kind == 4:  # an earlier prompt again, maybe continued (its sequence may be gone)
    tail = rng.integers(1000, 2000, rng.integers(0, 3)).tolist()
    return list(past[rng.integers(len(past))]) + tail
  if kind == 0 or not model.tokens:  # a system prompt + a private tail
    base = bases[rng.integers(len(bases))]
    head = base[: rng.integers(1, len(base) + 1)]
    return head + rng.integers(1000, 2000, rng.integers(0, 2 * c)).tolist()
  live = list(model.tokens.values())[rng.integers(len(model.tokens))]
  if kind == 1:  # a prefix of a live sequence (partial chunks, whole-prompt matches)
    return live[: rng.integers(1, len(live) + 1)]
  if kind == 2:  # a live sequence continued
    return live + rng.integers(1000, 2000, rng.integers(1, c + 2)).tolist()
  return rng.integers(1000, 2000, rng.integers(1, 3 * c)).tolist()  # unrelated


@pytest.mark.parametrize(
    'seed,chunk,share,retain,num_chunks',
    [(0, 4, True, False, 96), (1, 3, True, False, 96), (2, 8, True, False, 96),
     (3, 4, False, False, 96), (4, 4, True, True, 96), (8, 3, True, True, 64),
     (6, 8, True, True, 72)],
    ids=['seed0_chunk4', 'seed1_chunk3', 'seed2_chunk8', 'seed3_chunk4_no_sharing',
         'seed4_chunk4_retain', 'seed8_chunk3_retain_small_pool', 'seed6_chunk8_retain'],
)
def test_random_operations_match_brute_force(seed, chunk, share, retain, num_chunks):
  rng = np.random.default_rng(seed)
  config = ChunkCacheConfig(num_chunks=num_chunks, chunk_size=chunk,
                            max_sequence_length=12 * chunk, max_sequences=12,
                            share_prefixes=share, retain_prefixes=retain)
  model = Model(ChunkCache(config))
  bases = [rng.integers(0, 1000, 5 * chunk + k).tolist() for k in (0, 1, 3)]
  refusals = hits = 0
  past = []
  for _ in range(300):
    op = rng.choice(['insert', 'append', 'fork', 'remove'], p=[0.35, 0.35, 0.12, 0.18])
    cache = model.cache
    before = (cache.rows, cache.num_used_chunks, cache.reserved_chunks, cache.num_cached_chunks)
    try:
      if op == 'insert':
        reserve = int(rng.integers(0, 3 * chunk))
        tokens = random_prompt(rng, model, bases, chunk, past)[
            : config.max_sequence_length - reserve]
        want = expected_match(model, tokens, chunk) if share else (0, 0)
        samples = int(rng.choice([1, 1, 2, 3]))
        a = model.insert(tokens, reserve, samples)
        assert (a.shared_tokens, a.copied_tokens) == want
        assert a.prefill_start < len(tokens)  # the last prompt token is always prefilled
        hits += a.cached_tokens > 0
        past.append(tokens)
        if samples > 1 and rng.random() < 0.8:  # the engine forks right after the prefill
          model.verify()
          held = cache.reserved_chunks
          f = model.fork(a.seq_id, samples, reserve)  # never refused: the insert held its room
          assert len(f.seq_ids) == samples and cache.reserved_chunks <= held
      elif op == 'append' and cache.num_rows:
        if cache.lengths().max() < config.max_sequence_length:
          deferred = np.flatnonzero(rng.random(cache.num_rows) < 0.5)
          model.append(rng.integers(2000, 3000, cache.num_rows), deferred)
      elif op == 'fork' and cache.num_rows:
        sid = cache.rows[rng.integers(cache.num_rows)]
        if cache.length(sid) + chunk <= config.max_sequence_length:
          model.fork(sid, int(rng.integers(1, 4)), int(rng.integers(0, chunk)))
      elif op == 'remove' and cache.num_rows:
        model.remove(cache.rows[rng.integers(cache.num_rows)])
    except CapacityError:
      refusals += 1
      after = (cache.rows, cache.num_used_chunks, cache.reserved_chunks, cache.num_cached_chunks)
      assert after == before
    model.verify()
  assert refusals > 0  # the pool was full at times: refusals changed nothing (checked above)
  if retain:
    assert hits > 0 and model.cache.evicted_chunks > 0
  for sid in list(model.tokens):
    model.remove(sid)
    model.verify()
  assert model.cache.reserved_chunks == 0 and model.cache.num_rows == 0
  assert model.cache.num_used_chunks == model.cache.num_cached_chunks
  assert (model.cache.num_cached_chunks > 0) == retain
  model.cache.evict()
  model.verify()
  assert model.cache.num_used_chunks == 0 and model.cache.num_free_chunks == num_chunks


def test_record_tokens_refuses_positions_it_does_not_own():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=16, chunk_size=4, max_sequence_length=32,
                                      max_sequences=4))
  a = cache.insert(list(range(8)), reserve_tokens=4)
  cache.commit(a.seq_id)
  b = cache.insert(list(range(8)) + [9], reserve_tokens=4)
  cache.commit(b.seq_id)
  cache.append([-1, -1])
  with pytest.raises(ValueError, match='shared chunk'):
    cache.record_tokens([a.seq_id], [0], [5])
  with pytest.raises(ValueError, match='not held'):
    cache.record_tokens([a.seq_id], [9], [5])
  cache.record_tokens([a.seq_id, b.seq_id], [8, 9], [7, 8])
  cache.check()
  assert cache.tokens(a.seq_id).tolist() == list(range(8)) + [7]
  assert cache.match(list(range(8)) + [7, 1]).shared_tokens == 8


def test_partial_chunks_copy_on_write_and_full_chunks_shared():
  # Golden case, C = 4: A = 0..9 (chunks [0-3][4-7][8 9]).
  cache = ChunkCache(ChunkCacheConfig(num_chunks=32, chunk_size=4, max_sequence_length=32))
  a = cache.insert(list(range(10)))
  assert (a.shared_tokens, a.copied_tokens, a.prefill_start) == (0, 0, 0)
  cache.commit(a.seq_id)
  # B = A's first 8 tokens exactly: shares chunk 0, copies 3 tokens of chunk 1, prefills token 7.
  b = cache.insert(list(range(8)))
  assert (b.shared_tokens, b.copied_tokens, b.prefill_start) == (4, 3, 7)
  np.testing.assert_array_equal(b.copy_src, [4, 5, 6])
  cache.commit(b.seq_id)
  # C = A + more: shares chunks 0 and 1, copies A's partial tail (8 9).
  c = cache.insert(list(range(10)) + [77, 78, 79])
  assert (c.shared_tokens, c.copied_tokens, c.prefill_start) == (8, 2, 10)
  np.testing.assert_array_equal(c.copy_src, [8, 9])
  cache.check()
  plan = cache.plan()
  # Rows depth-first: A and C share chunk 1, all three share chunk 0.
  assert [(s.kv_start, s.kv_length, s.num_rows) for s in plan.segments] == [(0, 4, 3), (4, 4, 2)]


def test_pending_chunks_are_not_shared_until_committed():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=32, chunk_size=4, max_sequence_length=32))
  a = cache.insert(list(range(9)))
  m = cache.match(list(range(9)) + [5])
  assert m.pending and m.shared_tokens == 8
  b = cache.insert(list(range(9)) + [5])
  assert b.shared_tokens == 0 and b.copied_tokens == 0  # nothing computed yet to share
  cache.commit(a.seq_id)
  c = cache.insert(list(range(9)) + [6])
  assert c.shared_tokens == 8 and c.copied_tokens == 1
  cache.check()


def test_capacity_refusal_changes_nothing_and_reservations_hold():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=10, chunk_size=4, max_sequence_length=40))
  a = cache.insert(list(range(6)), reserve_tokens=10)  # 2 chunks + 2 reserved (length 16)
  cache.commit(a.seq_id)
  assert cache.num_used_chunks == 2 and cache.reserved_chunks == 2
  with pytest.raises(CapacityError, match='needs 7 chunks'):
    cache.insert(list(range(100, 120)), reserve_tokens=6)  # 5 new + 2 reserved > 6 available
  assert cache.rows == (a.seq_id,) and cache.num_used_chunks == 2
  b = cache.insert(list(range(6)) + [50, 51, 52], reserve_tokens=4)  # shares chunk 0: 2 new + 1
  assert b.shared_tokens == 4
  cache.commit(b.seq_id)
  assert cache.available_chunks == 3
  with pytest.raises(CapacityError, match='max_sequences|available'):
    cache.fork(a.seq_id, 3, reserve_tokens=8)
  for _ in range(10):  # both grow to their reservations: appends never fail
    cache.append([1, 2])
  cache.check()
  assert cache.reserved_chunks == 0 and cache.lengths().tolist() == [16, 19]
  with pytest.raises(ValueError, match='max_sequence_length'):
    cache.insert(list(range(41)))
  for bad, match in (([1, 2.5], r'tokens must hold integer token ids \(not float\)'),
                     ([], 'tokens must hold at least one token id'),
                     (np.array([3, -1]), 'tokens must hold token ids >= 0, got -1')):
    with pytest.raises(ValueError, match=match):  # before, 2.5 was cut to 2
      cache.insert(bad)


def test_remove_all_frees_everything():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=64, chunk_size=4, max_sequence_length=64))
  ids = []
  for k in range(5):
    a = cache.insert(list(range(13)) + [k] * 3, reserve_tokens=5)
    cache.commit(a.seq_id)
    ids.append(a.seq_id)
  ids += cache.fork(ids[0], 3, reserve_tokens=2).seq_ids[1:]
  assert cache.plan().segments  # the 12-token prompt is shared
  for sid in ids:
    cache.remove(sid)
    cache.check()
  assert cache.num_used_chunks == 0 and cache.reserved_chunks == 0 and cache.num_rows == 0


def test_retention_reuses_finished_prompts_and_evicts_lru_leaves_first():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=10, chunk_size=4, max_sequence_length=40,
                                      retain_prefixes=True))
  system = list(range(100, 112))  # 3 full chunks
  a = cache.insert(system + [1, 2], reserve_tokens=6)
  cache.commit(a.seq_id)
  for t in range(6):
    cache.append([t])
  cache.remove(a.seq_id)  # its 3 full prompt chunks stay cached; its tail and output are freed
  cache.check()
  assert (cache.num_rows, cache.num_used_chunks, cache.num_cached_chunks) == (0, 3, 3)
  assert cache.available_chunks == 10 and cache.reserved_chunks == 0
  b = cache.insert(system + [7, 8, 9])  # the same system prompt: only the new tokens prefill
  assert (b.shared_tokens, b.cached_tokens, b.copied_tokens, b.prefill_start) == (12, 12, 0, 12)
  assert cache.num_cached_chunks == 0 and cache.shared_tokens(b.seq_id) == 0  # one holder
  cache.commit(b.seq_id)
  cache.remove(b.seq_id)
  other = cache.insert(list(range(200, 208)) + [5])  # 2 full chunks, cached after it
  cache.commit(other.seq_id)
  cache.remove(other.seq_id)
  lru = [prefix[-4:] for prefix, _ in cached_prefixes(cache)]
  # Least recently used first, and every chunk after its cached children.
  assert lru == [system[8:], system[4:8], system[:4], list(range(204, 208)), list(range(200, 204))]
  c = cache.insert(list(range(300, 328)))  # 7 new chunks, 5 free: the 2 oldest leaves go
  assert cache.evicted_chunks == 2 and cache.num_cached_chunks == 3
  assert [p[-4:] for p, _ in cached_prefixes(cache)] == lru[2:]
  assert cache.match(system + [1]).shared_tokens == 4  # only the root chunk is left of it
  cache.commit(c.seq_id)
  with pytest.raises(CapacityError, match='3 cached'):
    cache.insert(list(range(400, 416)))  # 4 chunks: 0 free + 3 cached
  assert cache.num_cached_chunks == 3  # a refusal evicts nothing
  cache.remove(c.seq_id)
  cache.check()
  assert cache.num_cached_chunks == 3 + 7 and cache.evict(4) == 4
  assert cache.evict() == 6
  cache.check()
  assert cache.num_used_chunks == 0 and cache.num_free_chunks == 10


def test_a_cached_copy_source_reused_in_the_same_iteration_keeps_its_kv():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=6, chunk_size=4, max_sequence_length=24,
                                      retain_prefixes=True))
  model = Model(cache)
  model.remove(model.insert(list(range(9)), 0).seq_id)  # chunks [0..3] and [4..7] cached
  # One iteration: B shares [0..3], copies [4, 5] from the cached chunk; C evicts and reuses it.
  b = cache.insert([0, 1, 2, 3, 4, 5, 99])
  assert (b.cached_tokens, b.copied_tokens) == (4, 2)
  source = int(b.copy_src[0]) // 4
  c = cache.insert(list(range(100, 116)))  # 4 chunks: 3 free + the cached source
  assert cache.evicted_chunks == 1 and source in cache.chunks(c.seq_id)
  # The engine runs all copies of the iteration in one call (reads first), then the prefills.
  pool = model.pool.copy()
  k, v = copy_slots(jnp.asarray(pool[:, None, None]), jnp.asarray(pool[:, None, None]),
                    jnp.asarray(np.concatenate([b.copy_src, c.copy_src])),
                    jnp.asarray(np.concatenate([b.copy_dst, c.copy_dst])))
  model.pool = np.array(k)[:, 0, 0]
  for a, tokens in ((b, [0, 1, 2, 3, 4, 5, 99]), (c, list(range(100, 116)))):
    model.pool[a.prefill_slots] = np.asarray(tokens)[a.prefill_start :]
    cache.commit(a.seq_id)
    model.tokens[a.seq_id] = model.prompts[a.seq_id] = tokens
  model.verify()  # B's KV (its copied tokens included) and C's are intact


def test_retention_keeps_prompt_chunks_only_and_needs_sharing():
  with pytest.raises(ValueError, match='share_prefixes'):
    ChunkCacheConfig(num_chunks=4, share_prefixes=False, retain_prefixes=True)
  cache = ChunkCache(ChunkCacheConfig(num_chunks=16, chunk_size=4, max_sequence_length=32,
                                      retain_prefixes=True))
  a = cache.insert(list(range(6)), reserve_tokens=8)  # prompt: 1 full chunk + 2 tokens
  cache.commit(a.seq_id)
  f = cache.fork(a.seq_id, 2, reserve_tokens=8)
  for t in range(8):
    cache.append([t, t + 50])
  cache.remove(f.seq_ids[1])
  assert cache.num_cached_chunks == 0  # the root chunk is still held by the original
  cache.remove(a.seq_id)
  assert [p for p, _ in cached_prefixes(cache)] == [[0, 1, 2, 3]]  # generated chunks are freed
  cache.check()


def test_insert_for_samples_holds_its_fork():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=12, chunk_size=4, max_sequence_length=32,
                                      max_sequences=4))
  prompt = list(range(10))  # 2 full chunks + a partial tail of 2 tokens
  assert cache.chunks_needed(prompt, reserve_tokens=5, num_samples=3) == 3 + 1 + 2 * (1 + 1)
  assert cache.max_chunks(10, reserve_tokens=5, num_samples=3) == 8
  a = cache.insert(prompt, reserve_tokens=5, num_samples=3)
  assert cache.num_used_chunks == 3 and cache.reserved_chunks == 1 + 4
  with pytest.raises(CapacityError, match='max_sequences'):
    cache.insert([50, 51], num_samples=2)  # 1 live + 2 held rows + 2 > 4
  with pytest.raises(CapacityError, match='available'):
    cache.insert(list(range(50, 70)))  # 5 chunks; only 4 of 9 free are not reserved
  cache.commit(a.seq_id)
  f = cache.fork(a.seq_id, 3, reserve_tokens=5)
  cache.check()
  assert cache.reserved_chunks == 3 and cache.num_used_chunks == 5
  tail = cache.chunks(a.seq_id)[-1]
  np.testing.assert_array_equal(f.copy_src, np.tile(tail * 4 + np.arange(2), 2))
  for sid in f.seq_ids:  # full chunks shared, the partial tail copied
    assert cache.tokens(sid).tolist() == prompt and cache.shared_tokens(sid) == 8
  b = cache.insert(list(range(50, 53)), reserve_tokens=1)  # the hold is given back
  cache.commit(b.seq_id)
  for sid in [*f.seq_ids, b.seq_id]:
    cache.remove(sid)
  cache.check()
  assert cache.num_used_chunks == 0 and cache.reserved_chunks == 0
  c = cache.insert(prompt, num_samples=4)
  cache.remove(c.seq_id)  # removed before its fork: the hold goes too
  cache.check()
  assert cache.reserved_chunks == 0 and cache.available_chunks == 12


def test_contiguous_allocation_gives_one_segment_per_prompt():
  cache = ChunkCache(ChunkCacheConfig(num_chunks=64, chunk_size=4, max_sequence_length=64))
  filler = cache.insert(list(range(500, 505)))  # 2 chunks
  cache.commit(filler.seq_id)
  system = list(range(20))
  for k in range(3):
    a = cache.insert(system + [100 + k])
    cache.commit(a.seq_id)
  plan = cache.plan()
  assert [(s.kv_length, s.num_rows) for s in plan.segments] == [(20, 3)]


def _random_pool(seed, tokens, kv_heads, dtype):
  kk, kv = jax.random.split(jax.random.key(seed))
  k = jax.random.normal(kk, (tokens, kv_heads, 16), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (tokens, kv_heads, 16), jnp.float32).astype(dtype)
  return k, v


def _populated_cache(seed, share=True, chunk=4, policy=None):
  rng = np.random.default_rng(seed)
  cache = ChunkCache(ChunkCacheConfig(
      num_chunks=80, chunk_size=chunk, max_sequence_length=24 * chunk, max_sequences=16,
      share_prefixes=share, layout=policy or LayoutPolicy(kv_piece=2 * chunk)))
  systems = [rng.integers(0, 100, 9 * chunk + 1).tolist(), rng.integers(0, 100, 3 * chunk).tolist()]
  for k in range(7):
    a = cache.insert(systems[k % 2] + rng.integers(100, 200, k + 1).tolist(), reserve_tokens=chunk)
    cache.commit(a.seq_id)
  cache.fork(cache.rows[0], 2)
  cache.remove(cache.rows[3])
  cache.append(rng.integers(0, 100, cache.num_rows))
  return cache


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


FIXED = LayoutPolicy(kv_piece=16, min_segments=4, fixed_shapes=True)


@pytest.mark.parametrize(
    'share,heads,dtype,policy',
    [(True, (4, 4), jnp.float32, None), (True, (4, 2), jnp.bfloat16, None),
     (True, (4, 1), jnp.float32, None), (True, (4, 2), jnp.float32, FIXED),
     (False, (4, 2), jnp.float32, None), (False, (4, 1), jnp.bfloat16, FIXED)],
    ids=['shared_mha_f32', 'shared_gqa_bf16', 'shared_mqa_f32', 'shared_gqa_f32_fixed_shapes',
         'unshared_gqa_f32', 'unshared_mqa_bf16_fixed_shapes'],
)
def test_decode_attention_over_pool_equals_oracle(share, heads, dtype, policy):
  n, kh = heads
  seed = 10 * n + kh + (100 if dtype == jnp.bfloat16 else 0) + (7 if share else 0)
  cache = _populated_cache(seed, share, policy=policy)
  assert bool(cache.plan().segments) == share
  b = cache.num_rows
  rows = 16  # padded batch: padding rows give (0, -inf)
  k, v = _random_pool(seed, cache.config.kv_tokens, kh, dtype)
  q = jax.random.normal(jax.random.key(seed + 1), (rows, 1, n, 16), jnp.float32).astype(dtype)
  layout = cache.device_layout(num_rows=rows)
  got = hj.tree_attention(q, k, v, layout, impl='xla')
  expected = hj.naive_tree_attention(q, k, v, cache.plan(num_rows=rows))
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(got.out, np.float32), np.asarray(expected.out, np.float32),
                             atol=tol, rtol=tol)
  np.testing.assert_allclose(got.lse[:b], expected.lse[:b], atol=tol, rtol=tol)
  assert np.all(np.isneginf(np.asarray(got.lse[b:]))) and not np.asarray(got.out[b:]).any()
  # Independently of the plan: each row over its own tokens' slots.
  width = max(cache.length(s) for s in cache.rows)
  idx = np.zeros((b, width), np.int64)
  for r, sid in enumerate(cache.rows):
    idx[r, : cache.length(sid)] = cache.slots(sid)
  direct = hj.naive_attention(q[:b], k[idx], v[idx], jnp.asarray(cache.lengths()))
  np.testing.assert_allclose(np.asarray(got.out[:b], np.float32),
                             np.asarray(direct.out, np.float32),
                             atol=tol, rtol=tol)


def test_prefill_subset_layout_equals_oracle():
  cache = _populated_cache(3)
  rng = np.random.default_rng(3)
  base = cache.tokens(cache.rows[1]).tolist()
  a = cache.insert(base[:29] + rng.integers(0, 100, 6).tolist())
  b = cache.insert(rng.integers(0, 100, 11).tolist())
  t = max(a.num_tokens - a.prefill_start, b.num_tokens - b.prefill_start)
  ids = sorted([a.seq_id, b.seq_id], key=cache.row)
  plan = cache.plan(ids, num_rows=4)
  assert any(s.num_rows == 1 for s in plan.segments)  # shared with rows outside the batch
  # Only rows whose private length covers T query tokens are valid: pad queries per row.
  k, v = _random_pool(4, cache.config.kv_tokens, 2, jnp.float32)
  q = jax.random.normal(jax.random.key(5), (4, t, 4, 16), jnp.float32)
  got = hj.tree_attention(q, k, v, cache.device_layout(ids, num_rows=4), impl='xla')
  expected = hj.naive_tree_attention(q, k, v, plan)
  for row, sid in enumerate(ids):
    new = cache.length(sid) - (a if sid == a.seq_id else b).prefill_start
    np.testing.assert_allclose(got.out[row, t - new :], expected.out[row, t - new :], atol=2e-5)
  # The queries' own tokens are the last private tokens: the newest position sees everything.
  slots = cache.slots(a.seq_id)
  row = ids.index(a.seq_id)
  direct = hj.naive_attention(q[row : row + 1, -1:], k[slots][None], v[slots][None],
                              jnp.array([len(slots)]))
  np.testing.assert_allclose(got.out[row, -1], direct.out[0, 0], atol=2e-5)


def test_device_layout_shapes_are_bucketed_and_cached():
  cache = _populated_cache(6)
  layout = cache.device_layout(num_rows=16)
  for g in layout.groups:
    j = g.num_segments
    assert j & (j - 1) == 0 and g.kv_capacity <= 8 and g.row_capacity & (g.row_capacity - 1) == 0
  again = cache.device_layout(num_rows=16)
  assert again.groups is layout.groups and again.private_pages is layout.private_pages
  cache.append(np.zeros(cache.num_rows, np.int64))
  after = cache.device_layout(num_rows=16)
  assert after.groups is layout.groups  # appends never rebuild segment metadata
  np.testing.assert_array_equal(after.private_lengths[: cache.num_rows],
                                np.asarray(layout.private_lengths[: cache.num_rows]) + 1)
  plain = cache.plan().to_device(policy=LayoutPolicy(kv_piece=1 << 20))
  assert sum(int((g.kv_length > 0).sum()) for g in plain.groups) == len(cache.plan().segments)


def test_fixed_shapes_give_one_group_and_row_paths():
  cache = _populated_cache(9, policy=FIXED)
  layout = cache.device_layout(num_rows=16)
  assert [(g.row_capacity, g.kv_capacity) for g in layout.groups] == [(16, 16)]
  assert layout.groups[0].num_segments >= 4
  if getattr(layout, 'row_segments', None) is None:
    return
  starts = np.concatenate([np.asarray(g.kv_start) for g in layout.groups])
  lengths = np.concatenate([np.asarray(g.kv_length) for g in layout.groups])
  plan = cache.plan(num_rows=16)
  for row in range(16):
    ids = [i for i in np.asarray(layout.row_segments[row]).tolist() if i >= 0]
    got = [t for i in ids for t in range(starts[i], starts[i] + lengths[i])]
    segs = [plan.segments[j] for j in plan.path(row)]
    want = [t for s in segs for t in range(s.kv_start, s.kv_start + s.kv_length)]
    assert got == want


def test_fixed_shapes_without_sharing_give_no_segment_group():
  # Nothing is ever shared: the layout has no (empty) group, so attention takes the paged path.
  cache = _populated_cache(10, share=False, policy=FIXED)
  for layout in (cache.device_layout(num_rows=16), cache.device_layout(cache.rows[:3])):
    assert layout.groups == ()
  assert int(cache.device_layout(num_rows=16).private_lengths.sum()) == int(cache.lengths().sum())


def test_copy_slots_copies_every_layer_and_drops_padding():
  k = jax.random.normal(jax.random.key(8), (3, 20, 2, 4))
  v = jax.random.normal(jax.random.key(9), (3, 20, 2, 4))
  k0, v0 = np.asarray(k), np.asarray(v)
  k1, v1 = copy_slots(k, v, jnp.array([1, 2, 0]), jnp.array([10, 11, 20]))
  want_k, want_v = k0.copy(), v0.copy()
  want_k[:, [10, 11]] = k0[:, [1, 2]]
  want_v[:, [10, 11]] = v0[:, [1, 2]]
  np.testing.assert_array_equal(k1, want_k)
  np.testing.assert_array_equal(v1, want_v)
  # Every source is read before any destination is written: a chain of copies in one call.
  k2, _ = copy_slots(jnp.asarray(k0), jnp.asarray(v0), jnp.array([1, 2]), jnp.array([2, 3]))
  want_k = k0.copy()
  want_k[:, [2, 3]] = k0[:, [1, 2]]
  np.testing.assert_array_equal(k2, want_k)

# `make test` keeps these cases (conftest: `representative_cases`; `()`: the whole test is left
# to `make test-all`, another test of the default run covering its path).
representative_cases = {
    'test_decode_attention_over_pool_equals_oracle': ('shared_gqa_bf16', 'shared_mqa_f32', 'unshared_mqa_bf16_fixed_shapes'),
}
