"""A character-level language model on real text, bf16: auto-parallel on 4 ranks against one process.

Corpus: the license texts every Debian system ships in ``/usr/share/common-licenses`` (GPL,
LGPL, GFDL, Apache, MPL, ...: about 260 KB of English prose), read as bytes (vocabulary 256); the
last 10% is held out. Model: the embedded GPT (``partitioner.models.GPT``), 4 layers, width 128.
Both runs start from the same weights and see the same batches in the same order, under
``torch.autocast(bfloat16)``; the parallel one is ``auto_parallelize(..., mesh=(2, 2),
precision="bf16")`` on 4 gloo ranks (the plan the solver picks with the measured CPU cluster).
It reports both loss curves side by side (SVG), the largest per-step difference, and the
held-out loss of each at the end.

Usage: ``python benchmarks/char_lm.py [--steps 300] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_common import revision  # noqa: E402
from loss_curves import curves_svg  # noqa: E402

from partitioner import models  # noqa: E402
from runtime.launch import run_on_ranks  # noqa: E402

CORPUS = Path("/usr/share/common-licenses")


def load_corpus(folder: Path = CORPUS) -> torch.Tensor:
    """Every regular file of ``folder`` (links skipped: they repeat a file), sorted, as bytes."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no text under {folder}: it comes with Debian's base-files package")
    data = b"\n\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (steps, batch), generator=g)
    return [
        (torch.stack([data[s : s + seq] for s in row]), torch.stack([data[s + 1 : s + seq + 1] for s in row]))
        for row in starts
    ]


def held_out_loss(model, data: torch.Tensor, seq: int, autocast: bool) -> float:
    """Mean loss over consecutive windows of the held-out text."""
    n = (len(data) - 1) // seq
    x = data[: n * seq].view(n, seq)[:64]
    y = data[1 : n * seq + 1].view(n, seq)[:64]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return float(model(x, y))


def build(seq: int):
    model, _ = models.gpt_demo(batch=1, seq=seq, vocab_size=256, n_layer=4, n_embd=128, n_head=4)
    return model


def train(model, steps_data, lr: float, autocast: bool) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in steps_data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _parallel(rank, world, cfg):
    import partitioner

    data = load_corpus()
    split = int(0.9 * len(data))
    steps_data = batches(data[:split], cfg["steps"], cfg["batch"], cfg["seq"])
    model = build(cfg["seq"])
    pm = partitioner.auto_parallelize(model, steps_data[0], mesh=(2, 2), precision="bf16")
    t0 = time.perf_counter()
    losses = train(pm, steps_data, cfg["lr"], autocast=False)  # the program runs under its own autocast
    seconds = time.perf_counter() - t0
    pm.eval()
    held = held_out_loss(pm, data[split:], cfg["seq"], autocast=False)
    est = pm.plan.estimate()
    plan = [
        pm.plan.summary().splitlines()[0],
        f"estimated step {est.step_time_s * 1e3:.1f} ms, measured "
        f"{seconds / len(losses) * 1e3:.1f} ms per step; collectives {sorted(est.comm_bytes)}",
    ]
    return {"losses": losses, "held_out": held, "seconds": seconds, "plan": plan}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    cfg = {"steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr}
    code = revision()
    torch.set_num_threads(1)  # as each forked rank runs: the two runs' times compare like with like

    data = load_corpus()
    split = int(0.9 * len(data))
    steps_data = batches(data[:split], args.steps, args.batch, args.seq)
    torch.manual_seed(0)
    ref = build(args.seq)
    initial = copy.deepcopy(ref)
    t0 = time.perf_counter()
    ref_losses = train(ref, steps_data, args.lr, autocast=True)
    ref_seconds = time.perf_counter() - t0
    ref.eval()
    ref_held = held_out_loss(ref, data[split:], args.seq, autocast=True)
    print(f"one process: {ref_seconds:.1f} s, final loss {ref_losses[-1]:.3f}, held-out {ref_held:.3f}", flush=True)
    del initial

    par = run_on_ranks(_parallel, 4, cfg, timeout_s=3600, collective_timeout_s=600)[0]
    print(f"4 ranks: {par['seconds']:.1f} s, final loss {par['losses'][-1]:.3f}, held-out {par['held_out']:.3f}")
    diffs = [abs(a - b) for a, b in zip(par["losses"], ref_losses)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.date}-char_lm"
    (out / f"{stem}.svg").write_text(
        curves_svg(ref_losses, par["losses"], ("one process, bf16", "4 ranks (2x2), bf16"))
    )
    (out / f"{stem}.json").write_text(json.dumps({"one_process": ref_losses, "four_ranks": par["losses"]}))
    tail = lambda xs: sum(xs[-20:]) / len(xs[-20:])  # noqa: E731
    text = "\n".join(
        [
            f"# Character-level LM on real text, bf16: 4 ranks vs one process ({args.date})",
            "",
            f"Code: {code}. Command: `python benchmarks/char_lm.py --steps {args.steps}` on this 2-core CPU machine.",
            f"Corpus: {CORPUS} ({len(data):,} bytes, byte vocabulary; last 10% held out). GPT 4 layers x 128, "
            f"batch {args.batch} x {args.seq} characters, AdamW lr {args.lr}, {args.steps} steps, "
            f"bf16 autocast on both.",
            "",
            "| run | train loss, first step | train loss, mean of last 20 | held-out loss | time |",
            "|---|---|---|---|---|",
            f"| one process | {ref_losses[0]:.3f} | {tail(ref_losses):.3f} | {ref_held:.3f} | {ref_seconds:.0f} s |",
            f"| 4 gloo ranks, mesh (2, 2) | {par['losses'][0]:.3f} | {tail(par['losses']):.3f} | "
            f"{par['held_out']:.3f} | {par['seconds']:.0f} s |",
            "",
            f"Largest per-step loss difference: {max(diffs):.4f} (mean {sum(diffs) / len(diffs):.4f}); both runs round "
            f"to bf16 in a different order, so the curves agree to within bf16 noise rather than bit for bit.",
            "",
            "The parallel run's plan:",
            "",
            *[f"    {line}" for line in par["plan"]],
            "",
            f"![loss curves]({stem}.svg)",
            "",
        ]
    )
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
