"""A weight tied under two names and read through its second name alone.

Tied weights are one tensor under several placeholder names, and the planner decides once for
all of them (the first name's decision). MobileBERT reads its decoder weight (tied to the word
embeddings) only through a transpose, ``decoder.weight.t()``: an op whose one data input is the
tied name follows that decision, and the planner looked the second name up among the first's
options (``KeyError`` while planning). Here, on 2 gloo ranks under the memory objective (the
table stored cut): the plan places both names alike, and the loss, every gradient, the counted
communication against the estimate and the parameters after 2 AdamW steps equal one device's.
"""

import copy

import torch
from parity_utils import Checks, check_step_like_one_device, run_checked, train_like_one_device

TIMEOUT_S = 120


class TiedTransposedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.decoder = torch.nn.Linear(8, 32)
        self.decoder.weight = self.embed.weight  # tied, as MobileBERT's decoder is to its embeddings

    def forward(self, ids, labels):
        h = torch.tanh(self.mix(self.embed(ids)))
        logits = h.matmul(self.decoder.weight.t()) + self.decoder.bias
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tied_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    torch.manual_seed(0)
    model = TiedTransposedHead()
    inputs = {"ids": torch.randint(0, 32, (4, 8)), "labels": torch.randint(0, 32, (4, 8))}
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=tuple(cfg["mesh"]), cluster="h100", objective="memory")
    placed = {n: pm.placement_of(n) for n in ("embed.weight", "decoder.weight")}
    checks.true(f"the tied names are placed alike: {placed}", len(set(placed.values())) == 1)
    check_step_like_one_device(pm, ref, inputs, checks, "tied, read transposed")
    train_like_one_device(pm, ref, inputs, 2, checks, "tied, read transposed")
    return {"rank": rank, "failures": checks.failures}


def test_a_tied_weight_read_through_its_other_name_alone():
    run_checked(tied_worker, {"mesh": [2]}, TIMEOUT_S)
