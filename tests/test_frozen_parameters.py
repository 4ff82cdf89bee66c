"""A parameter with ``requires_grad=False`` (frozen, or a fixed table such as Marian's and
Pegasus's sinusoidal positions) stays as it is when the parallel model trains.

It was made a trainable ``nn.Parameter`` on every rank and planned as needing a gradient: the
optimizer then moved it (Marian's loss differed from one device's after one AdamW step: a silent
wrong answer). Here, on 2 gloo ranks with the solver's own plan: the parallel model's copy needs no
gradient, the loss and every gradient equal one device's, and after 2 AdamW steps every parameter
does, the frozen table unchanged.
"""

import copy

import torch
from parity_utils import Checks, call, check_grads_by_alias, loss_of, run_checked, train_like_one_device

TIMEOUT_S = 120


class FixedPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.positions = torch.nn.Embedding(8, 16)
        self.positions.weight.requires_grad_(False)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, target):
        h = self.proj(x + self.positions.weight)
        return torch.nn.functional.mse_loss(h, target)


def frozen_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    torch.manual_seed(0)
    model = FixedPositions()
    inputs = {"x": torch.randn(4, 8, 16), "target": torch.randn(4, 8, 16)}
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=cfg["mesh"], cluster="h100")
    frozen = [name for name, p in pm.named_parameters() if not p.requires_grad]
    checks.true(f"frozen parameters of the parallel model: {frozen}", frozen == ["positions.weight"])
    loss, ref_loss = loss_of(call(pm, inputs)), loss_of(call(ref, inputs))
    loss.backward()
    ref_loss.backward()
    checks.close("loss", loss.detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    train_like_one_device(pm, ref, inputs, 2, checks)
    checks.close("the frozen table after 2 steps", pm.full_state_dict()["positions.weight"], model_start())
    return {"failures": checks.failures}


def model_start():
    torch.manual_seed(0)
    return FixedPositions().positions.weight.detach()


def test_a_frozen_parameter_is_not_trained():
    run_checked(frozen_worker, {"mesh": (2,)}, TIMEOUT_S)
