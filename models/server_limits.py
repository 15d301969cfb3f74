"""Who may use the server and how often: API keys, per-client rate limits, exposure warnings.

Framework-free and small, so each rule is tested on its own:

* `ApiKeys` checks an `Authorization: Bearer <key>` header against the configured keys in
  constant time (`hmac.compare_digest`, over every key: the time says nothing of which
  key, or how much of one, matched).
* `RateLimiter` is a token bucket per client (a client is its address): `rate` requests a
  second on average, bursts of `burst`. It forgets clients whose bucket is full again, so
  its memory is bounded by the clients active in the last `burst / rate` seconds.
* `exposure_warning` says when an address reaches beyond this machine and no key guards it.
"""

import hmac
import ipaddress
import time
from collections.abc import Callable, Sequence

API_KEY_ENV = 'HYDRAJAX_API_KEY'  # the key (or comma-separated keys) when --api_key is not given
_MAX_CLIENTS_TRACKED = 100_000


class ApiKeys:
  """The accepted bearer keys (none: every request is accepted)."""

  def __init__(self, keys: Sequence[str]):
    keys = tuple(keys)
    for key in keys:
      if not isinstance(key, str) or not key or key.strip() != key or not key.isprintable():
        raise ValueError('API keys must be non-empty printable strings without surrounding '
                         'spaces')
    self._keys = tuple(k.encode() for k in keys)

  @property
  def required(self) -> bool:
    return bool(self._keys)

  def allows(self, authorization: str | None) -> bool:
    """Whether an `Authorization` header value carries one of the keys."""
    if not self._keys:
      return True
    scheme, _, given = (authorization or '').partition(' ')
    given_bytes = given.strip().encode('utf-8', 'replace')
    matched = False
    for key in self._keys:  # every key is compared: no early exit
      matched |= hmac.compare_digest(given_bytes, key)
    return scheme.lower() == 'bearer' and matched


class RateLimiter:
  """A token bucket per client: `rate` requests a second, bursts of `burst` (rate 0: off)."""

  def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
    if not rate >= 0 or not burst >= 1:
      raise ValueError(f'rate must be >= 0 and burst >= 1, got rate={rate}, burst={burst}')
    self.rate, self.burst, self.clock = float(rate), int(burst), clock
    self._buckets: dict[object, tuple[float, float]] = {}  # client -> (tokens, at)

  def wait(self, client) -> float:
    """0.0 if `client` may send a request now (it is counted), else seconds until it may."""
    if not self.rate:
      return 0.0
    now = self.clock()
    tokens, at = self._buckets.get(client, (float(self.burst), now))
    tokens = min(float(self.burst), tokens + (now - at) * self.rate)
    if tokens < 1.0:
      self._buckets[client] = (tokens, now)
      return (1.0 - tokens) / self.rate
    self._buckets[client] = (tokens - 1.0, now)
    if len(self._buckets) > _MAX_CLIENTS_TRACKED:
      self._forget_idle(now)
    return 0.0

  def _forget_idle(self, now: float) -> None:
    full = [c for c, (tokens, at) in self._buckets.items()
            if tokens + (now - at) * self.rate >= self.burst]
    for client in full:
      del self._buckets[client]


def is_loopback(host: str) -> bool:
  if host == 'localhost':
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:  # a name: it may resolve anywhere
    return False


def exposure_warning(host: str, keys: ApiKeys) -> str | None:
  """A warning when `host` reaches beyond this machine and no API key is required."""
  if keys.required or is_loopback(host):
    return None
  return (f'WARNING: serving on {host} without an API key: anyone who can reach this address '
          f'can use the model. Pass --api_key (or set {API_KEY_ENV}) to require '
          f'"Authorization: Bearer <key>".')
