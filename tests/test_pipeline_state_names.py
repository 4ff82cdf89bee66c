"""A pipeline runner's state carries every name of the model's ``state_dict()``: a tied weight's
second name that no stage reads it by, a parameter the program never reads, persistent buffers;
so ``full_state_dict()`` loads strictly into one device's model and equals it after training, and
``save_pretrained``-style consumers (``state_layouts``) see every name."""

import torch

import partitioner
from runtime.launch import run_on_ranks

STEPS = 2


class TiedWithUnread(torch.nn.Module):
    """An LM whose head is the embedding (tied, read only as ``embed.weight``), with a parameter
    the forward never reads and a persistent buffer."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.mask_emb = torch.nn.Parameter(torch.randn(width))  # never read by forward
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.scale
        logits = torch.nn.functional.linear(h, self.embed.weight)  # the head's weight, by the embedding's name
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (STEPS, 8, 6), generator=g)
    return [(x, x.roll(1, dims=1)) for x in ids]


def _worker(rank, world):
    torch.manual_seed(0)
    model = TiedWithUnread()
    ref = TiedWithUnread()
    ref.load_state_dict(model.state_dict())
    data = _batches()
    runner = partitioner.auto_parallelize(model, data[0], pipeline={"degree": 2, "microbatches": 2}, cluster="h100")
    held = set(runner.state_layouts())
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, labels in data:
        runner.train_step((ids, labels))
        optimizer.step()
        optimizer.zero_grad()
        ref(ids, labels).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    state = runner.full_state_dict()
    return {"rank": rank, "keys": list(state), "held": held, "state": state, "ref": ref.state_dict()}


def test_full_state_dict_has_every_name_and_equals_one_device_after_training():
    results = run_on_ranks(_worker, 2, timeout_s=240, collective_timeout_s=60)
    want = TiedWithUnread().state_dict()
    for r in results:
        assert r["keys"] == list(want), r["keys"]  # the model's own names, in its order
        one_device = TiedWithUnread()
        one_device.load_state_dict(r["state"])  # strict
        for name, value in r["ref"].items():
            torch.testing.assert_close(r["state"][name], value, msg=name)
    # the first pipeline rank holds what no stage reads; the tied alias is answered where its weight is
    first, last = results
    assert {"mask_emb", "scale"} <= first["held"]
    assert "mask_emb" not in last["held"]
    assert "head.weight" in first["held"] | last["held"]
