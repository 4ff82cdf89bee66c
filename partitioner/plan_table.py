"""Which rows of a plan people see, and the plan table (``ShardingPlan.summary()``, ``partita show``).

Rows are the graph's nodes in graph order. Three kinds are left out unless asked for
(``verbose=True``, CLI ``--verbose-table``), both here and in the dumped picture:

* **repeated blocks**: identical layers share their decisions, so only the first layer of a
  block is shown, under one header naming the layers and their count (always, verbose or not);
* **views**: getitems and followers that only reinterpret their input (view, transpose,
  slice, ...) with no collective on their input;
* **mask and index rows**: ops whose inputs are only integer model inputs (token ids, labels),
  constants they build themselves (``arange``, ``full``, ``ones``) or other such rows, and
  that communicate nothing: the attention-mask, position and label-shift computations. A row
  qualifies when no parameter, buffer or floating-point input reaches it. Each is folded into
  the first node that combines it with a parameter or an activation (its *consumer*); the
  table's footer counts them per consumer.

Width: by default the table fits :data:`WIDTH` (120) columns. It has no op and local-shape
columns (a node's name says its op, the placement gives its local shape), paths inside a
block are relative to the block's first layer, collectives are summarised per kind and mesh
axis (``AR@tp x2, AG@dp``) in the last column and wrap there, over-long names are shortened
from the left, and free text wraps. ``wide=True`` prints every column in full (cells up to 48
characters, collectives with their phase and bytes) on lines as long as they need.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Sequence

from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time
from passes.core.plan_records import CollectiveRecord, NodeRecord

__all__ = [
    "WIDTH",
    "mask_index_rows",
    "hidden_view",
    "block_first_index",
    "block_of",
    "shown_rows",
    "relative_path",
    "plan_table",
    "short_collectives",
]

WIDTH = 120
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
_VIEW_OPS = {
    "aten.view",
    "aten.reshape",
    "aten.transpose",
    "aten.permute",
    "aten.unsqueeze",
    "aten.contiguous",
    "aten.expand",
    "aten.alias",
    "aten.to",
    "aten._to_copy",
    "aten.slice",
    "aten.select",
    "aten.squeeze",
    "aten.flatten",
    "aten.split",
    "aten.chunk",
    "aten._unsafe_view",
    "aten.t",
}


def _is_float(dtype) -> bool:
    return isinstance(dtype, str) and dtype.startswith(("float", "bfloat", "complex"))


def mask_index_rows(records: Sequence[NodeRecord]) -> dict:
    """``{name: consumer}`` for every mask or index row (see the module docstring); the consumer
    is the first node in graph order that uses it, through other such rows, together with a
    parameter or an activation (None for a row nothing uses)."""
    by_name = {r.name: r for r in records}
    rows = set()
    for r in records:
        if r.kind != "op" or r.comm:
            continue
        if all(
            src in rows or (src in by_name and by_name[src].kind == "input" and not _is_float(by_name[src].dtype))
            for src in r.inputs
        ):
            rows.add(r.name)
    consumer = {}
    for r in records:
        if r.name in rows:
            continue
        stack = [s for s in r.inputs if s in rows]
        while stack:
            s = stack.pop()
            if s not in consumer:
                consumer[s] = r.name
                stack.extend(x for x in by_name[s].inputs if x in rows)
    return {name: consumer.get(name) for name in rows}


def hidden_view(r: NodeRecord) -> bool:
    """A getitem, or a follower that only reinterprets its input and communicates nothing."""
    if r.target == "getitem":
        return True
    base = ".".join(r.target.split(".")[:2])
    return r.decision == "follower" and not r.comm and base in _VIEW_OPS


def block_first_index(label: str) -> int:
    """``"h.[3-11]"`` -> 3: the layer shown for a block."""
    return int(label.rsplit("[", 1)[1].split("-")[0].rstrip("]"))


def block_of(r: NodeRecord, blocks: dict):
    """The block info (``label``, ``count``, ``prefix``) a record belongs to, or None."""
    label = r.block
    return blocks.get(label, {"label": label, "count": "?", "prefix": label.rsplit(".[", 1)[0]}) if label else None


def shown_rows(plan, *, verbose: bool = False) -> list:
    """The records a reader sees (typed), in graph order: the output node and every layer of a
    block but its first left out; views and mask/index rows too unless ``verbose``."""
    folded = {} if verbose else mask_index_rows(plan.node_records)
    out = []
    for r in plan.node_records:
        if r.kind == "output":
            continue
        if r.block is not None and r.block_index != block_first_index(r.block):
            continue
        if not verbose and (hidden_view(r) or r.name in folded):
            continue
        out.append(r)
    return out


def relative_path(path: str, base: str) -> str:
    """``path`` inside the layer ``base`` without it (``"(layer)"`` for the layer itself)."""
    if not path or not base:
        return path or ""
    if path == base:
        return "(layer)"
    return path[len(base) + 1 :] if path.startswith(base + ".") else path


def _collective_items(comm) -> list:
    counts = Counter((SHORT.get(c.kind, c.kind), c.axis) for c in comm)
    return [f"{k}@{a}" + (f" x{n}" if n > 1 else "") for (k, a), n in counts.items()]


_ALGORITHMS = ("ring", "ulysses")


def algorithm_items(r: NodeRecord) -> list:
    """``ring@a0`` / ``ulysses@a0``: the sequence-parallel attention algorithm a record runs on
    each mesh axis (its rule notes), listed before its collectives."""
    return [f"{note}@{axis}" for axis, note in (r.notes or {}).items() if note in _ALGORITHMS]


def short_collectives(comm: Sequence[CollectiveRecord]) -> str:
    """``AR@tp x2, AG@dp``: each collective kind on each axis once, with its count."""
    return ", ".join(_collective_items(comm))


def _dims(shape) -> str:
    return "x".join(map(str, shape)) if shape is not None else ""


def _placement(r: NodeRecord) -> str:
    return r.out[0].strip("[]").replace(", ", " ") if r.out else ""


def _cut_left(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[len(text) - width + 1 :]


def _cut_right(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _wrap_items(items: list, width: int) -> list:
    """Pack ``items`` into lines of at most ``width``, joined by ``", "``."""
    lines, line = [], ""
    for i, item in enumerate(items):
        item = _cut_right(item, width - 1)
        more = 1 if i < len(items) - 1 else 0  # room for the comma if the line goes on
        if not line or len(line) + 2 + len(item) + more <= width:
            line = f"{line}, {item}" if line else item
        else:
            lines.append(line + ",")
            line = item
    return lines + [line]


def _fit(widths: list, floors: list, limit: int) -> list:
    """Shrink the shrinkable columns (floor < width), widest slack first, until the row fits."""
    widths = list(widths)
    while sum(widths) + 2 * (len(widths) - 1) > limit:
        slack = [(w - f, i) for i, (w, f) in enumerate(zip(widths, floors, strict=True)) if w > f]
        if not slack:
            break
        widths[max(slack)[1]] -= 1
    return widths


def _wide_table(plan, rows, heads) -> list:
    header = [
        "node",
        "module",
        "op",
        "shape",
        "placement " + "×".join(plan.axis_names),
        "local shape",
        "communication",
        "time",
        "memory",
    ]
    cells = []
    for r in rows:
        if r.name in heads:
            cells.append([heads[r.name]])
        comm = "; ".join(
            algorithm_items(r)
            + [f"{SHORT.get(c.kind, c.kind)}@{c.axis} {c.phase} {_fmt_bytes(c.bytes)}" for c in r.comm]
        )
        local = r.local_shapes or [None]
        t = r.compute_s + sum(c.time_s for c in r.comm)
        cells.append(
            [
                r.fqn if r.kind in ("param", "input", "buffer") else r.name,
                r.module or "",
                r.target.replace("aten.", "").replace(".default", ""),
                _dims(r.shapes[0]) if r.shapes else "",
                _placement(r),
                _dims(local[0]),
                comm,
                _fmt_time(t) if t else "",
                _fmt_bytes(r.memory) if r.memory else "",
            ]
        )
    widths = [len(h) for h in header]
    for row in cells:
        if len(row) == len(header):
            widths = [min(max(w, len(c)), 48) for w, c in zip(widths, row, strict=True)]
    fmt = lambda row: "  ".join(c[:w].ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [row[0] if len(row) == 1 else fmt(row) for row in cells]


def _narrow_table(plan, rows, heads, bases, limit) -> list:
    header = ["node", "module", "shape", "placement " + "×".join(plan.axis_names), "time", "memory", "communication"]
    cells = []
    for r in rows:
        if r.name in heads:
            cells.append(heads[r.name])
        base = bases.get(r.name, "")
        name = r.fqn if r.kind in ("param", "input", "buffer") and r.fqn else r.name
        t = r.compute_s + sum(c.time_s for c in r.comm)
        cells.append(
            [
                relative_path(name, base),
                relative_path(r.module or "", base),
                _dims(r.shapes[0]) if r.shapes else "",
                _placement(r),
                _fmt_time(t) if t else "",
                _fmt_bytes(r.memory) if r.memory else "",
                algorithm_items(r) + _collective_items(r.comm),
            ]
        )
    table = [c for c in cells if not isinstance(c, str)]
    natural = [max([len(header[i])] + [len(row[i]) for row in table]) for i in range(6)]
    natural.append(max([len(header[6])] + [len(", ".join(row[6])) for row in table]))
    widths = [min(n, cap) for n, cap in zip(natural, (40, 32, 16, 24, 9, 10, 48), strict=True)]
    # How far each column may shrink: names and modules are cut from the left, shapes and
    # placements from the right, collectives wrap (no narrower than their longest item);
    # time and memory keep their width.
    floors = [
        14,
        12,
        9,
        len(header[3]),
        widths[4],
        widths[5],
        max([10] + [len(item) + 1 for row in table for item in row[6]]),
    ]
    widths = _fit(widths, [min(f, w) for f, w in zip(floors, widths, strict=True)], limit)
    cut = [_cut_left, _cut_left, _cut_right, _cut_right, _cut_right, _cut_right]

    def fmt(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    lines = [fmt(header), fmt(["-" * w for w in widths])]
    for row in cells:
        if isinstance(row, str):
            lines += textwrap.wrap(row, limit, subsequent_indent="   ")
            continue
        comm = _wrap_items(row[6], widths[6]) if row[6] else [""]
        lines.append(fmt([f(c, w) for f, c, w in zip(cut, row[:6], widths[:6], strict=True)] + [comm[0]]))
        lines += [fmt([""] * 6 + [more]) for more in comm[1:]]
    return lines


def _folded_note(plan, folded: dict, limit, wide) -> list:
    if not folded:
        return []
    by_name = plan.node_by_name
    per_consumer = Counter(folded.values())
    seconds = sum(by_name[n].compute_s for n in folded)
    memory = sum(by_name[n].memory for n in folded)
    order = {r.name: i for i, r in enumerate(plan.node_records)}
    into = ", ".join(
        f"{c} ({n})" for c, n in sorted(per_consumer.items(), key=lambda kv: order.get(kv[0], -1)) if c is not None
    )
    unused = f"; {per_consumer[None]} used by nothing" if per_consumer.get(None) else ""
    text = (
        f"folded: {len(folded)} mask/index rows (no parameter or activation reaches them; "
        f"{_fmt_time(seconds)}, {_fmt_bytes(memory)} in all) into the node that uses them: {into or '-'}{unused}. "
        f"summary(verbose=True) or --verbose-table lists them."
    )
    return [text] if wide else textwrap.wrap(text, limit, subsequent_indent="  ")


def plan_table(plan, *, verbose: bool = False, wide: bool = False, width: int = WIDTH) -> str:
    """The plan as a table, its estimate and solver statistics (see the module docstring)."""
    if "pipeline" in plan.data:
        return pipeline_table(plan, width=width)
    blocks = {b["label"]: b for b in plan.data.get("blocks", [])}
    rows = shown_rows(plan, verbose=verbose)
    heads, bases, seen = {}, {}, set()
    for r in rows:
        block = block_of(r, blocks)
        if block is None:
            continue
        base = f"{block['prefix']}.{block_first_index(block['label'])}"
        bases[r.name] = base
        if block["label"] not in seen:
            seen.add(block["label"])
            where = "" if wide else f" (names relative to {base})"
            redo = {
                "full": "; recomputed in backward (activation checkpointing)",
                "selective": ("; attention core recomputed in backward (selective activation checkpointing)"),
            }.get(block.get("recompute_mode") or ("full" if block.get("recompute") else "kept"), "")
            heads[r.name] = (
                f"── {block['label']}  ×{block['count']} identical blocks, shown once{where}; "
                f"times and bytes are per block{redo}"
            )
    title = (
        f"Sharding plan for {plan.data.get('model', '?')} on mesh {plan.mesh_shape} "
        f"({', '.join(plan.axis_names)}), cluster {plan.data['cluster']['name']}, budget "
        f"{_fmt_bytes(plan.data['budget']) if plan.data.get('budget') else 'none'}, precision "
        f"{plan.precision_name}"
    )
    lines = [title] if wide else textwrap.wrap(title, width, subsequent_indent="  ")
    lines += config_lines(plan, width)
    modes = {
        label: b.get("recompute_mode") or ("full" if b.get("recompute") else "kept") for label, b in blocks.items()
    }
    if any(m != "kept" for m in modes.values()):  # per block kind: kept / selective (attention core) / full
        redo = (
            f"recomputed in backward (activation checkpointing, recompute="
            f"{plan.data.get('recompute', 'auto')!r}): {', '.join(f'{b} ({m})' for b, m in modes.items())}"
        )
        lines += [redo] if wide else textwrap.wrap(redo, width, subsequent_indent="  ")
    lines += _sequence_parallel_line(plan, width, wide)
    lines += _experts_lines(plan, width, wide)
    lines += _grid_lines(plan, width, wide)
    lines += _storage_lines(plan, width, wide)
    lines += _wide_table(plan, rows, heads) if wide else _narrow_table(plan, rows, heads, bases, width)
    lines.append("")
    estimate = "estimate: " + str(plan.estimate())
    lines += [estimate] if wide else textwrap.wrap(estimate, width, subsequent_indent="  ")
    lines += _folded_note(plan, {} if verbose else mask_index_rows(plan.node_records), width, wide)
    stats = plan.data.get("stats", {})
    if stats:
        gap = stats.get("ilp_gap")
        lines.append(
            f"solver: {stats.get('decisions')} decisions, {stats.get('options')} options, "
            f"{stats.get('edges')} edges; solved in {stats.get('solve_s', 0):.2f} s"
            + (f" (node limit reached: within {100 * gap:.2f}% of optimal)" if gap else "")
        )
    return "\n".join(lines)


def weight_storage(plan) -> dict:
    """Parameter record name -> how it is stored: ``"replicated"``, ``"sharded"`` (used where it
    lies: tensor parallel), ``"zero1"`` (used whole where replicated, the optimizer's shard cut
    there), ``"zero2"`` (gathered for use, the copy kept for backward),
    ``"zero3"`` (gathered for use, freed after forward and gathered again in backward) or ``"cube"``
    (3D tensor parallel: cut over the whole cube, ``Si(d)`` innermost, gathered along the rows
    axis for use)."""
    params = {r.name: r for r in plan.node_records if r.kind == "param"}
    gathered = set()
    for r in plan.node_records:
        for c in r.comm:
            k = c.input
            if c.kind == "all_gather" and c.phase == "fwd" and k is not None and k < len(r.inputs):
                gathered.add(r.inputs[k])
    out = {}
    for name, r in params.items():
        if r.stored:
            out[name] = "zero1"
        elif "S(" not in "".join(r.out or ()):
            out[name] = "replicated"
        elif "Si(" in "".join(r.out or ()):
            out[name] = "cube"
        elif name not in gathered:
            out[name] = "sharded"
        else:
            out[name] = "zero3" if r.regather else "zero2"
    return out


def _storage_lines(plan, width, wide, kinds=None) -> list:
    """``weights: 12 replicated (data parallel), 4 ZeRO-3 (...)``, when some weight is gathered for use
    or ZeRO-1 (``kinds``: the counts to print, by default ``plan``'s)."""
    kinds = kinds if kinds is not None else Counter(weight_storage(plan).values())
    if not kinds["zero1"] and not kinds["zero2"] and not kinds["zero3"] and not kinds["cube"]:
        return []
    said = {
        "replicated": "replicated",
        "sharded": "sharded where used (tensor parallel)",
        "zero1": "ZeRO-1 (used whole, optimizer state sharded, one reduce-scatter and one all-gather per step)",
        "zero2": "ZeRO-2 (stored sharded, gathered for use, kept for backward)",
        "zero3": "ZeRO-3 (stored sharded, gathered for use, freed after forward and gathered again in backward)",
        "cube": "3D tensor parallel (stored W/p over the cube, gathered along the rows axis for use)",
    }
    text = "weights: " + ", ".join(f"{kinds[k]} {v}" for k, v in said.items() if kinds[k])
    return [text] if wide else textwrap.wrap(text, width, subsequent_indent="  ")


# -- the whole configuration (partitioner.search) ----------------------------------------------


def config_lines(plan, width: int = WIDTH) -> list:
    """``configuration: ...`` for a plan a search chose (``plan.config``), else nothing."""
    config = plan.config
    if config is None:
        return []
    from partitioner.axis_uses import describe_config

    text = f"configuration: {describe_config(plan)} (runner-ups: plan.explain())"
    return textwrap.wrap(text, width, subsequent_indent="  ")


def pipeline_table(plan, *, width: int = WIDTH) -> str:
    """A pipelined plan: its configuration, the stages (layers, mesh, per-microbatch estimate)
    and the schedule's step; each stage's own table is ``plan.stage_plans[s].summary()``."""
    pipe = plan.data["pipeline"]
    title = (
        f"Pipelined plan for {plan.data.get('model', '?')} on mesh {plan.mesh_shape} "
        f"({', '.join(plan.axis_names)}), cluster {plan.data['cluster']['name']}, budget "
        f"{_fmt_bytes(plan.data['budget']) if plan.data.get('budget') else 'none'}, precision {plan.precision_name}"
    )
    lines = textwrap.wrap(title, width, subsequent_indent="  ") + config_lines(plan, width)
    stored = sum((Counter(weight_storage(stage).values()) for stage in plan.stage_plans), Counter())
    lines += _storage_lines(plan, width, False, stored)  # over the stages (e.g. ZeRO-1 inside them)
    lines.append(
        f"schedule {pipe['schedule']}: {pipe['microbatches']} microbatches, simulated step "
        f"{_fmt_time(pipe['step_time_s'])}, bubble {100 * pipe['bubble_fraction']:.1f}% of rank-time, "
        f"point-to-point {_fmt_time(pipe['p2p_time_s'])} per message"
        + (f" (+ {_fmt_time(pipe['message_cpu_s'])} of CPU at each end)" if pipe.get("message_cpu_s") else "")
    )
    lines.append(f"{'stage':>5}  {'layers':<16} {'per microbatch: step':>22} {'memory (in flight)':>20}  shared with")
    first_of: dict = {}
    for s, (rep, layers) in enumerate(zip(pipe["stage_map"], pipe["layers"])):
        est = plan.stage_plans[s].estimate()
        span = f"{layers[0]}-{layers[-1]}" if layers else "-"
        shared = f"stage {first_of[rep]}" if rep in first_of else ""
        first_of.setdefault(rep, s)
        lines.append(
            f"{s:>5}  {span:<16} {_fmt_time(est.step_time_s):>22} {_fmt_bytes(est.memory_bytes):>20}  {shared}"
        )
    lines.append("")
    lines += textwrap.wrap("estimate: " + str(plan.estimate()), width, subsequent_indent="  ")
    lines.append("each stage's table: plan.stage_plans[s].summary()")
    return "\n".join(lines)


def _grid_lines(plan, width, wide) -> list:
    """The tensor-parallel grid and each weight contraction's roles and blocks (2D / 2.5D / 3D)."""
    from passes.rules.multidim_tp import grid_lines

    lines = grid_lines(plan.node_records, plan.data)
    if wide:
        return lines
    return [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="    ")]


def _sequence_parallel_line(plan, width, wide) -> list:
    """``attention over a split sequence (sequence_parallel='auto'): ring@a0 on 2 attention ops``."""
    found = Counter(item for r in plan.node_records for item in algorithm_items(r))
    if not found:
        return []
    text = (
        f"attention over a split sequence (sequence_parallel={plan.data.get('sequence_parallel', 'auto')!r}): "
        + ", ".join(f"{item} on {n} attention op{'s' if n > 1 else ''}" for item, n in found.items())
    )
    return [text] if wide else textwrap.wrap(text, width, subsequent_indent="  ")


def _experts_lines(plan, width, wide) -> list:
    """Which mesh axis carries the experts of the MoE layers, and the routed imbalance there."""
    from passes.rules.experts import experts_lines

    lines = experts_lines(plan.node_records, plan.data)
    return lines if wide else [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="  ")]
