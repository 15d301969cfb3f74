"""The (out, lse) state of a finished softmax, shared by the kernels' references and epilogues.

The library has the same rule in `hydrajax.partial_state.normalized`; the kernel modules keep
their own copy because importing any `hydrajax` module imports the kernels' registry, which a
kernel module imported first must not wait on.
"""

import jax
import jax.numpy as jnp


def normalized(o: jax.Array, l: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The state (o / l, m + log l) of keys with softmax sums `o` [..., H] and `l` [...] taken
  relative to `m`: (0, -inf) where no key was seen (l == 0), NaN where l is NaN (a NaN score or
  value among the keys seen, as plain softmax gives)."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  return o / l_safe[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
