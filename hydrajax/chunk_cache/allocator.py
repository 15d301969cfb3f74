"""The free list of a chunk pool, with reservations and contiguous-run allocation.

Chunk i of the pool holds tokens `[i * C, (i + 1) * C)` of the flat KV buffer.
Chunks are allocated once on the device; this host object only says which are
in use. A *reservation* sets chunks aside for a sequence's future appends, so
that admitting a request never takes the room a live sequence will need:
`available` = free chunks that nobody has reserved.
"""

import numpy as np


class CapacityError(RuntimeError):
  """The pool has too few free (unreserved) chunks for the operation; nothing was changed."""


class ChunkAllocator:
  """Which chunks of a pool of `num_chunks` are free, and how many are reserved."""

  def __init__(self, num_chunks: int):
    if num_chunks < 1:
      raise ValueError(f'num_chunks must be >= 1, got {num_chunks}')
    self.num_chunks = num_chunks
    self._free = np.ones(num_chunks, bool)
    self.num_free = num_chunks
    self.reserved = 0

  @property
  def available(self) -> int:
    """Free chunks not set aside by a reservation."""
    return self.num_free - self.reserved

  @property
  def num_used(self) -> int:
    return self.num_chunks - self.num_free

  def is_free(self, chunk: int) -> bool:
    return bool(self._free[chunk])

  def used(self) -> np.ndarray:
    """Ids of the chunks in use."""
    return np.flatnonzero(~self._free)

  def reserve(self, count: int) -> None:
    if count < 0 or count > self.available:
      raise CapacityError(f'cannot reserve {count} chunks: {self.available} available')
    self.reserved += count

  def unreserve(self, count: int) -> None:
    if not 0 <= count <= self.reserved:
      raise ValueError(f'cannot unreserve {count} of {self.reserved} reserved chunks')
    self.reserved -= count

  def allocate(self, count: int, *, reserved: int = 0, after: int = -1) -> np.ndarray:
    """Takes `count` chunks, `reserved` of them from reservations.

    Prefers one contiguous run (so that a prompt's chunks can later form one
    segment): the chunk right after `after` when count is 1 and it is free,
    else the first run of `count` free chunks, else the lowest free chunks.

    Returns the chunk ids [count] int32, in order.
    """
    if not 0 <= reserved <= min(count, self.reserved):
      raise ValueError(f'reserved={reserved} must be in [0, min(count={count}, {self.reserved})]')
    if count - reserved > self.available:
      raise CapacityError(
          f'need {count - reserved} unreserved chunks, only {self.available} available '
          f'({self.num_free} free, {self.reserved} reserved)'
      )
    if count == 0:
      return np.zeros(0, np.int32)
    if count == 1 and 0 <= after + 1 < self.num_chunks and self._free[after + 1]:
      chunks = np.array([after + 1])
    else:
      chunks = self._first_run(count)
      if chunks is None:
        chunks = np.flatnonzero(self._free)[:count]
    self._free[chunks] = False
    self.num_free -= count
    self.reserved -= reserved
    return chunks.astype(np.int32)

  def _first_run(self, count: int) -> np.ndarray | None:
    if count == 1:
      first = int(np.argmax(self._free))
      return np.array([first]) if self._free[first] else None
    csum = np.concatenate([[0], np.cumsum(self._free, dtype=np.int64)])
    window = csum[count:] - csum[:-count]  # free chunks in [i, i + count)
    hits = np.flatnonzero(window == count)
    if hits.size == 0:
      return None
    return np.arange(hits[0], hits[0] + count)

  def release(self, chunks) -> None:
    chunks = np.asarray(chunks, np.int64).reshape(-1)
    if chunks.size and (self._free[chunks].any() or len(set(chunks.tolist())) != chunks.size):
      raise ValueError(f'releasing chunks that are not in use: {chunks.tolist()}')
    self._free[chunks] = True
    self.num_free += chunks.size
