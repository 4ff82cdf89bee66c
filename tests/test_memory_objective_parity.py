"""Plans of ``objective="memory"`` (the smallest footprint, whatever it sends): their exotic
per-axis placements, trained on 4 gloo ranks against one device.

The memory objective places activations like ``[P, S(1)]`` and ``[S(1), S(0)]`` on a (2, 2)
mesh (Mistral's grouped-query attention, whose head dim has 2 elements). A gradient moved from
``[S(1), S(0)]`` to ``[R, S(1)]`` once went through ``[S(1), S(1)]``, a dim of 2 cut 4 ways, and
failed in backward. Here:

* every move between two placements that fit a tensor passes only through placements that fit
  it (all pairs on small meshes, no process group);
* that edge alone, forward and backward, on 4 ranks against slices of the whole tensors;
* Mistral planned with ``objective="memory"`` on (2, 2): loss and every gradient equal the
  single-device model's, and the communication counted at run time equals the plan's estimate.
"""

import copy
import itertools

import pytest
import torch
from parity_utils import Checks, call, check_grads_by_alias, loss_of, nested_approx_equal, prebuilt, run_checked

from partitioner import hf_families
from passes.placements import P, R, Shard, format_spec, spec_fits, transition_steps

TIMEOUT_S = 240


@pytest.mark.parametrize("shape, mesh", [((4, 2), (2, 2)), ((2, 4), (4, 2)), ((4, 2, 3), (2, 2, 2))])
def test_moves_pass_only_through_placements_that_fit(shape, mesh):
    places = [R, P] + [Shard(d) for d in range(len(shape))]
    specs = [s for s in itertools.product(places, repeat=len(mesh)) if spec_fits(shape, s, mesh)]
    unfit = []
    for src, dst in itertools.product(specs, repeat=2):
        cur = list(src)
        for axis, p, q in transition_steps(src, dst):
            assert cur[axis] == p, (src, dst, axis, p)
            cur[axis] = q
            if not spec_fits(shape, cur, mesh):
                unfit.append(f"{format_spec(src)} -> {format_spec(dst)} via {format_spec(cur)}")
        assert tuple(cur) == dst, (src, dst, cur)
    assert not unfit, unfit[:5]


def _piece(whole, spec, comm):
    from runtime.parallel_module import shard_runs

    runs = shard_runs(whole.shape, spec, comm)
    return whole[tuple(slice(*r[0]) for r in runs)]


def _edge_checks(comm, checks):
    """``[P, S(1)] -> [S(1), S(0)]``, gradient ``[S(1), S(0)] -> [R, S(1)]``, of a (4, 2, 3) tensor."""
    from runtime.reshard import Reshard

    torch.manual_seed(0)
    whole, whole_grad = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    src, dst = (P, Shard(1)), (Shard(1), Shard(0))
    piece = _piece(whole, src, comm)
    x = (piece if comm.coords[0] == 0 else torch.zeros_like(piece)).requires_grad_()
    edge = Reshard(comm, src, dst, grad=dst)
    out = edge(x)
    checks.close("edge forward", out, _piece(whole, dst, comm))
    out.backward(_piece(whole_grad, dst, comm))
    checks.close("edge backward", x.grad, _piece(whole_grad, (R, Shard(1)), comm))


def memory_objective_worker(rank, world, cfg):
    import partitioner
    from partitioner.parallelize import _device_mesh
    from runtime.collectives import CommCounter, MeshComm

    checks = Checks(rank)
    _edge_checks(MeshComm(_device_mesh(cfg["mesh"], ("a0", "a1"), "cpu")), checks)

    model, inputs = prebuilt(cfg["family"]) or hf_families.build(cfg["family"])
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(
        model, inputs, mesh=cfg["mesh"], cluster="h100", recompute="none", zero=2, objective="memory"
    )
    with CommCounter() as counter:
        out = call(pm, inputs)
        loss_of(out).backward()
    ref_out = call(ref, inputs)
    loss_of(ref_out).backward()
    checks.close("loss", loss_of(out).detach(), loss_of(ref_out).detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"communication: {diff}", False)
    return {"failures": checks.failures}


def test_mistral_memory_objective_parity_on_2x2():
    cfg = {"family": "mistral", "mesh": (2, 2)}
    run_checked(memory_objective_worker, cfg, TIMEOUT_S, prebuild=("mistral", lambda: hf_families.build("mistral")))
