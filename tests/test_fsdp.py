"""megamoe.adapters.fsdp: EP inside a (dp, ep) DeviceMesh, FSDP2 over the rest, on 4 CPU ranks over gloo. A 2 x 2
mesh (EP 2 x DP 2) trains as one EP 4 group on the same data: the same losses and gradients within BF16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe.bench.accuracy import error_stats
from megamoe.parallel.world import init_world, launch

pytest.importorskip("transformers")
from raised import raised  # noqa: E402
from test_hf import _batch, _build  # tests/test_hf.py: the tiny models and their batches  # noqa: E402

#: BF16 experts on both sides; what differs is the order of the reductions (FSDP's against the all-reduce here).
GRAD_TOLERANCE = 1e-2
LOSS_TOLERANCE = 1e-3


def _expert_key(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _full(t: torch.Tensor, ep_group=None) -> torch.Tensor:
    """A gradient as one whole tensor: a DTensor's full_tensor, a routed expert slice gathered over ``ep_group``."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if ep_group is not None:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        t = torch.cat(parts)
    return t.detach().clone()


def _ep4(world, name: str):
    """One EP group of every rank: each rank's loss is the mean over its tokens; replicated gradients averaged
    over the ranks by hand, the experts' (a sum over the ranks' losses) divided by the ranks."""
    from megamoe.adapters.hf import patch

    model = patch(_build(name, seed=3), world)
    loss = model(input_ids=_batch(world, seed=5), labels=_batch(world, seed=5)).loss
    loss.backward()
    grads = {}
    for pname, p in model.named_parameters():
        g = p.grad
        if _expert_key(pname):
            grads[pname] = _full(g / world.size, ep_group=world.group)
        else:
            dist.all_reduce(g, group=world.group)
            grads[pname] = g / world.size
    losses = [torch.empty(()) for _ in range(world.size)]
    dist.all_gather(losses, loss.detach(), group=world.group)
    return torch.stack(losses), grads


def _mesh(world4, name: str):
    """The same ranks as a (dp 2, ep 2) mesh: EP over each pair, FSDP2 over the rest."""
    from megamoe.adapters.fsdp import mesh, shard
    from megamoe.adapters.hf import patch

    device_mesh = mesh(ep=2)
    world = init_world("cpu", group=device_mesh["ep"].get_group())
    model = shard(patch(_build(name, seed=3), world), device_mesh)
    ids = _batch(world4, seed=5)  # the same tokens as _ep4 gave this (global) rank
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {pname: _full(p.grad, ep_group=world.group if _expert_key(pname) else None)
             for pname, p in model.named_parameters()}
    losses = [torch.empty(()) for _ in range(world4.size)]
    dist.all_gather(losses, loss.detach(), group=world4.group)
    return torch.stack(losses), grads, (world.rank, world.size)


def _both(world, name: str):
    return _ep4(world, name), _mesh(world, name)


def test_ep2_by_dp2_mesh_trains_as_one_ep4_group():
    results = launch(_both, 4, "qwen3-moe")
    for rank, ((want_losses, want), (losses, got, (ep_rank, ep_size))) in enumerate(results):
        assert (ep_rank, ep_size) == (rank % 2, 2), (rank, ep_rank, ep_size)
        assert torch.allclose(losses, want_losses, rtol=LOSS_TOLERANCE), (rank, losses, want_losses)
        assert set(got) == set(want)
        for pname, w in want.items():
            assert got[pname].shape == w.shape, (pname, got[pname].shape, w.shape)
            rel = error_stats(got[pname], w)["rel"]
            assert rel < GRAD_TOLERANCE, (rank, pname, rel)


def _refusals(world):
    from megamoe.adapters.fsdp import mesh, shard

    return raised([lambda: mesh(ep=3), lambda: shard(torch.nn.Linear(4, 4), mesh(ep=2))])


def test_mesh_and_shard_refuse_what_they_cannot_run():
    for no_split, unpatched in launch(_refusals, 2):
        assert no_split is not None and "dividing the world size 2" in no_split, no_split
        assert unpatched is not None and "patch it first" in unpatched, unpatched
