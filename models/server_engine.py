"""The engine thread of the server: one thread owns an `Engine`; others talk to it through a queue.

Handlers `submit` a `Job` (a prompt and its `SamplingParams`) and `cancel` it;
the thread admits them between iterations, runs `Engine.step()`, and hands each
job what concerns it through the job's `deliver` callable (which must not
block): a list of `TokenEvent`s per iteration, then `JobDone`, or a `JobFailed`.

The thread never dies from one request: a request the engine refuses or fails
(reason 'error'), or a `deliver` that raises (its client's event loop is gone),
ends only that job.
An exception from `Engine.step()` is the engine's, not a request's, and may
have left it inconsistent: the loop then stops, every job in flight and every
later `submit` fails with 503, and `stats` says why (`/v1/health` shows it).

Warm-up: an engine with a fixed shape set (`Engine.warmup_steps`) compiles it one program
at a time while it has no requests (`warmup=True`), what a lone short request runs first; a
request that comes meanwhile waits at most for the program being compiled, is then served
(compiling what it needs on first use), and the warm-up goes on when the engine is idle
again. `stats['warmup']` says how far it got, and `on_warmup` (called from the engine
thread) hears of every step. A warm-up that fails stops (saying why), serving goes on.

Finished requests are dropped from `engine.requests` (the engine keeps every
request it ever saw; a server runs for days), keeping the last `keep_finished`
in `recent` for inspection.
"""

import collections
import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from models.engine import Engine, SamplingParams


@dataclasses.dataclass(frozen=True)
class JobDone:
  """Every sample of the job has finished."""

  shared_tokens: int


class JobFailed(Exception):
  """The job ends with this error (status and field as in `server_api.BadRequest`)."""

  def __init__(self, status: int, field: str, message: str):
    super().__init__(message)
    self.status = status
    self.field = field


class EngineDown(RuntimeError):
  """The engine loop has stopped; nothing more can be submitted."""


@dataclasses.dataclass(eq=False)
class Job:
  """One prompt's request. `deliver` is called from the engine thread."""

  prompt: tuple[int, ...]
  params: SamplingParams
  deliver: Callable[[Any], None]
  first_id: int | None = None  # sample 0's request id, once submitted
  live: set = dataclasses.field(default_factory=set)  # sample ids not finished yet
  shared_tokens: int = 0  # prompt tokens shared with other requests at admission
  client: Any = None  # who asked: the engine's queue takes turns between clients


class EngineLoop:
  """Owns an `Engine` in one thread (see the module doc)."""

  def __init__(self, engine: Engine, *, keep_finished: int = 256, warmup: bool = False,
               on_warmup: Callable[[int, int, float], None] | None = None):
    self.engine = engine
    steps = getattr(engine, 'warmup_steps', None)
    self._warmup = steps() if warmup and steps is not None else None
    self._on_warmup = on_warmup
    self._warm_progress: tuple[int, int] | None = None
    if self._warmup is not None:
      shapes = engine.compiled_shape_budget()
      self._warm_progress = (0, shapes.num_programs + len(shapes.copies))
    self._warm_seconds = 0.0
    self._warm_error: str | None = None
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._jobs: dict[int, Job] = {}  # live sample id -> its job
    self._lock = threading.Lock()  # orders submit against the loop's stop
    self._stopping = False
    self._thread = threading.Thread(target=self._run, name='engine-loop', daemon=True)
    self.error: str | None = None  # why the loop stopped, if it did on its own
    self.recent: collections.deque = collections.deque(maxlen=keep_finished)  # finished Requests
    self.finished_requests = 0
    budget = getattr(engine, 'compiled_shape_budget', None)  # engines with a fixed shape set
    self._budget = budget().num_programs if budget is not None else None
    self.stats: dict[str, Any] = self._stats()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None and not self._stopping

  def start(self) -> 'EngineLoop':
    self._thread.start()
    return self

  def stop(self, timeout: float | None = None) -> None:
    """Stops the thread after its current iteration; jobs in flight fail with 503."""
    with self._lock:
      self._stopping = True
      self._inbox.put(None)
    if self._thread.is_alive():
      self._thread.join(timeout)

  def submit(self, job: Job) -> None:
    """Queues a job; raises EngineDown if the loop has stopped."""
    with self._lock:
      if not self.alive:
        raise EngineDown(self.error or 'the engine loop is not running')
      self._inbox.put(('submit', job, None))

  def cancel(self, job: Job, sample_ids=None) -> None:
    """Cancels the job's samples (all of them by default) at the next iteration boundary."""
    self._inbox.put(('cancel', job, sample_ids))

  # ---- the thread -------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # a bug of the loop itself: say so, never hang the clients
      self._fail(f'the engine loop stopped: {type(e).__name__}: {e}')
      traceback.print_exc()
    else:
      self._fail('the server is shutting down')

  def _loop(self) -> None:
    engine = self.engine
    while True:
      block = not engine.has_work and self._warmup is None
      while True:  # take every message; wait for one only when idle
        try:
          item = self._inbox.get(block=block)
        except queue.Empty:
          break
        block = False
        if item is None:
          return
        self._take(*item)
      if not engine.has_work:
        if self._warmup is not None:
          self._warm_one()
        continue
      try:
        events = engine.step()
      except Exception as e:
        traceback.print_exc()
        self._fail(f'the engine failed: {type(e).__name__}: {e}')
        return
      self._hand_out(events)
      self.stats = self._stats()

  def _take(self, kind: str, job: Job, sample_ids) -> None:
    if kind == 'cancel':
      for rid in job.live if sample_ids is None else set(sample_ids) & job.live:
        self.engine.cancel(rid)
      return
    try:
      first = self.engine.submit(job.prompt, job.params, client=job.client)
    except (ValueError, TypeError, OverflowError) as e:  # a request the engine refuses
      return self._send(job, JobFailed(400, 'prompt', str(e)))
    except Exception as e:  # anything else still ends only this request
      traceback.print_exc()
      return self._send(job, JobFailed(500, 'prompt', f'{type(e).__name__}: {e}'))
    job.first_id = first
    job.live = set(range(first, first + job.params.n))
    for rid in job.live:
      self._jobs[rid] = job

  def _hand_out(self, events) -> None:
    by_job: dict[int, tuple[Job, list]] = {}
    for event in events:
      job = self._jobs.get(event.request_id)
      if job is not None:
        by_job.setdefault(id(job), (job, []))[1].append(event)
    for job, job_events in by_job.values():
      self._send(job, job_events)
      for event in job_events:
        if event.finished:
          request = self._retire(job, event.request_id)
          if event.reason == 'error':  # the engine failed this request alone: a 500 for it
            why = getattr(request, 'error', None) or 'unknown'
            self._send(job, JobFailed(500, 'engine', f'the engine failed this request: {why}'))
      if job.first_id is not None and not job.live:
        self._send(job, JobDone(job.shared_tokens))

  def _retire(self, job: Job, rid: int):
    job.live.discard(rid)
    self._jobs.pop(rid, None)
    request = self.engine.requests.pop(rid, None)
    if request is not None:
      job.shared_tokens = request.shared_tokens
      self.recent.append(request)
    self.finished_requests += 1
    return request

  def _send(self, job: Job, item) -> None:
    try:
      job.deliver(item)
    except Exception:  # its client's side is gone: stop spending the engine on it
      for rid in list(job.live):
        self.engine.cancel(rid)
      job.deliver = _discard

  def _fail(self, message: str) -> None:
    with self._lock:
      self.error = self.error or message
      pending = []
      while True:
        try:
          item = self._inbox.get_nowait()
        except queue.Empty:
          break
        if item is not None and item[0] == 'submit':
          pending.append(item[1])
    jobs = {id(j): j for j in list(self._jobs.values()) + pending}
    self._jobs.clear()
    for job in jobs.values():
      self._send(job, JobFailed(503, 'engine', self.error))
    self.stats = self._stats()

  def _warm_one(self) -> None:
    """Compiles one more program of the warm-up (engine thread, while idle)."""
    start = time.perf_counter()
    try:
      progress = next(self._warmup)
    except StopIteration:
      self._warmup = None
      self.stats = self._stats()
      return
    except Exception as e:  # noqa: BLE001 - requests still compile what they need on first use
      traceback.print_exc()
      self._warmup, self._warm_error = None, f'{type(e).__name__}: {e}'
      self.stats = self._stats()
      return
    self._warm_seconds += time.perf_counter() - start
    self._warm_progress = progress
    self.stats = self._stats()
    if self._on_warmup is not None:
      self._on_warmup(*progress, self._warm_seconds)

  def _stats(self) -> dict[str, Any]:
    engine = self.engine
    return {
        'status': 'ok' if self.error is None else 'error',
        'running': engine.num_running, 'queued': engine.num_queued,
        'kv_bytes_in_use': engine.kv_bytes_in_use(),
        'finished_requests': self.finished_requests,
        'iterations': engine.stats.iterations,
        'distinct_step_shapes': len(engine.stats.shapes),
        **({'step_shape_budget': self._budget} if self._budget is not None else {}),
        **({'warmup': self._warmup_stats()} if self._warm_progress is not None else {}),
        **({'error': self.error} if self.error is not None else {}),
    }

  def _warmup_stats(self) -> dict[str, Any]:
    done, total = self._warm_progress
    return {'programs_compiled': done, 'programs': total, 'done': self._warmup is None,
            'seconds': round(self._warm_seconds, 1),
            **({'error': self._warm_error} if self._warm_error else {})}


def _discard(item) -> None:
  del item
