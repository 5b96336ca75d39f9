"""Past one machine: expert parallelism inside a node, FSDP2 data parallelism across nodes, on one DeviceMesh.

    mesh = megamoe.adapters.fsdp.mesh(ep=8)                  # (dp, ep): ranks 8d .. 8d+7 form an EP group
    world = megamoe.init_world(group=mesh["ep"].get_group())
    model = megamoe.adapters.hf.patch(model, world)          # each EP rank keeps its slice of the experts
    model = megamoe.adapters.fsdp.shard(model, mesh)         # FSDP2 over the rest
    # torchrun --nnodes 2 --nproc-per-node 8 ... train.py    (EP 8 in each node x DP 2 across the nodes)

:func:`shard` applies ``torch.distributed.fsdp.fully_shard``:

- the routed experts (every :class:`~megamoe.adapters.hf.ExpertParallelExperts`) over ``mesh["dp"]``: each EP
  rank's slice sharded across the data-parallel replicas of that rank, gathered for its pass; their gradients —
  megamoe's cover every EP rank's tokens, a sum — reduce-scattered over DP and divided by DP x EP;
- everything else (attention, norms, routers, shared experts and their gates) over the whole (dp, ep) mesh as
  HSDP: sharded inside each EP group, replicated across DP, gradients averaged over every rank.

So each rank's loss is the mean over its own tokens and every gradient is that of the mean over all DP x EP ranks:
the same training as one EP group of DP x EP ranks on the same data (tests/test_fsdp.py checks it within BF16).
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.adapters.hf import ExpertParallelExperts


def mesh(ep: int, dp: int | None = None, device_type: str | None = None):
    """A 2-D ``DeviceMesh`` ``(dp, ep)`` over every rank: EP innermost (consecutive ranks, one node's GPUs).

    ``dp`` defaults to world size / ``ep``; ``device_type`` to ``cuda`` when a GPU is visible, else ``cpu``.
    Collective (it builds the process groups of both dimensions).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or world % ep:
        raise ValueError(f"ep must be a positive int dividing the world size {world}, got {ep!r}")
    dp = world // ep if dp is None else dp
    if dp * ep != world:
        raise ValueError(f"dp x ep must be the world size {world}, got {dp} x {ep}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))


def shard(model: nn.Module, device_mesh, *, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over a patched model on a ``(dp, ep)`` mesh (see the module docstring); returns ``model``.

    Every rank calls it after :func:`megamoe.adapters.hf.patch` over ``mesh["ep"]``'s world. ValueError when
    the mesh is not ``(dp, ep)``, the model holds no megamoe experts, or their world is not the mesh's EP group.
    """
    from torch.distributed.fsdp import fully_shard

    names = getattr(device_mesh, "mesh_dim_names", None)
    if names != ("dp", "ep"):
        raise ValueError(f"shard wants a (dp, ep) DeviceMesh (megamoe.adapters.fsdp.mesh), got dims {names}")
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    if not experts:
        raise ValueError(f"{type(model).__name__} holds no megamoe experts: patch it first "
                         f"(megamoe.adapters.hf.patch over the mesh's EP group)")
    dp, ep = device_mesh.size(0), device_mesh.size(1)
    for m in experts:
        if m.world.size != ep:
            raise ValueError(f"the experts' world has {m.world.size} ranks, the mesh's EP dimension {ep}: patch "
                             f"over init_world(group=mesh['ep'].get_group())")
    for m in experts:
        fully_shard(m, mesh=device_mesh["dp"], reshard_after_forward=reshard_after_forward)
        # megamoe's expert gradients are a sum over the EP ranks' losses: FSDP's sum over DP, then / (DP x EP),
        # is the mean over every rank (a plain sum and a divide: gloo has no pre-multiplied sum)
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(float(dp * ep))
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard_after_forward)
    return model
