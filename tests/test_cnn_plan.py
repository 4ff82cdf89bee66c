"""Planning a small CNN: conv2d + batch_norm (training mode) + relu + max_pool2d + linear head
+ cross_entropy, on a 2-device mesh."""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from support import fallback_warnings

import partitioner

# What export produces for this model (batch_norm stays aten.batch_norm in training mode).
CNN_OPS = {"aten.conv2d", "aten.batch_norm", "aten.relu", "aten.max_pool2d", "aten.flatten.using_ints",
           "aten.linear", "aten.cross_entropy_loss"}
_FALLBACK_RE = re.compile(r"no sharding rule for op (\S+) ")


class SmallCNN(nn.Module):
    def __init__(self, channels=16, image=32, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels * (image // 4) ** 2, classes)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        return F.cross_entropy(self.head(h.flatten(1)), y)


def _inputs(batch, image=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, image, image, generator=g), torch.randint(0, 10, (batch,), generator=g)



def test_cnn_plans_without_fallback_for_its_layers():
    torch.manual_seed(0)
    model = SmallCNN(channels=8, image=8)
    with fallback_warnings() as caught:
        plan = partitioner.plan(model, _inputs(8, image=8), mesh_shape=(2,), cluster="h100")
    targets = {r["target"] for r in plan.records if r["kind"] == "op"}
    assert CNN_OPS <= targets, f"export changed: missing {CNN_OPS - targets}"
    fell_back = {m.group(1) for w in caught if (m := _FALLBACK_RE.search(str(w.message)))}
    assert not fell_back & CNN_OPS, f"fell back to replicate: {sorted(fell_back & CNN_OPS)}"
    for r in plan.records:
        if r["kind"] == "op":
            assert len(r["out"]) == len(r["shapes"]) and all(s.startswith("[") for s in r["out"]), r


def test_cnn_large_batch_is_data_parallel_with_sync_batch_norm():
    model = SmallCNN().to("meta")
    plan = partitioner.plan(model, _inputs(1024), mesh_shape=(2,), cluster="h100")
    layers = [r for r in plan.records
              if r["target"] in ("aten.conv2d", "aten.batch_norm", "aten.relu", "aten.max_pool2d")]
    assert len(layers) == 8
    for r in layers:
        assert r["out"] == ["[S(0)]"], (r["name"], r["out"])
    params = [r for r in plan.records if r["kind"] == "param"]
    assert all(r["out"] == ["[R]"] for r in params), [(r["fqn"], r["out"]) for r in params]
    for r in (r for r in layers if r["target"] == "aten.batch_norm"):
        # SyncBatchNorm: the op's own all-reduce of per-channel statistics, forward and backward
        own = [(c["kind"], c["phase"]) for c in r["comm"] if c["input"] is None]
        assert ("all_gather", "fwd") in own and ("all_reduce", "bwd") in own, r["comm"]
    convs = [r for r in layers if r["target"] == "aten.conv2d"]
    for r in convs:
        # data-parallel gradient synchronisation of the replicated weight and bias
        grads = [c for c in r["comm"] if c["phase"] == "bwd" and c["kind"] == "all_reduce" and c["input"] in (1, 2)]
        assert len(grads) == 2, r["comm"]
