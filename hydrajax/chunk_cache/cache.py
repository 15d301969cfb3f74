"""The prefix-aware chunked KV cache (ChunkAttention's PAKV) on hydrajax layouts.

Storage: a pool of `num_chunks` chunks of C tokens, allocated once on the
device as the flat KV buffer `[L = num_chunks * C, K, H]` of every layer
(chunk i = tokens `[i * C, (i + 1) * C)`). `ChunkCache` is the host side: a
prefix tree over token ids whose nodes are chunks, and the live sequences. It
owns the sequences' lifecycle (insert, append, fork, remove, capacity) and
composes one module per concern: `trie` (prefix matching), `allocator` (free
chunks, reservations), `eviction` (retained chunks, LRU), `row_order`
(depth-first rows, shared segments), `layout_cache` (plans, device layouts).

Tree. Node = one chunk at a chunk-aligned depth d: it holds the sequence's
tokens `[d * C, d * C + fill)`. A sequence is a root-to-node path. Sharing is
by whole chunks:

* A *full* chunk (C tokens) is shared by every sequence whose tokens at those
  positions are identical (reference count = its holders).
* A *partial* chunk (fewer than C tokens, a sequence's growing tail) is never
  shared: only its one holder appends to it.
* Copy on write, for what cannot be shared: when a new prompt matches only the
  first m < C tokens of a chunk (it diverges inside a full chunk, or it matches
  another sequence's partial tail), and when `fork` gives each sample its own
  copy of a partial tail, the m tokens' KV are *copied* into a fresh chunk of
  the new sequence (`copy_src` -> `copy_dst` slots; the caller runs
  `pool.copy_slots` before the next model step) and are not recomputed.
* At least the last prompt token is always prefilled (its logits give the
  first new token): a prompt that matches full chunks to its very end shares
  all but the last chunk and copies C - 1 tokens of that one.

Rows. Live sequences are kept in depth-first order of the tree (children in
list order, then the sequences whose tail is the node), so every chunk's
holders are a contiguous row range. A new chunk made by `append` is added as
the last child of the old tail, which keeps every row where it was: appends
never reorder rows. `insert`, `fork` and `remove` change the structure (a new
`structure_version`); appends change only lengths and, when a chunk fills up,
one row's page table (`pages_version`).

Plan. Along a row's path, chunks with two or more holders come first (holder
sets only shrink towards the leaves) and form its shared segments: maximal
runs of chunks with identical holders that are physically contiguous in the
pool (a run is split where the next chunk is not the next pool chunk, so
allocation prefers contiguous runs). The rest of the path (one holder) is the
row's private KV: its page table with page_size = C. The query tokens of a
decode or prefill step are always the newest tokens, so they are private.

Capacity. `insert` and `fork` reserve the chunks that the sequence's future
appends will take (`reserve_tokens`), and refuse with `CapacityError` (nothing
changed) when the pool cannot hold the new sequence and every reservation;
so appends within the reservations never fail and never touch a live
sequence's chunks. `insert(..., num_samples=n)` also holds the chunks and rows
that `fork(seq_id, n)` right after its prefill will take, so that a prompt
admitted for n samples can always be forked.

Retention (`retain_prefixes`, with sharing only). When a sequence is removed,
its full prompt chunks stay in the tree with no holder: *cached* chunks, which
a later `insert` matches like live ones (a prefix-cache hit: no prefill of
those tokens). Cached chunks count as available room: an operation that needs
chunks evicts them, least recently used first and leaves first (a chunk that
has cached children stays until they are gone). A copy on write may read a
cached chunk that a later insert of the same iteration evicts and reuses:
run all the copies before the next model step (`copy_slots` reads every
source before it writes).
"""

import dataclasses
from typing import Sequence

import numpy as np

from hydrajax.chunk_cache.allocator import CapacityError, ChunkAllocator
from hydrajax.chunk_cache.eviction import CachedChunks
from hydrajax.chunk_cache.layout_cache import LayoutCache, build_plan, no_empty_groups, plan_layout
from hydrajax.chunk_cache.row_order import RowArrays, dfs_order, order_rows, segments
from hydrajax.chunk_cache.trie import ChunkTrie, Node
from hydrajax.layout import LayoutPolicy, Segment, SharingPlan, TreeLayout, as_int
from hydrajax.validation import token_ids



@dataclasses.dataclass(frozen=True)
class ChunkCacheConfig:
  """Sizes of a chunk cache.

  Attributes:
    num_chunks: chunks in the pool (L = num_chunks * chunk_size tokens per layer).
    chunk_size: C, tokens per chunk.
    max_sequence_length: longest sequence (prompt + generated); fixes the page-table width.
    max_sequences: most live sequences (rows).
    share_prefixes: False stores every sequence on its own (the no-sharing baseline).
    retain_prefixes: keep removed sequences' full prompt chunks as an LRU prefix cache
      (needs share_prefixes).
    layout: static-shape policy of device layouts.
  """

  num_chunks: int
  chunk_size: int = 64
  max_sequence_length: int = 4096
  max_sequences: int = 256
  share_prefixes: bool = True
  retain_prefixes: bool = False
  layout: LayoutPolicy = LayoutPolicy()

  def __post_init__(self):
    for name in ('num_chunks', 'chunk_size', 'max_sequence_length', 'max_sequences'):
      value = as_int(getattr(self, name), f'ChunkCacheConfig.{name}')  # 8.5 chunks: no
      if value < 1:
        raise ValueError(f'ChunkCacheConfig.{name} must be >= 1, got {value}')
      object.__setattr__(self, name, value)
    if self.retain_prefixes and not self.share_prefixes:
      raise ValueError('retain_prefixes needs share_prefixes (cached chunks are reused by sharing)')

  @property
  def kv_tokens(self) -> int:
    """L, tokens of the flat KV buffer."""
    return self.num_chunks * self.chunk_size

  @property
  def max_pages(self) -> int:
    """Width of the private page table."""
    return -(-self.max_sequence_length // self.chunk_size)


@dataclasses.dataclass(frozen=True)
class Admission:
  """What `insert` did, and what the caller must compute.

  Attributes:
    seq_id: the new sequence.
    num_tokens: n, prompt tokens.
    shared_tokens: leading tokens whose KV is reused: full chunks of live or cached sequences.
    copy_src, copy_dst: [M] int32 flat slots: copy these tokens' KV (copy on write).
    prefill_start: first position to prefill (= shared_tokens + M).
    prefill_slots: [n - prefill_start] int32 flat slots where the prefill writes its KV.
    cached_tokens: the part of shared_tokens in cached chunks (no live holder: a cache hit).
  """

  seq_id: int
  num_tokens: int
  shared_tokens: int
  copy_src: np.ndarray
  copy_dst: np.ndarray
  prefill_start: int
  prefill_slots: np.ndarray
  cached_tokens: int = 0

  @property
  def copied_tokens(self) -> int:
    return int(self.copy_src.size)


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
  """What `insert` would reuse, if every pending (not yet prefilled) chunk were ready.

  Attributes:
    shared_tokens: tokens in matching full chunks.
    copied_tokens: tokens a copy on write would reuse.
    pending: part of that match is not computed yet (its prefill has not run).
    chunks_needed: chunks the insert would take now, reservations included.
  """

  shared_tokens: int
  copied_tokens: int
  pending: bool
  chunks_needed: int


@dataclasses.dataclass(frozen=True)
class Fork:
  """Result of `fork`: the samples (the original first) and the KV copies to run."""

  seq_ids: tuple[int, ...]
  copy_src: np.ndarray
  copy_dst: np.ndarray


class _Seq:
  __slots__ = ('id', 'path', 'reserved', 'row', 'length', 'prompt_chunks', 'fork_chunks',
               'fork_rows')

  def __init__(self, seq_id: int, path: list[Node], length: int, reserved: int,
               prompt_chunks: int):
    self.id = seq_id
    self.path = path
    self.length = length  # valid until the sequence has a row; the row arrays hold it after
    self.reserved = reserved  # chunks set aside for its future appends
    self.prompt_chunks = prompt_chunks  # full chunks of its prompt (retained when removed)
    self.fork_chunks = 0  # chunks held for a fork (insert's num_samples), also reserved
    self.fork_rows = 0  # rows held for that fork
    self.row = -1


class ChunkCache:
  """Host side of the prefix-aware chunked KV cache; see the module docstring."""

  def __init__(self, config: ChunkCacheConfig, *, first_seq_id: int = 0):
    """`first_seq_id`: the first sequence id it hands out (an engine with one cache per data
    parallel shard gives each cache its own range, so that ids never collide)."""
    self.config = config
    c = config.chunk_size
    self._c = c
    self._alloc = ChunkAllocator(config.num_chunks)
    self._trie = ChunkTrie(config.num_chunks, c)
    self._root, self._tokens, self._fill = self._trie.root, self._trie.tokens, self._trie.fill
    self._cached = CachedChunks(self._alloc, self._fill)  # retained chunks (retain_prefixes)
    self._seqs: dict[int, _Seq] = {}
    self._held_rows = 0  # rows held for forks
    self._next_id = int(first_seq_id)
    self._rows: list[int] = []  # sequence ids in row (depth-first) order
    self._shared_nodes: list[Node] = []  # nodes with >= 2 holders, depth-first pre-order
    self._row = RowArrays(config.max_sequences, config.max_pages)  # per-row arrays, row order
    self.structure_version = 0
    self.pages_version = 0
    self._layouts = LayoutCache()

  @property
  def evicted_chunks(self) -> int:
    """Cached chunks freed to make room, over the cache's life (the caller may reset it)."""
    return self._cached.evicted

  @evicted_chunks.setter
  def evicted_chunks(self, value: int) -> None:
    self._cached.evicted = value

  @property
  def _lru(self) -> dict[Node, None]:
    """Cached nodes, least recently used first."""
    return self._cached.lru

  @property
  def _device_cache(self) -> dict[str, tuple]:
    """The cached device arrays of the layout of all rows (clear() forces a rebuild)."""
    return self._layouts.entries

  # ---- queries ----------------------------------------------------------------------------

  @property
  def chunk_size(self) -> int:
    return self._c

  @property
  def num_rows(self) -> int:
    """Live sequences."""
    return len(self._rows)

  @property
  def rows(self) -> tuple[int, ...]:
    """Live sequence ids in row order."""
    return tuple(self._rows)

  @property
  def num_free_chunks(self) -> int:
    return self._alloc.num_free

  @property
  def num_used_chunks(self) -> int:
    return self._alloc.num_used

  @property
  def available_chunks(self) -> int:
    """Free chunks that no reservation holds, plus cached chunks (evictable)."""
    return self._alloc.available + len(self._cached)

  @property
  def num_cached_chunks(self) -> int:
    """Chunks that no live sequence holds, kept as a prefix cache (`retain_prefixes`)."""
    return len(self._cached)

  @property
  def reserved_chunks(self) -> int:
    return self._alloc.reserved

  def used_chunks(self) -> np.ndarray:
    """Ids of the chunks in use."""
    return self._alloc.used()

  def row(self, seq_id: int) -> int:
    return self._seq(seq_id).row

  def length(self, seq_id: int) -> int:
    return int(self._row.lengths[self._seq(seq_id).row])

  def lengths(self) -> np.ndarray:
    """Tokens per row [num_rows] int64 (a copy)."""
    return self._row.lengths[: self.num_rows].copy()

  def private_lengths(self, num_rows: int | None = None) -> np.ndarray:
    """Private tokens per row (its length minus its shared tokens) [num_rows] int32, rows past
    the live ones 0: the private lengths of `plan(num_rows=...)` without building it."""
    b = self.num_rows
    out = np.zeros(max(b, 1) if num_rows is None else num_rows, np.int32)
    out[:b] = self._row.lengths[:b] - self._row.shared[:b]
    return out

  def chunks(self, seq_id: int) -> np.ndarray:
    """The sequence's chunk ids, root first."""
    return np.array([n.chunk for n in self._seq(seq_id).path], np.int64)

  def slots(self, seq_id: int) -> np.ndarray:
    """Flat KV slot of each of the sequence's tokens [n] int64."""
    n = self.length(seq_id)
    pos = np.arange(n)
    return self.chunks(seq_id)[pos // self._c] * self._c + pos % self._c

  def tokens(self, seq_id: int) -> np.ndarray:
    """The sequence's token ids, read back from the chunks [n] int32."""
    n = self.length(seq_id)
    return self._tokens[self.chunks(seq_id)].reshape(-1)[:n].copy()

  def shared_tokens(self, seq_id: int) -> int:
    return int(self._row.shared[self._seq(seq_id).row])

  def match(self, tokens: Sequence[int], *, reserve_tokens: int = 0,
            num_samples: int = 1) -> PrefixMatch:
    """What `insert(tokens)` would reuse if pending chunks were ready (changes nothing)."""
    tokens = self._check_tokens(tokens, reserve_tokens)
    matched, src, copy_len = self._walk(tokens, allow_pending=True)
    pending = any(not n.ready for n in matched) or (src is not None and not src.ready)
    fresh, _, _ = self._walk(tokens, allow_pending=False) if pending else (matched, None, 0)
    needed = self._insert_chunks(len(tokens), len(fresh), reserve_tokens, num_samples)
    return PrefixMatch(len(matched) * self._c, copy_len, pending, needed)

  def chunks_needed(self, tokens: Sequence[int], *, reserve_tokens: int = 0,
                    num_samples: int = 1) -> int:
    """Chunks `insert` would take now (new chunks, the reservation, the fork's hold)."""
    tokens = self._check_tokens(tokens, reserve_tokens)
    matched, _, _ = self._walk(tokens, allow_pending=False)
    return self._insert_chunks(len(tokens), len(matched), reserve_tokens, num_samples)

  def max_chunks(self, num_tokens: int, *, reserve_tokens: int = 0, num_samples: int = 1) -> int:
    """Most chunks an insert of `num_tokens` (sharing nothing) and its fork can take."""
    return self._insert_chunks(num_tokens, 0, reserve_tokens, num_samples)

  # ---- operations -------------------------------------------------------------------------

  def insert(self, tokens: Sequence[int], *, reserve_tokens: int = 0,
             num_samples: int = 1) -> Admission:
    """Adds a sequence: shares its longest ready prefix of full chunks, copies a partial match.

    Args:
      tokens: the prompt, n >= 1 token ids.
      reserve_tokens: tokens the sequence may append later (chunks are reserved for them).
      num_samples: also hold the chunks and rows of `fork(seq_id, num_samples,
        reserve_tokens=reserve_tokens)` right after the prefill (released by that fork or
        by `remove`).

    Returns what was shared, the KV copies to run and where the prefill writes.
    Raises CapacityError (changing nothing) if the pool cannot hold it.
    """
    tokens = self._check_tokens(tokens, reserve_tokens)
    if num_samples < 1:
      raise ValueError(f'num_samples must be >= 1, got {num_samples}')
    n, c = len(tokens), self._c
    matched, src, copy_len = self._walk(tokens, allow_pending=False)
    depth = len(matched)
    new_count = self._new_chunks(n, depth)
    reserve = self._chunks_for(n, reserve_tokens)
    hold = self._insert_chunks(n, depth, reserve_tokens, num_samples) - new_count - reserve
    revived = [node for node in matched if not node.holders]  # cached chunks it reuses
    pinned = len(revived) + int(src is not None and not src.holders)  # not evictable now
    self._check_room(num_samples, new_count + reserve + hold, 'insert', pinned=pinned)
    for node in revived:
      self._cached.revive(node)
    self._reclaim(new_count + reserve + hold, keep=src)
    chunks = self._alloc.allocate(new_count, after=matched[-1].chunk if matched else -1)
    self._alloc.reserve(reserve + hold)
    sid = self._new_id()
    dirty = {sid}
    for node in matched:
      if len(node.holders) == 1:
        dirty |= node.holders  # its only holder's chunk becomes shared
      node.holders.add(sid)
    parent = matched[-1] if matched else self._root
    path = list(matched)
    for i, chunk in enumerate(chunks.tolist()):
      lo = (depth + i) * c
      hi = min(n, lo + c)
      self._tokens[chunk, : hi - lo] = tokens[lo:hi]
      self._fill[chunk] = hi - lo
      node = Node(chunk, parent, depth + i, int(tokens[lo]))
      node.holders.add(sid)
      node.ready = False
      parent.add_child(node)
      path.append(node)
      parent = node
    path[-1].tails.append(sid)
    seq = self._seqs[sid] = _Seq(sid, path, n, reserve, n // c)
    seq.fork_chunks, seq.fork_rows = hold, num_samples - 1
    self._held_rows += num_samples - 1
    copy_src = np.zeros(0, np.int32)
    copy_dst = np.zeros(0, np.int32)
    if copy_len:
      copy_src = (src.chunk * c + np.arange(copy_len)).astype(np.int32)
      copy_dst = (int(chunks[0]) * c + np.arange(copy_len)).astype(np.int32)
    start = depth * c + copy_len
    pos = np.arange(start, n)
    slots = np.array([nd.chunk for nd in path], np.int64)[pos // c] * c + pos % c
    self._restructure(dirty)
    return Admission(sid, n, depth * c, copy_src, copy_dst, start, slots.astype(np.int32),
                     len(revived) * c)

  def commit(self, seq_id: int) -> None:
    """Marks a sequence's chunks computed (after its prefill ran): others may now share them."""
    for node in self._seq(seq_id).path:
      node.ready = True

  def append(self, tokens: Sequence[int]) -> np.ndarray:
    """Appends one token to every live sequence; tokens [num_rows] in row order.

    Returns the flat slot [num_rows] int32 where each token's KV goes. The
    tokens count as computed once this returns: run the step that writes them
    before the next `insert`.
    """
    b = self.num_rows
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    if tokens.shape != (b,):
      raise ValueError(f'tokens must be [num_rows={b}] (one per live sequence), got {tokens.shape}')
    if b == 0:
      return np.zeros(0, np.int32)
    c = self._c
    lengths = self._row.lengths[:b]
    if lengths.max() >= self.config.max_sequence_length:
      raise ValueError(
          f'a sequence would exceed max_sequence_length={self.config.max_sequence_length}'
      )
    offset = lengths % c
    cross = np.flatnonzero(offset == 0)  # rows whose next token starts a new chunk
    if cross.size:
      seqs = [self._seqs[self._rows[r]] for r in cross.tolist()]
      unreserved = sum(1 for s in seqs if s.reserved == 0)
      if unreserved > self.available_chunks:
        raise CapacityError(
            f'append needs {unreserved} unreserved chunks, {self.available_chunks} available'
        )
      self._reclaim(unreserved)
      for r, s in zip(cross.tolist(), seqs):
        take = 1 if s.reserved > 0 else 0
        tail = s.path[-1]
        chunk = int(self._alloc.allocate(1, reserved=take, after=tail.chunk)[0])
        s.reserved -= take
        node = Node(chunk, tail, tail.depth + 1, int(tokens[r]))
        node.holders.add(s.id)
        tail.tails.remove(s.id)
        tail.add_child(node)  # last child: the row keeps its place (see the module docstring)
        node.tails.append(s.id)
        s.path.append(node)
        self._row.tails[r] = chunk
        self._row.pages[r, self._row.npages[r]] = chunk
        self._row.npages[r] += 1
      self.pages_version += 1
    tail = self._row.tails[:b]
    self._tokens[tail, offset] = tokens
    self._fill[tail] = offset + 1
    self._row.lengths[:b] += 1
    return (tail * c + offset).astype(np.int32)

  def record_tokens(self, seq_ids: Sequence[int], positions: Sequence[int],
                    tokens: Sequence[int]) -> None:
    """Sets the ids of tokens already appended (their KV slots are taken) with a placeholder.

    For an engine that appends a token before its value is back from the
    device (the step that computes it may still run): the tree must hold the
    real ids before the next `match`, `insert` or `fork`. A position must be
    one the sequence holds in a chunk of its own (its private tail).
    """
    c = self._c
    for sid, pos, token in zip(seq_ids, positions, tokens):
      s = self._seq(int(sid))
      pos, token = int(pos), int(token)
      if not 0 <= pos < int(self._row.lengths[s.row]):
        raise ValueError(f'position {pos} is not held by sequence {sid}')
      node = s.path[pos // c]
      if len(node.holders) != 1:
        raise ValueError(f'position {pos} of sequence {sid} is in a shared chunk')
      self._tokens[node.chunk, pos % c] = token
      if pos % c == 0 and node.first != token:  # the node's key in its parent changes
        node.parent.remove_child_key(node)
        node.first = token
        node.parent.by_first.setdefault(token, []).append(node)

  def fork(self, seq_id: int, num_samples: int, *, reserve_tokens: int = 0) -> Fork:
    """Splits a sequence into `num_samples` sequences (itself first) with the same tokens.

    Full chunks are shared; a partial tail is copied for each new sample (with
    `share_prefixes` off, every chunk is). Run the returned copies before the
    next model step. What `insert(..., num_samples=)` held for the sequence's
    fork is used here, and the rest given back (a fork refused for lack of room
    keeps it). The new samples' prompts are the sequence's prompt (retention).
    """
    s = self._seq(seq_id)
    if num_samples < 1:
      raise ValueError(f'num_samples must be >= 1, got {num_samples}')
    if any(not n.ready for n in s.path):
      raise ValueError(f'sequence {seq_id} is not prefilled yet (commit it first)')
    if reserve_tokens < 0:
      raise ValueError(f'reserve_tokens must be >= 0, got {reserve_tokens}')
    extra = num_samples - 1
    if extra == 0:
      self._release_hold(s)
      return Fork((seq_id,), np.zeros(0, np.int32), np.zeros(0, np.int32))
    c = self._c
    n = self.length(seq_id)
    if n + reserve_tokens > self.config.max_sequence_length:
      raise ValueError(
          f'length {n} + reserve_tokens {reserve_tokens} exceeds max_sequence_length='
          f'{self.config.max_sequence_length}'
      )
    # Chunks each sample copies: the partial tail, or (sharing off) the whole path.
    copied = len(s.path) if not self.config.share_prefixes else int(n % c != 0)
    reserve = self._chunks_for(n, reserve_tokens)
    need = extra * (copied + reserve)
    self._check_room(extra, need, 'fork', held_chunks=s.fork_chunks, held_rows=s.fork_rows)
    self._release_hold(s)
    self._reclaim(need)
    ids = [self._new_id() for _ in range(extra)]
    dirty = {seq_id, *ids}
    shared_path = s.path[: len(s.path) - copied]
    for node in shared_path:
      node.holders.update(ids)
    srcs, dsts = [], []
    if copied:
      originals = s.path[len(shared_path) :]
      first = originals[0]
      chunks = self._alloc.allocate(extra * copied, after=s.path[-1].chunk).reshape(extra, copied)
      at = first.parent.children.index(first) + 1
      for i, sid in enumerate(ids):
        parent, path = first.parent, list(shared_path)
        for original, chunk in zip(originals, chunks[i].tolist()):
          self._tokens[chunk] = self._tokens[original.chunk]
          self._fill[chunk] = self._fill[original.chunk]
          node = Node(chunk, parent, original.depth, original.first)
          node.holders.add(sid)
          # The first copy goes right after the original: the new rows follow the forked one.
          parent.add_child(node, at + i if parent is first.parent else None)
          srcs.append(original.chunk * c + np.arange(self._fill[chunk]))
          dsts.append(chunk * c + np.arange(self._fill[chunk]))
          path.append(node)
          parent = node
        path[-1].tails.append(sid)
        self._seqs[sid] = _Seq(sid, path, n, 0, s.prompt_chunks)
    else:
      tail = s.path[-1]
      at = tail.tails.index(seq_id) + 1
      tail.tails[at:at] = ids
      for sid in ids:
        self._seqs[sid] = _Seq(sid, list(shared_path), n, 0, s.prompt_chunks)
    self._alloc.reserve(extra * reserve)
    for sid in ids:
      self._seqs[sid].reserved = reserve
    self._restructure(dirty)
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)
    return Fork((seq_id, *ids), cat(srcs), cat(dsts))

  def remove(self, seq_id: int) -> None:
    """Retires a sequence: drops its references, frees (or caches) chunks nobody else holds.

    With `retain_prefixes`, its full prompt chunks that nobody holds any more
    become cached (most recently used), and so does a chunk that still has
    cached children; the rest is freed.
    """
    s = self._seq(seq_id)
    del self._seqs[seq_id]
    s.path[-1].tails.remove(seq_id)
    retain = self.config.retain_prefixes
    dirty, freed = set(), []
    for node in reversed(s.path):  # leaves first: a parent is cached after its children
      node.holders.discard(seq_id)
      if not node.holders:
        if node.children or (retain and node.ready and node.depth < s.prompt_chunks):
          self._cached.add(node)
        else:
          node.parent.remove_child(node)
          freed.append(node.chunk)
      elif len(node.holders) == 1:
        dirty |= node.holders  # a shared chunk becomes its last holder's private chunk
    self._fill[freed] = 0
    self._alloc.release(freed)
    self._alloc.unreserve(s.reserved)
    self._release_hold(s)
    self._restructure(dirty)

  def evict(self, num_chunks: int | None = None) -> int:
    """Frees up to `num_chunks` cached chunks (default all), LRU leaves first; returns how many."""
    before = len(self._cached)
    self._cached.evict(before if num_chunks is None else num_chunks)
    return before - len(self._cached)

  # ---- plans and device layouts -----------------------------------------------------------

  def plan(
      self, seq_ids: Sequence[int] | None = None, *, num_rows: int | None = None
  ) -> SharingPlan:
    """The sharing plan of all live rows, or of a subset of them (e.g. a prefill batch).

    Rows keep the cache's row order (a subset keeps its relative order).
    Chunks with >= 2 holders are shared segments (over the selected rows: a
    subset plan can have one-row segments); the rest is private. `num_rows`
    pads with empty rows (no pages, length 0).
    """
    rows = self._select(seq_ids)
    b = len(rows)
    num_rows = max(b, 1) if num_rows is None else num_rows
    if num_rows < max(b, 1):
      raise ValueError(f'num_rows must be >= the {b} selected rows (and >= 1), got {num_rows}')
    index = None  # global row -> plan row (the identity for all rows)
    if seq_ids is not None:
      chosen = np.zeros(self.num_rows + 1, np.int64)
      chosen[rows] = 1
      index = np.concatenate([[0], np.cumsum(chosen)]).tolist()
    return build_plan(self._row, rows, self._segments(index), num_rows, self._c,
                      self.config.kv_tokens)

  def device_layout(
      self, seq_ids: Sequence[int] | None = None, *, num_rows: int | None = None,
      policy: LayoutPolicy | None = None,
  ) -> TreeLayout:
    """`plan(...)` on the device, shaped by `config.layout`.

    For all rows (a decode step) the segment groups are cached until the
    structure changes and the page table until a page is added; only the
    private lengths ([num_rows] int32) are uploaded on every call. The page
    table's width is `config.layout.page_width` of the widest row. A subset
    (a prefill batch) is built afresh, with `policy` if given.
    """
    if seq_ids is not None:
      policy = no_empty_groups(policy or self.config.layout, self.config.share_prefixes)
      return plan_layout(self.plan(seq_ids, num_rows=num_rows), policy, self.config.max_pages)
    if policy is not None and policy != self.config.layout:
      raise ValueError('a layout of all rows (decode) uses config.layout: it is cached')
    policy = no_empty_groups(self.config.layout, self.config.share_prefixes)
    b = self.num_rows
    num_rows = max(b, 1) if num_rows is None else num_rows
    if num_rows < max(b, 1):
      raise ValueError(f'num_rows must be >= num_rows of the cache ({b}) and >= 1, got {num_rows}')
    return self._layouts.layout(
        self._row, b, num_rows, self._segments, policy, chunk_size=self._c,
        kv_tokens=self.config.kv_tokens, max_pages=self.config.max_pages,
        structure_version=self.structure_version, pages_version=self.pages_version,
    )

  # ---- checks -----------------------------------------------------------------------------

  def check(self) -> None:
    """Verifies every internal invariant (for tests and debugging); raises AssertionError."""
    c = self._c
    seen: dict[int, Node] = {}
    stack = [self._root]
    while stack:
      node = stack.pop()
      for child in node.children:
        assert child.parent is node and child.depth == node.depth + 1
        assert child.chunk not in seen, f'chunk {child.chunk} in two nodes'
        seen[child.chunk] = child
        assert child.holders <= node.holders or node is self._root
        assert self._fill[child.chunk] >= 1 and self._tokens[child.chunk, 0] == child.first
        if self._fill[child.chunk] < c:
          assert len(child.holders) == 1, f'partial chunk {child.chunk} is shared'
        if not child.holders:
          assert child in self._cached, f'chunk {child.chunk} has no holder and is not cached'
          assert child.ready and self._fill[child.chunk] == c and self.config.retain_prefixes
        stack.append(child)
    cached = [node for node in seen.values() if not node.holders]
    assert len(cached) == len(self._cached), 'a cached chunk left the tree'
    used = set(self.used_chunks().tolist())
    assert used == set(seen), f'leaked {sorted(used - set(seen))}, lost {sorted(set(seen) - used)}'
    assert self._rows == dfs_order(self._root), 'row order is not depth-first'
    assert set(self._rows) == set(self._seqs)
    reserved = 0
    for r, sid in enumerate(self._rows):
      s = self._seqs[sid]
      assert s.row == r
      n = int(self._row.lengths[r])
      assert len(s.path) == -(-n // c) and sid in s.path[-1].tails
      for node in s.path:
        assert sid in node.holders
      shared = sum(1 for node in s.path if len(node.holders) >= 2)
      assert all(len(node.holders) >= 2 for node in s.path[:shared])
      assert self._row.shared[r] == shared * c and self._row.tails[r] == s.path[-1].chunk
      assert self._row.pages[r, : self._row.npages[r]].tolist() == [nd.chunk for nd in s.path[shared:]]
      assert self._fill[s.path[-1].chunk] == n - (len(s.path) - 1) * c
      reserved += s.reserved + s.fork_chunks
    assert reserved == self._alloc.reserved
    assert self._held_rows == sum(s.fork_rows for s in self._seqs.values())

  # ---- internals --------------------------------------------------------------------------

  def _seq(self, seq_id: int) -> _Seq:
    try:
      return self._seqs[seq_id]
    except KeyError:
      raise ValueError(f'no live sequence with id {seq_id}') from None

  def _new_id(self) -> int:
    self._next_id += 1
    return self._next_id - 1

  def _select(self, seq_ids) -> list[int]:
    if seq_ids is None:
      return list(range(self.num_rows))
    rows = sorted({self._seq(int(s)).row for s in seq_ids})
    return rows

  def _check_tokens(self, tokens, reserve_tokens: int) -> np.ndarray:
    tokens = np.array(token_ids(tokens, 'tokens', allow_empty=False), np.int64)
    if reserve_tokens < 0:
      raise ValueError(f'reserve_tokens must be >= 0, got {reserve_tokens}')
    if tokens.size + reserve_tokens > self.config.max_sequence_length:
      raise ValueError(
          f'{tokens.size} tokens + reserve_tokens {reserve_tokens} exceed max_sequence_length='
          f'{self.config.max_sequence_length}'
      )
    return tokens

  def _insert_chunks(self, n: int, matched: int, reserve_tokens: int, num_samples: int) -> int:
    """Chunks of an insert: new ones, its reservation, the hold of its fork into num_samples."""
    own = self._new_chunks(n, matched) + self._chunks_for(n, reserve_tokens)
    copied = -(-n // self._c) if not self.config.share_prefixes else int(n % self._c != 0)
    return own + (num_samples - 1) * (copied + self._chunks_for(n, reserve_tokens))

  def _chunks_for(self, n: int, extra_tokens: int) -> int:
    """Chunks that appending `extra_tokens` to a length-n sequence allocates."""
    c = self._c
    return -(-(n + extra_tokens) // c) - -(-n // c)

  def _new_chunks(self, n: int, matched: int) -> int:
    return -(-n // self._c) - matched

  def _check_room(self, sequences: int, chunks: int, what: str, *, pinned: int = 0,
                  held_chunks: int = 0, held_rows: int = 0) -> None:
    """Raises CapacityError unless `sequences` rows and `chunks` chunks fit.

    `pinned` cached chunks cannot be evicted for it; `held_*` is what a fork's
    insert held for it.
    """
    rows = self.num_rows + self._held_rows - held_rows
    if rows + sequences > self.config.max_sequences:
      raise CapacityError(
          f'{what}: {rows} live or held sequences + {sequences} exceed max_sequences='
          f'{self.config.max_sequences}'
      )
    available = self._alloc.available + len(self._cached) - pinned + held_chunks
    if chunks > available:
      raise CapacityError(
          f'{what} needs {chunks} chunks (new + reserved), {available} available '
          f'({self._alloc.num_free} free of {self.config.num_chunks}, '
          f'{self._alloc.reserved} reserved, {len(self._cached)} cached)'
      )

  def _release_hold(self, s: _Seq) -> None:
    """Gives back what an insert held for the sequence's fork."""
    self._alloc.unreserve(s.fork_chunks)
    self._held_rows -= s.fork_rows
    s.fork_chunks = s.fork_rows = 0

  def _reclaim(self, chunks: int, keep: Node | None = None) -> None:
    """Evicts cached chunks until `chunks` are available (`keep` stays)."""
    self._cached.reclaim(chunks, keep)

  def _walk(self, tokens: np.ndarray, allow_pending: bool):
    """Longest shareable prefix (`ChunkTrie.walk`); nothing is shared without share_prefixes."""
    if not self.config.share_prefixes:
      return [], None, 0
    return self._trie.walk(tokens, allow_pending)

  def _segments(self, index: list[int] | None = None) -> tuple[Segment, ...]:
    """The shared segments, with rows renumbered by `index` (global row -> plan row)."""
    return segments(self._shared_nodes, self._c, index)

  def _restructure(self, dirty: set[int]) -> None:
    """After insert/fork/remove: new row order, rows' arrays permuted, dirty rows recomputed."""
    rows, shared_nodes = order_rows(self._root)
    seqs = [self._seqs[sid] for sid in rows]
    old = np.array([s.row for s in seqs], np.int64)
    self._row.permute(np.maximum(old, 0))
    for r in np.flatnonzero(old < 0).tolist():  # new sequences
      self._row.lengths[r] = seqs[r].length
      dirty.add(rows[r])
    for r, s in enumerate(seqs):
      s.row = r
    for sid in dirty:
      s = self._seqs.get(sid)
      if s is not None:
        self._row.set_path(s.row, s.path, self._c)
    self._rows = rows
    self._shared_nodes = shared_nodes
    self.structure_version += 1
    self.pages_version += 1
