"""The prefill layout's attention on the Mosaic GPU kernels, on slices of the buffer.

`plan_prefill` puts every token in order, [prompts | pad to a page of T | completions]
(`write_kv`), so each part of the attention is a static slice or a reshape of its inputs:

* the prompts' own causal attention: one batched causal call, q [Bp, P] against K/V [Bp, P];
* the completions over their shared prompt: one batched segment call, prompt i's K/V against
  the queries of its G completions, [G * T] rows (a reshape of q [Bp * G, T]);
* each completion's causal attention over itself: one batched causal call over [Bp * G, T].

The completions' two states are LSE-merged on XLA. The backward runs the same three calls'
backward kernels from the merged (lse, delta); the prompt's dK/dV sums its causal and its
segment parts, and the buffer's cotangent is their concatenation (which `write_kv`'s
transpose slices back). The completions' causal dQ is written in float32 and the
segment kernel reduce-adds its own onto it (`TrainingKernelConfig.prefill_dq_in_place`; off,
the two are summed on XLA).

The general custom VJP (`tree_attention_vjp`) walks any tree: it gathers each part's queries
and K/V by index (copies), pads a dump row, and scatter-adds dK/dV and dQ back. On an H200
(`experiments/results/train_causal_pairs_s36/`) the time outside the kernels fell from 1.85
to 1.05 ms of a 9 ms forward + backward (G=16, 1K prompt, T=2K), and from 3.75 to 1.14 ms of
65 ms (G=64, 8K prompt, T=1K). Tested against the XLA path (`tests/test_mosaic_gpu_training.py`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hydrajax.partial_state import PartialState, merge_many


def join_buffer(prompts, completions, kv_tokens):
  """prompts [Bp, P, ...] and completions [B, T, ...] -> the buffer [L = kv_tokens, ...] in its
  order: prompts, zeros to a page of T, completions (`PrefillPlan.to_device`'s slots)."""
  rest = prompts.shape[2:]
  prompts, completions = prompts.reshape((-1,) + rest), completions.reshape((-1,) + rest)
  pad = jnp.zeros((kv_tokens - prompts.shape[0] - completions.shape[0],) + rest, prompts.dtype)
  return jnp.concatenate([prompts, pad, completions.astype(prompts.dtype)])


def _split(buffer, bp, p, b, t):
  """`join_buffer`'s inverse: buffer [L, K, H] -> (prompts [Bp, P, K, H], completions
  [B, T, K, H]), static slices."""
  first = -(-bp * p // t) * t  # the completions start at a page of T
  rest = buffer.shape[1:]
  return (buffer[:bp * p].reshape((bp, p) + rest),
          buffer[first:first + b * t].reshape((b, t) + rest))


def _dims(q_prompt, q_completion):
  bp, p = q_prompt.shape[:2]
  b, t, n, h = q_completion.shape
  return bp, p, b, t, n, h, b // bp


def _forward(q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, scale, kernels):
  from pallas_kernels.mosaic_gpu import training_attention as ta  # kernels import hydrajax

  kw = dict(scale=scale, interpret=kernels.interpret, config=kernels.config)
  bp, p, b, t, n, h, g = _dims(q_prompt, q_completion)
  (kp, kc), (vp, vc) = (_split(x, bp, p, b, t) for x in (k_buffer, v_buffer))
  prompt = PartialState(*ta.causal_forward(q_prompt, kp, vp, p, **kw))
  shared_out, shared_lse = ta.segments_forward(q_completion.reshape(bp, g * t, n, h), kp, vp,
                                               prompt_lengths, **kw)
  own = PartialState(*ta.causal_forward(q_completion, kc, vc, t, **kw))
  shared = PartialState(shared_out.reshape(b, t, n, h), shared_lse.reshape(b, t, n))
  return prompt, merge_many([shared, own], out_dtype=q_completion.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def prefill_attention_kernels(q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, scale,
                              kernels):
  """(prompt state [Bp, P, N, H], completion state [Bp * G, T, N, H]) of `attend_prefill`.

  k_buffer, v_buffer: `write_kv`'s [L, K, H]; prompt_lengths [Bp] int32; kernels: the
  resolved `tree_attention_vjp._Kernels` (their interpret mode and config).
  """
  return _forward(q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, scale, kernels)


def _fwd(q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, scale, kernels):
  states = _forward(q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, scale, kernels)
  return states, (q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, states)


def _delta(state, cotangent):
  """rowsum(dO * O) - dlse [.., N] float32, and dO in the output's dtype."""
  d_out, d_lse = cotangent
  delta = jnp.sum(d_out.astype(jnp.float32) * state.out.astype(jnp.float32), axis=-1)
  return delta - d_lse.astype(jnp.float32), d_out.astype(state.out.dtype)


def _bwd(scale, kernels, residuals, cotangents):
  from pallas_kernels.mosaic_gpu import training_attention as ta

  kw = dict(scale=scale, interpret=kernels.interpret, config=kernels.config)
  q_prompt, q_completion, k_buffer, v_buffer, prompt_lengths, states = residuals
  bp, p, b, t, n, h, g = _dims(q_prompt, q_completion)
  (kp, kc), (vp, vc) = (_split(x, bp, p, b, t) for x in (k_buffer, v_buffer))
  (delta_p, do_p), (delta_c, do_c) = (_delta(s, c) for s, c in zip(states, cotangents))
  lse_p, lse_c = states[0].lse, states[1].lse
  dq_p, dkp_own, dvp_own = ta.causal_backward(q_prompt, kp, vp, do_p, lse_p, delta_p, p, **kw)
  rows = lambda x: x.reshape((bp, g * t) + x.shape[2:])
  shared = lambda **dq: ta.segments_backward(
      rows(q_completion), kp, vp, rows(do_c), rows(lse_c), rows(delta_c), prompt_lengths,
      **dq, **kw)
  own = lambda **dq: ta.causal_backward(q_completion, kc, vc, do_c, lse_c, delta_c, t, **dq, **kw)
  if ta.config_or_default(kernels.config, kernels.interpret).prefill_dq_in_place:
    dq_own, dkc, dvc = own(dq_dtype=jnp.float32)  # then the prompt's dQ adds onto it
    dq_c, dkp_shared, dvp_shared = shared(dq_init=rows(dq_own), dq_dtype=q_completion.dtype)
    dq_c = dq_c.reshape(b, t, n, h)
  else:
    dq_shared, dkp_shared, dvp_shared = shared(dq_dtype=jnp.float32)
    dq_own, dkc, dvc = own()
    dq_c = (dq_shared.reshape(b, t, n, h) + dq_own.astype(jnp.float32)).astype(
        q_completion.dtype)

  def buffer(prompt_parts, completions, like):  # the prompts' two parts summed in float32
    prompts = sum(x.astype(jnp.float32) for x in prompt_parts).astype(like.dtype)
    return join_buffer(prompts, completions, like.shape[0])

  dk = buffer((dkp_own, dkp_shared), dkc, k_buffer)
  dv = buffer((dvp_own, dvp_shared), dvc, v_buffer)
  return dq_p, dq_c, dk, dv, np.zeros(prompt_lengths.shape, jax.dtypes.float0)


prefill_attention_kernels.defvjp(_fwd, _bwd)
