"""Data parallel training steps over a mesh's `dp` axis, and sharded training state.

`data_parallel` runs a step's loss and gradients on each dp shard's block of the batch (its own
layout) in one `jax.shard_map`, averaged by one all-reduce; `make_train_step(mesh=)` and
`make_tree_train_step(mesh=)` (`models.training.grpo`) use it. The shard_map takes the
parameters replicated: placed with `shard_over_dp`, their dp slices are gathered as it starts,
and the optimizer updates each slice where it lives, so the optimizer state (and the parameters
between steps) take 1/dp of the memory a replica would (ZeRO-3 at step granularity: the whole
model is gathered for the step). `on_one_mesh` puts a step's state where the step's outputs
will be, so a training loop compiles its step once.
"""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hydrajax.attention.parallel import DP, ShardedLayout
from models.sharding_rules import auto_mesh, named_sharding


def data_parallel(loss_and_grads_fn, mesh: Mesh):
  """`loss_and_grads_fn(params, batch, layout) -> ((loss, metrics), grads)` over the mesh's `dp`
  shards: shard d takes block d of every batch array's first axis and its own layout
  (`PrefillPlan.to_device_sharded`: prompts [Bp / dp, P] and their completions [B / dp, T];
  `TreePrefillPlan.to_device_sharded`: its roots' trees, every level's rows [B_d / dp, C_d]).
  A group never crosses shards, so attention needs no communication. The loss, metrics and
  gradients are averaged over the shards (one all-reduce), which is the whole batch's: every
  shard holds as many samples. Parameters are replicated over dp. A mesh with `tp` too is
  manual over dp only: the model, made on the same mesh (`Llama(..., mesh=)`), splits its
  heads over tp inside (`models.training.forward`)."""
  mesh = auto_mesh(mesh)
  dp = mesh.shape.get(DP, 1)

  def local(params, batch, layouts):
    layout = jax.tree.map(lambda x: x[0], layouts.layouts)
    return jax.lax.pmean(loss_and_grads_fn(params, batch, layout), DP)

  def run(params, batch, layout):
    if not isinstance(layout, ShardedLayout) or layout.num_shards != dp:
      raise ValueError(f'layout must be the batch plan\'s {dp} dp shards '
                       f'(plan.to_device_sharded({dp})), got {type(layout).__name__}')
    for path, x in jax.tree.leaves_with_path(batch):
      if x.shape[0] % dp:
        raise ValueError(f'batch{jax.tree_util.keystr(path)}: its first axis ({x.shape[0]}) '
                         f'must split into dp={dp} equal blocks')
    # check_vma=False: the attention's scans start from constant carries that the shard's
    # varying queries then vary; the outputs are replicated by the pmean.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(DP), P(DP)), out_specs=P(),
                         axis_names={DP}, check_vma=False)(params, batch, layout)

  return run


def shard_over_dp(tree, mesh: Mesh):
  """`tree` (parameters or optimizer state) placed on `mesh` with each array's first axis
  that divides dp and is not already split (its sharding's spec, e.g. tp's from
  `Llama(..., mesh=)`) split over `dp`; arrays with none stay as they are over dp."""
  mesh = auto_mesh(mesh)
  dp = mesh.shape.get(DP, 1)

  def place(x):
    spec = list(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else []
    spec += [None] * (x.ndim - len(spec))
    if dp > 1 and DP not in spec:
      free = [i for i, n in enumerate(x.shape) if spec[i] is None and n % dp == 0]
      if free:
        spec[free[0]] = DP
    return jax.device_put(x, named_sharding(mesh, spec))

  return jax.tree.map(place, tree)


def on_one_mesh(state, mesh: Mesh | None):
  """The training state (parameters, optimizer state) on one mesh, as a step's outputs will be:
  `mesh` (the step's) or else the one some array is on (a model's tp mesh). An array elsewhere
  (a fresh optimizer's step count, parameters not yet placed) is placed there replicated, and
  one placed by hand with trailing Nones in its spec gets the form jit gives its outputs
  (`sharding_rules.named_sharding`). So the step compiles once, not again at its second call.
  A state already so (every step's own outputs) is returned as it is."""
  leaves = jax.tree.leaves(state)
  on_mesh = lambda x: isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
  if mesh is None:
    mesh = next((x.sharding.mesh for x in leaves if on_mesh(x)), None)
    if mesh is None:
      return state
  mesh = auto_mesh(mesh)

  def want(x):
    here = on_mesh(x) and x.sharding.mesh == mesh
    return named_sharding(mesh, x.sharding.spec if here else P())

  def placed(x):
    return on_mesh(x) and x.sharding.mesh == mesh and x.sharding.spec == want(x).spec

  if all(placed(x) for x in leaves):
    return state
  return jax.tree.map(lambda x: x if placed(x) else jax.device_put(x, want(x)), state)
