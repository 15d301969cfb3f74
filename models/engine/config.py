"""The engine's configuration, and the compiled shapes it implies."""

import dataclasses

import jax.numpy as jnp

from hydrajax import AttentionImpl, SharingPolicy
from hydrajax.chunk_cache import ChunkCacheConfig
from hydrajax.layout import LayoutPolicy, next_power_of_two
from hydrajax.layout import as_int
from models.sampling import MAX_TOP_LOGPROBS, SamplingMode


@dataclasses.dataclass(frozen=True)
class ShapeBudget:
  """Every shape the engine's jitted calls run, fixed by its config (see `EngineConfig`).

  Attributes:
    decode: (rows B, segment slots J) of each decode step (J = 0: no segment group); with
      data parallelism B and J are each shard's (the step stacks dp shards of B rows).
    prefill: (tokens T, rows B, segment slots J) of each prefill call (B, J: per dp shard).
    copies: padded sizes of KV copies (copy on write).
  """

  decode: tuple[tuple[int, int], ...]
  prefill: tuple[tuple[int, int, int], ...]
  copies: tuple[int, ...]

  @property
  def num_steps(self) -> int:
    """Distinct model-step shapes (decode and prefill)."""
    return len(self.decode) + len(self.prefill)

  @property
  def num_programs(self) -> int:
    """Compiled model steps: decode shapes in each sampling mode, prefill shapes in one
    (`step_sampling_mode`)."""
    return len(self.decode) * len(SamplingMode) + len(self.prefill)

  def __str__(self) -> str:
    rows = sorted({b for b, _ in self.decode})
    lengths = sorted({t for t, _, _ in self.prefill})
    return (f'{self.num_steps} model-step shapes ({len(self.decode)} decode over rows {rows}, '
            f'{len(self.prefill)} prefill over lengths {lengths}; {self.num_programs} programs '
            f'with the decode steps\' sampling modes), {len(self.copies)} copy sizes')


def step_sampling_mode(kind: tuple, mode: SamplingMode) -> SamplingMode:
  """The sampling mode a model step of `kind` ('decode', ...) / ('prefill', ...) compiles for a
  batch of `mode`. Decode steps, the hot path, take the batch's own mode. Prefill steps draw a
  few first tokens, always in FILTER mode (the sort costs little there, and FILTER draws what
  GREEDY and DRAW draw, row by row): one program per prefill shape instead of three."""
  return mode if kind[:1] == ('decode',) else SamplingMode.FILTER


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and policies of an engine.

  `EngineConfig(num_chunks=256)` is a whole config: every other field has an engine default.
  The KV cache's part (`num_chunks` to `layout`) makes its `ChunkCacheConfig` (`cache`).

  Compiled shapes are bounded (`shape_budget`): decode batches are padded to a bucket,
  prefill lengths to a power of two (at least `min_prefill_len`) and prefill rows to a
  power of two, every layout is built with `fixed_shapes` and a page table of the
  cache's `max_pages` columns, and segment slots J are powers of two from the layout's
  `min_segments` to what the pool can hold.

  With a data parallel model (mesh dp > 1) the pool, `max_batch` and `max_prefill_tokens`
  are per dp shard (one chunk cache each; see `Engine`).

  Attributes:
    num_chunks: chunks in the KV pool (L = num_chunks * chunk_size tokens per layer).
    chunk_size: C, tokens per chunk.
    max_batch: most live sequences (the cache's `max_sequences`).
    max_sequence_length: longest sequence (prompt + generated).
    share_prefixes: False stores every sequence on its own (the no-sharing baseline).
    retain_prefixes: keep finished requests' full prompt chunks as an LRU prefix cache (only
      with share_prefixes: without it, off).
    layout: static-shape policy of the decode layouts.
    max_prefill_tokens: padded prefill tokens per iteration (one request may exceed it alone).
    max_prefill_rows: most requests in one prefill call.
    decode_buckets: padded decode batch sizes (ascending; the last must be >= max_batch);
      empty: powers of two up to max_batch.
    min_prefill_len: smallest padded prefill length (lengths are padded to powers of two).
    prefill_layout: policy of prefill layouts (default: the decode layout's kv_piece and
      min_segments).
    impl: attention implementation of decode steps.
    prefill_impl: attention implementation of prefill calls.
    cache_dtype: KV dtype (default: the model's).
    seed: sampling seed of requests without their own.
    overlap_decode: dispatch decode step k+1 before waiting for step k, so that the host's work
      (tree, layout, dispatch, handing out tokens) overlaps the device's. Step k+1 takes its
      input tokens from step k's output on the device; the tree records them when they are
      back. Outputs are the same. A request that stops runs one step more (its extra token
      is dropped), and finishes one iteration later. A step then takes its device time
      instead of device plus host time. Not with data parallelism.
    command_buffers: whether XLA may run the jitted model step as CUDA graphs (GPU only;
      False launches its kernels one by one, e.g. to profile them).
    max_top_logprobs: the most `top_logprobs` a request may ask for (a static size of
      every step).
    sharing_policy: which shared segments decode steps read per row instead of batched
      (`SharingPolicy`, applied once per tree change as `generate` does). Default:
      `SharingPolicy.default()`, the break-even thresholds measured on this GPU (a segment too
      short or shared by too few rows for batching to win is read per row); None or
      `SharingPolicy.never()`: every segment stays shared.
    interpret: run `impl`/`prefill_impl`'s Mosaic kernels in interpret mode (e.g. 'mosaic_tpu'
      or 'mosaic_gpu' on a CPU), as `hj.tree_attention(..., interpret=True)` does.
  """

  num_chunks: int
  chunk_size: int = 64
  max_batch: int = 64
  max_sequence_length: int = 4096
  share_prefixes: bool = True
  retain_prefixes: bool = True
  layout: LayoutPolicy = LayoutPolicy()
  max_prefill_tokens: int = 8192
  max_prefill_rows: int = 8
  decode_buckets: tuple[int, ...] = ()
  min_prefill_len: int = 16
  prefill_layout: LayoutPolicy | None = None
  impl: AttentionImpl | str = AttentionImpl.AUTO
  prefill_impl: AttentionImpl | str = AttentionImpl.AUTO
  cache_dtype: str | None = None
  seed: int = 0
  overlap_decode: bool = False
  command_buffers: bool = True
  max_top_logprobs: int = 5
  sharing_policy: SharingPolicy | None = dataclasses.field(default_factory=SharingPolicy.default)
  interpret: bool = False

  def __post_init__(self):
    for name in ('num_chunks', 'chunk_size', 'max_batch', 'max_sequence_length'):
      object.__setattr__(self, name, as_int(getattr(self, name), f'EngineConfig.{name}'))
    _ = self.cache  # the cache's own checks (sizes >= 1), before any engine is made
    self._check()

  def _check(self) -> None:
    for name in ('max_prefill_tokens', 'max_prefill_rows', 'min_prefill_len'):
      value = as_int(getattr(self, name), f'EngineConfig.{name}')
      if value < 1:
        raise ValueError(f'EngineConfig.{name} must be an integer >= 1, got {value!r}')
      object.__setattr__(self, name, value)
    if not 0 <= as_int(self.seed, 'EngineConfig.seed') < 2**32:
      raise ValueError(f'EngineConfig.seed must be an integer in [0, 2**32), got {self.seed!r}')
    if not 0 <= as_int(self.max_top_logprobs, 'EngineConfig.max_top_logprobs') <= MAX_TOP_LOGPROBS:
      raise ValueError(f'EngineConfig.max_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], '
                       f'got {self.max_top_logprobs!r}')
    object.__setattr__(self, 'seed', int(self.seed))
    object.__setattr__(self, 'max_top_logprobs', int(self.max_top_logprobs))
    buckets = self.decode_buckets
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, '__iter__'):
      raise ValueError(f'EngineConfig.decode_buckets must be a sequence of integers, got '
                       f'{buckets!r}')
    object.__setattr__(self, 'decode_buckets', tuple(
        as_int(b, f'EngineConfig.decode_buckets[{i}]') for i, b in enumerate(buckets)))
    for name in ('impl', 'prefill_impl'):
      try:
        AttentionImpl(getattr(self, name))
      except ValueError as e:
        raise ValueError(f'EngineConfig.{name}: {e}') from None
    if self.cache_dtype is not None:
      try:
        floating = jnp.issubdtype(jnp.dtype(self.cache_dtype), jnp.floating)
      except TypeError:
        floating = False
      if not floating:
        raise ValueError(f'EngineConfig.cache_dtype must be None (the model\'s) or a floating '
                         f'dtype such as "bfloat16", got {self.cache_dtype!r}')
    if not isinstance(self.command_buffers, bool):
      raise ValueError(f'EngineConfig.command_buffers must be a bool, got '
                       f'{self.command_buffers!r}')
    if not isinstance(self.interpret, bool):
      raise ValueError(f'EngineConfig.interpret must be a bool, got {self.interpret!r}')
    if self.sharing_policy is not None and not isinstance(self.sharing_policy, SharingPolicy):
      raise ValueError(f'EngineConfig.sharing_policy must be a SharingPolicy or None, got '
                       f'{self.sharing_policy!r}')
    buckets = self.decode_buckets
    if buckets and (list(buckets) != sorted(buckets) or buckets[-1] < self.max_batch
                    or buckets[0] < 1):
      raise ValueError(
          f'decode_buckets must ascend from >= 1 and end >= max_batch={self.max_batch}, '
          f'got {buckets}'
      )

  @property
  def cache(self) -> ChunkCacheConfig:
    """The KV cache's config (its `max_sequences` is `max_batch`)."""
    return ChunkCacheConfig(
        num_chunks=self.num_chunks, chunk_size=self.chunk_size,
        max_sequence_length=self.max_sequence_length, max_sequences=self.max_batch,
        share_prefixes=self.share_prefixes,
        retain_prefixes=bool(self.retain_prefixes and self.share_prefixes), layout=self.layout)

  # ---- shapes -----------------------------------------------------------------------------

  def decode_rows(self, b: int) -> int:
    """The padded batch of a decode step with b live sequences."""
    for bucket in self.decode_buckets:
      if bucket >= b:
        return bucket
    return next_power_of_two(max(b, 1))

  def prefill_len(self, n: int) -> int:
    """The padded length of a prefill of n new tokens."""
    return max(next_power_of_two(n), self.min_prefill_len)

  def prefill_rows_per_call(self, t: int) -> int:
    """Most requests in one prefill call of padded length t."""
    return max(1, min(self.max_prefill_rows, self.max_prefill_tokens // t))

  def prefill_sample_rows(self) -> int:
    """Rows sampled by every prefill call (a prompt's samples each draw): fixed, one shape."""
    return next_power_of_two(self.max_batch)

  def decode_policy(self) -> LayoutPolicy:
    """The decode layouts' policy: the cache's, with fixed shapes and a full page table."""
    return dataclasses.replace(self.layout, fixed_shapes=True,
                               min_private_pages=self.cache.max_pages)

  def prefill_policy(self) -> LayoutPolicy:
    base = self.prefill_layout or LayoutPolicy(
        kv_piece=self.layout.kv_piece, min_kv_capacity=self.layout.min_kv_capacity,
        min_segments=self.layout.min_segments)
    return dataclasses.replace(base, fixed_shapes=True, min_private_pages=self.cache.max_pages)

  def _segment_slots(self, policy: LayoutPolicy, pieces: int) -> tuple[int, ...]:
    """The J values of layouts with at most `pieces` pieces (0: no group without sharing)."""
    if not self.share_prefixes:
      return (0,)
    low = next_power_of_two(policy.min_segments)
    high = max(low, next_power_of_two(pieces))
    out, j = [], low
    while j <= high:
      out.append(j)
      j *= 2
    return tuple(out)

  def shape_budget(self, num_shards: int = 1) -> ShapeBudget:
    """Every (padded) shape of the engine's jitted calls, whatever the traffic.

    With `num_shards` = dp > 1 (a model mesh with data parallelism) the sizes are per
    shard: a decode step (B, J) runs dp x B rows, each shard's layout padded to the step's
    J (the largest of the shards'), a prefill call (T, B, J) likewise; the model-step shapes
    are the same set as one device's. KV copies gather every shard's, so their sizes go up
    to dp times one shard's.

    Segment slots J hold pieces of at most kv_piece tokens of shared segments; a segment
    is whole chunks, so a chunk holds at most ceil(C / kv_piece) pieces. A prefill of B
    rows has at most B * max_pages chunks on its rows' paths. A decode step of B rows has
    at most B - 1 segments (distinct sharer sets of >= 2 rows) holding at most
    B * max_sequence_length / 2 tokens (each is on >= 2 rows' paths), each segment
    splitting into at most 1 + its tokens / kv_piece pieces.
    """
    c = self.cache
    decode = []
    for b in sorted({self.decode_rows(k) for k in range(1, self.max_batch + 1)}):
      policy = self.decode_policy()
      per_chunk = -(-c.chunk_size // policy.kv_piece)
      tokens = min(c.kv_tokens, b * self.max_sequence_length // 2)
      pieces = min(b - 1 + tokens // policy.kv_piece, c.num_chunks * per_chunk) if b > 1 else 0
      decode += [(b, j) for j in self._segment_slots(policy, pieces)]
    prefill = []
    longest = min(self.max_sequence_length - 1, c.kv_tokens)  # a prompt leaves room for 1 token
    lengths = sorted({self.prefill_len(1 << i) for i in range(longest.bit_length() + 1)
                      if (1 << i) < 2 * longest})
    for t in lengths:
      rows = sorted({next_power_of_two(k) for k in range(1, self.prefill_rows_per_call(t) + 1)})
      for b in rows:
        policy = self.prefill_policy()
        pieces = min(b * c.max_pages, c.num_chunks) * -(-c.chunk_size // policy.kv_piece)
        prefill += [(t, b, j) for j in self._segment_slots(policy, pieces)]
    largest = next_power_of_two(max(64, 2 * num_shards * self.max_batch * self.chunk_size))
    copies = tuple(1 << i for i in range(6, largest.bit_length()))
    return ShapeBudget(tuple(decode), tuple(prefill), copies)
