"""The demo's closing part: what the same GPT is given on real hardware, and why.

The demo's plan comes from the cost model measured on this CPU (``cluster="cpu"``). Here the
same model, and a larger one of the same family, are planned without devices (built on
``meta``) for a 2x4 mesh of H100s (``cluster="h100"``) and, for comparison, with this
machine's measured cluster. Each plan is described per mesh axis by what its matmuls
(``linear``/``addmm``/``mm``) do there, weighted by their compute time: *data* parallel (the
batch dim is split), *tensor* parallel (the output's last dim is split, or partial sums are
reduced), *sequence* (another dim split) or *replicated*. Beside it, the numbers of both
clusters that decide the choice: matmul FLOP/s, link bandwidth, and the fixed cost of one
collective (launch plus one ring step), also as the FLOPs a device could have computed in
that time.
"""

from __future__ import annotations

import torch

from partitioner.axis_roles import axis_roles

__all__ = ["axis_roles", "cluster_numbers", "comparison", "meta_gpt"]


def cluster_numbers(spec) -> dict:
    """The figures that decide between data and tensor parallelism on ``spec``."""
    flops = spec.flops_for("float32") * spec.matmul_efficiency
    link = spec.intra_node
    fixed = spec.collective_overhead_s + link.latency_s
    return {"flops": flops, "bandwidth": link.bandwidth, "fixed_s": fixed, "fixed_flops": fixed * flops}


def meta_gpt(n_layer, n_embd, n_head, batch, seq, vocab=256):
    """The demo's GPT family on ``meta`` with (tokens, targets) of ``batch`` x ``seq``."""
    from partitioner.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


def _uses_tensor_parallelism(plan) -> bool:
    return "tensor" in axis_roles(plan)


def _why(rows, cpu, h100) -> str:
    """The explanation, worded from the numbers and the plans above it."""
    cpu_bpf, h100_bpf = cpu["bandwidth"] / cpu["flops"], h100["bandwidth"] / h100["flops"]
    text = (
        "Why: a split pays when the compute it saves outweighs the communication it adds. Data parallelism "
        "adds one all-reduce of the weight gradients per step (bucketed: bandwidth only); tensor parallelism "
        "adds all-reduces of activations in every layer, forward and backward, each paying a collective's "
        f"fixed cost. An H100 computes {h100['flops'] / cpu['flops']:.0f}x faster than this CPU and its NVLink "
        f"moves {h100['bandwidth'] / cpu['bandwidth']:.0f}x more bytes per second: per FLOP of compute its "
        f"links move {h100_bpf:.4f} bytes against {cpu_bpf:.4f} here, and one collective's fixed cost forgoes "
        f"{h100['fixed_flops'] / 1e6:.0f} MFLOP of compute against {cpu['fixed_flops'] / 1e6:.0f} here"
    )
    if cpu_bpf >= h100_bpf and cpu["fixed_flops"] <= h100["fixed_flops"]:
        text += ": relative to its compute, communication is cheaper on this CPU, not dearer."
    elif cpu_bpf <= h100_bpf and cpu["fixed_flops"] >= h100["fixed_flops"]:
        text += ": relative to its compute, communication is dearer on this CPU."
    else:
        text += "."
    small = [plan for what, plan in rows if what.startswith("this GPT")]
    large = [plan for what, plan in rows if not what.startswith("this GPT")]
    if not any(map(_uses_tensor_parallelism, small)) and all(map(_uses_tensor_parallelism, large)):
        text += (
            " What decides here is the model's size: the small GPT's few weights make its gradients cheap to "
            "sum and its matmuls are short against a collective's fixed cost, so no cluster splits its "
            "matmuls; the larger GPT's weight gradients are large against a layer's activations and its "
            "matmuls long, so every cluster splits them (tensor parallel) on one mesh axis."
        )
    else:
        text += " plan.explain(...) shows the costs behind any one choice."
    return text


def comparison(demo_plan, *, n_layer, n_embd, n_head, batch, seq) -> str:
    """The text the demo prints after training (see the module docstring)."""
    import textwrap

    import partitioner
    from partitioner.local_cluster import get_cluster
    from partitioner.units import fmt_time as _fmt_time

    small = (n_layer, n_embd, n_head, batch, seq)
    large = (12, 2048, 16, 8, 1024)
    rows = [(f"this GPT ({n_layer} layers, {n_embd} wide, batch {batch}x{seq})", demo_plan)]
    for size, cluster, mesh in (
        (small, "h100", (2, 2)),
        (small, "h100", (2, 4)),
        (large, "h100", (2, 4)),
        (large, "cpu", (2, 4)),
    ):
        layers, width, heads, b, s = size
        model, inputs = meta_gpt(layers, width, heads, b, s)
        plan = partitioner.plan(model, inputs, mesh_shape=mesh, cluster=cluster)
        what = "this GPT" if size == small else f"GPT, {layers} layers, {width} wide, batch {b}x{s}"
        rows.append((what, plan))
    lines = [
        "",
        "What the planner gives the same GPT elsewhere (planned here without devices, models on meta):",
        f"  {'model':<44} {'cluster':<8} {'mesh':<7} {'estimated step':>14}  what each mesh axis does",
    ]
    for what, plan in rows:
        lines.append(
            f"  {what:<44} {plan.data['cluster']['name']:<8} {str(plan.mesh_shape):<7} "
            f"{_fmt_time(plan.estimate().step_time_s):>14}  {axis_roles(plan)}"
        )
    cpu, h100 = cluster_numbers(get_cluster("cpu")), cluster_numbers(get_cluster("h100"))
    lines += [
        "",
        f"  {'cluster':<22} {'matmul FLOP/s':>15} {'link':>11} {'one collective, fixed':>22} {'= compute forgone':>18}",
    ]
    for name, n in (("cpu (measured here)", cpu), ("h100 (NVLink preset)", h100)):
        lines.append(
            f"  {name:<22} {n['flops'] / 1e9:>9.0f} GFLOP/s {n['bandwidth'] / 1e9:>6.1f} GB/s "
            f"{n['fixed_s'] * 1e6:>19.0f} us {n['fixed_flops'] / 1e6:>12.1f} MFLOP"
        )
    lines += [""] + textwrap.wrap(_why(rows, cpu, h100), 100)
    return "\n".join(lines)
