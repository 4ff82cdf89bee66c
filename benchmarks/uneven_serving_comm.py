"""What a plan made at one batch sends when it serves others: counted bytes against its estimate.

``python benchmarks/uneven_serving_comm.py [--only mpt,codegen] [--out PREFIX]``

Each family of ``benchmarks/zoo_families.ZOO`` named is planned at batch 8, sequence 16 on a (2, 2)
mesh with the memory objective (``cluster="h100"``), then trained one step (forward and backward)
at batch 8 seq 16 (the planned shapes), batch 8 seq 24 (even pieces, other sizes) and batch 6 seq
24 (6 samples over the batch's axes: unequal pieces), each on 4 forked gloo ranks, with the
collectives' payload bytes counted (``runtime.collectives.CommCounter``, per rank). Printed per
shape: every rank's counted bytes (all-gathers, reduce-scatters, all-reduces, all-to-alls summed)
and the plan's estimate, which prices the planned shapes only. Counts of bytes, not times: the
numbers are the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_families import ZOO  # noqa: E402

from partitioner import hf_families  # noqa: E402
from runtime.launch import run_on_ranks  # noqa: E402

SHAPES = [(8, 16), (8, 24), (6, 24)]


def _total(by_kind: dict) -> float:
    return sum(sum(axes.values()) for axes in by_kind.values())


def comm_worker(rank, world, cfg):
    from parity_utils import call, loss_of

    import partitioner
    from runtime.collectives import CommCounter

    model, inputs = hf_families.build(cfg["family"], spec=ZOO[cfg["family"]], batch=8, seq=16)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", objective="memory")
    counted = {}
    for batch, seq in SHAPES:
        _, served = hf_families.build(cfg["family"], spec=ZOO[cfg["family"]], batch=batch, seq=seq, seed=3)
        for p in pm.parameters():
            p.grad = None
        with CommCounter() as counter:  # a first call at a shape lowers its program: no collective
            loss_of(call(pm, served)).backward()
        counted[f"b{batch} s{seq}"] = counter.as_dict()
    return {"rank": rank, "counted": counted, "estimate": pm.plan.estimate().comm_bytes}


def measure(family: str) -> dict:
    results = run_on_ranks(comm_worker, 4, {"family": family}, timeout_s=500, collective_timeout_s=150)
    estimate = results[0]["estimate"]
    rows = {shape: [_total(r["counted"][shape]) for r in results] for shape in results[0]["counted"]}
    return {
        "family": family,
        "estimate_bytes": _total(estimate),
        "counted_bytes_per_rank": rows,
        "counted": {r["rank"]: r["counted"] for r in results},
        "estimate": estimate,
    }


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="mpt,codegen", help="comma-separated families of the zoo")
    parser.add_argument("--out", default="", help="write PREFIX.json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    out = []
    for family in args.only.split(","):
        row = measure(family)
        out.append(row)
        print(f"### {family}: the plan's estimate {row['estimate_bytes']:.0f} B per step")
        for shape, per_rank in row["counted_bytes_per_rank"].items():
            ratio = per_rank[0] / row["estimate_bytes"]
            print(f"    {shape}: counted per rank {[f'{b:.0f}' for b in per_rank]} B ({ratio:.3f} x the estimate)")
        if args.out:
            Path(f"{args.out}.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
