"""A continuous-batching serving engine over the Llama and the prefix-aware chunk cache.

Each `step()` is one iteration:

1. Admission (`scheduler`): queued requests, first come first served, while the
   batch has room (`max_batch`, counting every sample), the iteration's
   prefill budget allows, and the chunk pool can hold the prompt plus a
   reservation for every token it may still generate, for each of its samples
   (`ChunkCache.insert` with `num_samples`; cached chunks count as room). A
   request whose prefix is being prefilled in this very iteration waits one
   iteration, so that it shares it instead of computing it again. A request
   that can never fit, or is malformed, is refused at `submit` (ValueError
   naming the argument; nothing changes).
2. Prefill of the admitted requests: only their unshared tokens (the cache
   shares full chunks, live or cached, and copies partial ones), in calls of
   rows with the same padded length; each sample's first token is sampled from
   the prompt's last position. A prompt with n > 1 samples is prefilled once,
   then forked into n sequences (`ChunkCache.fork`: full chunks shared, the
   partial tail copied).
3. Decode: one token for every live sequence in one jitted call, batch padded
   to a bucket; attention over the pool through the cache's `TreeLayout`
   (segment metadata rebuilt only when the tree changes). With
   `overlap_decode`, step k+1 is dispatched before step k's tokens are read,
   so the host's work overlaps the device's.
4. Retirement: finished (stop token or sequence, `max_new_tokens`), cancelled
   or failed requests release their chunks; with `retain_prefixes` their full
   prompt chunks stay cached (a later request with the same prefix does not
   prefill it) until the pool needs the room (LRU eviction).

Compiled shapes: every jitted call runs one of a fixed set of shapes chosen
from the config (`Engine.compiled_shape_budget()`, logged at start); a decode
step in one of three sampling modes (greedy, draw, draw with top-k / top-p:
`SamplingMode`, known on the host, so no step reads a predicate back), a
prefill step in one; `Engine.warmup()` compiles them all, whatever the traffic.

Failures: a request whose admission, prefill, stop check or callback fails
finishes with reason 'error' (`Request.error` says why) and the others go on;
`step()` itself does not raise for a request.

Parallel sampling: `SamplingParams(n=k)` makes k requests of one prompt, with
consecutive ids `rid, rid + 1, ..., rid + k - 1` (`submit` returns rid;
`samples(rid)` lists them). Each has its own output, events, callback calls
and cancellation; they share the prompt's prefill.

Streaming: `step()` returns the `TokenEvent`s of the iteration, a request's
`on_token` callback gets its own, and `stream()` yields them until all work
is done. `cancel(request_id)` takes effect at the next iteration boundary.

Sampling (`models.sampling`): per request temperature, top-k, top-p, min-p,
stop tokens and sequences, log-probs, in one compiled step for mixed requests.
A request's key depends only on (seed, request id, token index), or with a
seed of its own on (its seed, sample index, token index): its tokens do not
depend on which other requests share its batch, and sample i of a prompt
draws what a lone request with id rid + i would.

Parallelism: the model's mesh decides. With tp only, one chunk cache and every step over
the mesh. With dp > 1, one chunk cache per dp shard (`Engine.caches`, each of the config's
size: `num_chunks`, `max_batch` and `max_prefill_tokens` are per shard) over its own part of
the one KV buffer; a prompt is routed at admission (with its samples) to the shard that holds
its longest cached prefix among those with room (then the fewest rows, the most free chunks)
and stays there; each prefill call and decode step stacks every shard's rows, padded to one
bucket, into one program over the mesh. `overlap_decode` is refused with dp. See
hydrajax/PARALLELISM.md.

Parts (an `Engine` holds one of each; none reaches into another's fields): `config`
(EngineConfig, the shape budget), `requests` (Request, TokenEvent, prompt checks),
`scheduler` (the queue and admission order), `book` (the requests, which run on which row,
handing out tokens, finishing), `runner` (the KV buffer and every jitted model call and KV
copy), `prefill`, `decode` (the decode loop, waited or overlapped), `step` (the jitted model
call's body), `stats` (EngineStats), `engine` (the API and the iteration).
"""

from models.engine.config import EngineConfig, ShapeBudget
from models.engine.engine import Engine
from models.engine.requests import Request, TokenEvent, check_prompt
from models.engine.stats import EngineStats
from models.sampling import SamplingParams

__all__ = ['Engine', 'EngineConfig', 'EngineStats', 'Request', 'SamplingParams', 'ShapeBudget',
           'TokenEvent', 'check_prompt']
