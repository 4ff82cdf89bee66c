"""2D (SUMMA / Optimus), 2.5D (Tesseract) and 3D tensor parallelism as per-axis compositions.

Partita places every tensor with one placement per mesh axis, and a contraction's candidate on
one axis is one of (:mod:`passes.rules.contractions`), for ``Y[M, N] = X[M, K] W[K, N]``:

* ``M``: the rows of X split (``X S(0)``, W whole, ``Y S(0)``): data parallel on this axis;
* ``N``: the columns of W split (``X`` whole, ``W S(n)``, ``Y S(-1)``): Megatron's column split;
* ``K``: the contracted dim split (``X S(-1)``, ``W S(k)``, ``Y`` partial): Megatron's row split;
* ``R``: nothing split on this axis.

Each algorithm is a fixed assignment of these roles to the mesh axes (the "grid"), with the
weights stored split over the whole grid and all-gathered along the axis that uses them whole:

* ``"1d"``: Megatron: the last axis ``N`` or ``K`` (the solver chooses per layer), the others
  ``M`` (data parallel, weights stored as the solver decides).
* ``"2d"`` on a ``q x q`` mesh: axis 0 rows (``M``), axis 1 columns (``N``). X arrives
  ``[S(0), S(-1)]`` and is all-gathered along axis 1; W is stored ``[S(k), S(n)]`` (a q x q
  block each) and all-gathered along axis 0; Y leaves ``[S(0), S(-1)]``, the layout the next
  layer takes. Backward: dX is partial on axis 1 (reduce-scatter), dW on axis 0 (reduce-scatter).
* ``"2.5d"`` on ``d x q x q``: axis 0 depth (a further ``M`` split, W replicated over it and
  its gradient all-reduced there), axes 1, 2 the ``q x q`` grid as in 2D.
* ``"3d"`` on ``c x c x c``: axis 0 ``M``; axes 1 and 2 are ``N`` and ``K`` or ``K`` and ``N``
  (the solver alternates them between layers, so that Y, partial on the ``K`` axis and
  reduce-scattered onto M there, arrives as the next layer's X). W is stored W/p a device
  (:func:`cube_storage`): the ``c x c`` block ``W[k, j]`` of axes 1, 2 cut once more over axis 0
  along its contracted dim, innermost (``InnerShard``: Partita otherwise cuts a dim outer axis
  first, and an outer cut would not gather in one piece), all-gathered along axis 0 for use and
  its gradient reduce-scattered there.

Forcing (``tensor_parallel=``) restricts every *weight contraction* (a contraction one of whose
operands is a parameter: linear, addmm, matmul by a weight) to its algorithm's candidates and
pins 2D / 2.5D weights to their grid storage (3D's to the two orders of its W/p storage, the
solver choosing the one the layer's roles use; under ``"auto"`` on a cube mesh these are
offered); the ops around the contractions (norms over the split hidden dim, attention with heads
split, residual adds, embedding, loss) are left to the solver, which keeps the layout because any
other costs more. The mode comes with the mesh in the plan's
:class:`passes.core.rule_options.RuleOptions`, which the strategy space hands to :func:`allowed` and
:func:`storage_options`. :func:`classify` names the role each axis plays in a chosen strategy
(the plan summary's grid line). :func:`linear_comm_bytes` is the per-linear communication
formula for each algorithm (bytes per device, payloads as :mod:`passes.plan.cost_model` counts them).
"""

from __future__ import annotations

from collections.abc import Sequence

from passes.analysis.analyze import info
from passes.core.placements import InnerShard, R, Shard, is_partial, is_shard
from passes.core.plan_records import NodeRecord
from passes.core.rule_options import TP_MODES, RuleOptions, check_choice
from passes.rules import op_view, rule_for, tensor_input_nodes

__all__ = [
    "TP_MODES",
    "check_mesh",
    "grid_roles",
    "weight_contraction",
    "weight_input",
    "axis_role",
    "classify",
    "allowed",
    "forced_pins",
    "cube_storage",
    "storage_options",
    "grid_options",
    "linear_comm_bytes",
    "rows_divisible",
    "algorithm_of",
    "label_records",
    "grid_lines",
]


def check_mesh(mode: str, mesh_shape) -> tuple:
    """The mesh ``mode`` needs; raises naming the mesh and the shape needed."""
    check_choice("tensor_parallel", mode, TP_MODES)
    mesh = tuple(int(n) for n in mesh_shape)
    need = {
        "2d": (2, lambda m: m[0] == m[1] and m[0] > 1, "q x q (two equal axes, q > 1), e.g. (2, 2) or (8, 8)"),
        "2.5d": (3, lambda m: m[1] == m[2] and m[1] > 1, "d x q x q (the last two axes equal, q > 1), e.g. (2, 2, 2)"),
        "3d": (3, lambda m: m[0] == m[1] == m[2] and m[0] > 1, "c x c x c (three equal axes, c > 1), e.g. (2, 2, 2)"),
    }
    if mode == "1d":
        if mesh[-1] <= 1:
            raise ValueError(f"tensor_parallel='1d' needs a last mesh axis of more than one device, got mesh {mesh}")
    elif mode in need:
        ndim, ok, text = need[mode]
        if len(mesh) != ndim or not ok(mesh):
            raise ValueError(
                f"tensor_parallel={mode!r} needs a {text} mesh, got mesh_shape={mesh}; "
                f"give such a mesh_shape, or tensor_parallel='auto' / '1d' for this one"
            )
    return mesh


def grid_roles(mode: str, ndim: int) -> list:
    """Per mesh axis, the roles a weight contraction may take there under ``mode`` (sets of
    ``"M"``, ``"N"``, ``"K"``), for a mesh of ``ndim`` axes; ``None``: any role (``"auto"``)."""
    if mode == "auto":
        return [None] * ndim
    if mode == "1d":
        return [{"M"}] * (ndim - 1) + [{"N", "K"}]
    if mode == "2d":
        return [{"M"}, {"N"}]
    if mode == "2.5d":
        return [{"M"}, {"M"}, {"N"}]
    return [{"M"}, {"N", "K"}, {"N", "K"}]  # 3d, axes 1 and 2 differ (combination check)


GRID_NAMES = {
    "1d": lambda n: ["data"] * (n - 1) + ["tensor"],
    "2d": lambda n: ["rows", "columns"],
    "2.5d": lambda n: ["depth", "rows", "columns"],
    "3d": lambda n: ["i (rows)", "j", "k"],
}


def _is_param(node) -> bool:
    """A parameter, or a view of one (``W.t()`` feeding a matmul)."""
    while node.op == "call_function" and getattr(rule_for(node), "is_view", False):
        inputs = tensor_input_nodes(node)
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return node.op == "placeholder" and info(node).kind == "param"


def weight_contraction(node):
    """``(activation input index, weight input index)`` when ``node`` is a contraction of an
    activation by a parameter (linear, addmm, mm, matmul); None otherwise."""
    if node.op != "call_function":
        return None
    rule = rule_for(node)
    layout = getattr(rule, "layout", None)
    if not getattr(rule, "contraction", False) or layout is None:
        return None
    operands, _, _ = layout(op_view(node))
    if len(operands) != 2:
        return None
    inputs = tensor_input_nodes(node)
    params = [idx for idx, _, _ in operands if _is_param(inputs[idx])]
    if not params:
        return None
    w = params[-1]  # both parameters (a learned input): the second operand, as in x @ W
    x = next(idx for idx, _, _ in operands if idx != w)
    if len(op_view(node).in_shapes[x] or ()) < 2:
        return None
    return x, w


def weight_input(node):
    """The weight operand (an fx node) of a weight contraction (see :func:`weight_contraction`)."""
    return tensor_input_nodes(node)[weight_contraction(node)[1]]


def axis_role(axis_strategy, x_index: int, out_rank: int) -> str:
    """The role (``M``, ``N``, ``K``, ``R``; ``?`` for none of these) of one axis's candidate of
    a weight contraction whose activation is input ``x_index``."""
    x = axis_strategy.ins[x_index]
    out = axis_strategy.out[0]
    if isinstance(out, Shard) and out.dim < out_rank - 1 and x == out:
        return "M"
    if isinstance(out, Shard) and out.dim == out_rank - 1 and x == R:
        return "N"
    if is_partial(out) and is_shard(x) and x.dim == out_rank - 1:
        return "K"
    if out == R and x == R:
        return "R"
    return "?"


def classify(node, strategy) -> str | None:
    """Per-axis roles of ``node``'s chosen strategy, e.g. ``"M,N"`` (2D) or ``"M,K,N"`` (3D);
    None when ``node`` is not a weight contraction."""
    wc = weight_contraction(node)
    if wc is None or strategy is None:
        return None
    out_rank = len(op_view(node).out_shape)
    return ",".join(axis_role(a, wc[0], out_rank) for a in strategy.axes)


def algorithm_of(roles: str, mesh_shape, weight_spec=None) -> str:
    """The algorithm a contraction's roles (:func:`classify`) amount to on ``mesh_shape``, given
    how its weight is stored (``weight_spec``, one placement per axis; None: unknown). Data
    parallel times Megatron's column split has 2D's roles; it is 2D (2.5D) when the weight is
    also stored split on the rows axis (the whole grid holds one copy)."""
    r = roles.split(",")
    mesh = tuple(mesh_shape)
    live = [x for x, n in zip(r, mesh) if n > 1]
    if all(x in ("M", "R") for x in live):
        return "data" if "M" in live else "replicated"
    rows_split = weight_spec is not None and is_shard(weight_spec[len(mesh) - 2])
    if len(mesh) == 2 and r == ["M", "N"] and mesh[0] == mesh[1] and rows_split:
        return "2d"
    if len(mesh) == 3 and r == ["M", "M", "N"] and mesh[1] == mesh[2] and rows_split:
        return "2.5d"
    if len(mesh) == 3 and r in (["M", "N", "K"], ["M", "K", "N"]) and mesh[0] == mesh[1] == mesh[2]:
        return "3d"
    if sum(x in ("N", "K") for x in live) == 1 and all(x in ("M", "R", "N", "K") for x in live):
        return "1d"
    return "mixed"


ROW, COLUMN = "row", "column"
ACTIVATION_LAYOUTS: dict[str, set] = {
    "2d": {(ROW, COLUMN)},
    "2.5d": {(ROW, ROW, COLUMN)},
    "3d": {(ROW, ROW, COLUMN), (ROW, COLUMN, ROW)},
}
"""The layouts of activations between layers, per mesh axis: ``COLUMN`` the hidden (last) dim
split, ``ROW`` a token dim (any dim before the last: the batch, or the sequence) split. The
norms are held to them, so that the layers in between keep the algorithm's layout. The rows of
a grid are the tokens, batch x sequence flattened: the row axes may split the batch, the
sequence, or both (``[S(0), S(1), S(-1)]`` on 2.5D's ``d x q x q`` cuts a batch of 2 over the
depth and each sample's sequence over the rows), whichever the shapes allow and costs least."""


def _layout_of(spec, rank: int) -> tuple:
    """A placement per axis read as :data:`ACTIVATION_LAYOUTS` entries (``None``: neither)."""
    return tuple(
        (COLUMN if p.dim in (-1, rank - 1) else ROW) if is_shard(p) and not isinstance(p, InnerShard) else None
        for p in spec
    )


def rows_divisible(row_shape, sizes) -> bool:
    """Whether mesh axes of ``sizes`` (the grid's row axes, outer first) can each split one of the
    token dims ``row_shape`` (all dims of an activation but its hidden one) so that every dim is
    divisible by the product of the axes on it."""
    if not sizes:
        return True
    first, rest = sizes[0], sizes[1:]
    for d, n in enumerate(row_shape):
        if n % first == 0:
            shrunk = list(row_shape)
            shrunk[d] = n // first
            if rows_divisible(shrunk, rest):
                return True
    return False


def _is_norm(node) -> bool:
    from passes.rules.normalization import LayerNormRule

    return node.op == "call_function" and isinstance(rule_for(node), LayerNormRule)


def label_records(records, mesh_shape) -> None:
    """Set ``tensor_parallel`` (:func:`algorithm_of`) on every plan record with ``tp_roles``,
    reading the weight's stored placement from its placeholder's record (through views)."""
    from passes.core.placements import parse_spec

    by_name = {r["name"]: r for r in records}
    for rec in records:
        if not rec.get("tp_roles"):
            continue
        weight = by_name.get(rec["tp_weight"])
        while weight is not None and weight.get("kind") != "param" and len(weight.get("inputs") or ()) == 1:
            weight = by_name.get(weight["inputs"][0])  # through views (W.t())
        spec = parse_spec(weight["out"][0], len(mesh_shape)) if weight and weight.get("out") else None
        rec["tensor_parallel"] = algorithm_of(rec["tp_roles"], mesh_shape, spec)


def allowed(node, strategy, options: RuleOptions) -> bool:
    """Whether ``strategy`` is admissible for ``node`` under the mode ``options`` force: weight
    contractions take their grid roles, 2D / 2.5D / 3D norms the activation layouts; any under
    ``"auto"``."""
    mode = options.tensor_parallel
    if mode == "auto":
        return True
    wc = weight_contraction(node)
    if wc is None:
        if mode in ACTIVATION_LAYOUTS and _is_norm(node):
            return _layout_of(strategy.out[0], len(op_view(node).out_shape)) in ACTIVATION_LAYOUTS[mode]
        return True
    mesh = options.mesh_shape
    out_rank = len(op_view(node).out_shape)
    roles = [axis_role(a, wc[0], out_rank) for a in strategy.axes]
    for role, want, n in zip(roles, grid_roles(mode, len(mesh)), mesh):
        if n == 1:
            continue
        if role not in want:
            return False
    if mode == "3d" and roles[1] == roles[2]:
        return False
    return True


def grid_options(node, strategies, mesh_shape) -> set:
    """Indices of ``strategies`` that run a 2D / 2.5D / 3D grid on this mesh (a weight
    contraction's roles, or a norm's activation layout): kept when a 3-axis mesh caps an op's
    options (``build_space(max_options=)``), so the solver can always choose the algorithms."""
    mesh = tuple(mesh_shape)
    modes = [m for m in ("2d", "2.5d", "3d") if _fits(m, mesh)]
    if not modes:
        return set()
    wc = weight_contraction(node)
    if wc is None:
        if not _is_norm(node):
            return set()
        layouts = set().union(*(ACTIVATION_LAYOUTS[m] for m in modes))
        rank = len(op_view(node).out_shape)
        return {k for k, s in enumerate(strategies) if _layout_of(s.out[0], rank) in layouts}
    out_rank = len(op_view(node).out_shape)
    kept = set()
    for k, s in enumerate(strategies):
        roles = ",".join(axis_role(a, wc[0], out_rank) for a in s.axes)
        if algorithm_of(roles, mesh, weight_spec=(Shard(0),) * len(mesh)) in modes:
            kept.add(k)
    return kept


def _fits(mode, mesh) -> bool:
    try:
        check_mesh(mode, mesh)
    except ValueError:
        return False
    return True


def _weight_dims(node, wc):
    """(output dim, contracted dim) of a weight contraction's 2-D weight operand (``aten.linear``:
    ``[N, K]``; ``addmm`` / ``mm`` / ``matmul``: ``[K, N]``); None for any other weight shape."""
    operands, out_labels, _ = rule_for(node).layout(op_view(node))
    labels = {idx: lab for idx, lab, _ in operands}
    w_labels, x_labels = labels[wc[1]], labels[wc[0]]
    if len(w_labels) != 2:
        return None
    k = [i for i, lab in enumerate(w_labels) if lab in x_labels and lab not in out_labels]
    n = [i for i, lab in enumerate(w_labels) if lab in out_labels and lab not in x_labels]
    return (n[0], k[0]) if len(k) == 1 and len(n) == 1 else None


def _param_weight_dims(param, aliases=()):
    """(output dim, contracted dim) of ``param`` as the 2-D weight a weight contraction reads
    directly (see :func:`_weight_dims`), under its own name or one of ``aliases`` (the other
    placeholders of a tied weight); None when no weight contraction reads it so."""
    for node in (param, *aliases):
        for user in node.users:
            wc = weight_contraction(user)
            if wc is not None and tensor_input_nodes(user)[wc[1]] is node:
                dims = _weight_dims(user, wc)
                if dims is not None:
                    return dims
    return None


def cube_storage(param, mesh_shape, aliases=()) -> list:
    """3D's storage of a weight contraction's 2-D weight on a ``c x c x c`` mesh: W/p a device,
    the ``c x c`` block a contraction uses (``n`` and ``k`` over axes 1, 2 in either order) cut
    once more over axis 0 along ``k``, innermost (:class:`passes.core.placements.InnerShard`), so that
    gathering it for use is one contiguous all-gather along axis 0 and its gradient one
    reduce-scatter there: ``[Si(k), S(n), S(k)]`` and ``[Si(k), S(k), S(n)]``. Empty for any
    other parameter or mesh, or dims the grid does not divide. ``aliases``: as for
    :func:`_param_weight_dims` (a tied weight is stored so when any of its names is such a weight)."""
    mesh = tuple(mesh_shape)
    dims = _param_weight_dims(param, aliases) if param.op == "placeholder" else None
    if dims is None or not _fits("3d", mesh):
        return []
    n_dim, k_dim = dims
    shape, c = info(param).shape, mesh[0]
    if shape[k_dim] % (c * c) or shape[n_dim] % c:
        return []
    inner = InnerShard(k_dim)
    return [(inner, Shard(n_dim), Shard(k_dim)), (inner, Shard(k_dim), Shard(n_dim))]


def storage_options(param, specs: list, options: RuleOptions, aliases=()) -> list:
    """A parameter placeholder's storage options: under forced 3D a weight contraction's 2-D
    weight takes only :func:`cube_storage` (W/p a device; a weight whose dims the grid does not
    divide is refused, naming it), under ``"auto"`` on a cube mesh those are added to ``specs``.
    ``aliases``: the placeholders this one decides for (a tied weight's other names)."""
    mode, mesh_shape = options.tensor_parallel, options.mesh_shape
    cube = cube_storage(param, mesh_shape, aliases)
    if mode == "3d" and _param_weight_dims(param, aliases) is not None:
        if not cube:
            c = mesh_shape[0]
            raise ValueError(
                f"tensor_parallel='3d' on mesh {tuple(mesh_shape)}: weight {info(param).name} of shape "
                f"{tuple(info(param).shape)} cannot be stored W/p (its contracted dim split {c * c} ways, its "
                f"output dim {c} ways); use dims divisible by {c * c} or another mesh"
            )
        return cube
    if mode == "auto" and cube:
        return list(specs) + [s for s in cube if s not in specs]
    return specs


def forced_pins(graph, mode: str, mesh_shape) -> dict:
    """Storage pins of the 2-D weights of weight contractions under 2D / 2.5D (their grid blocks:
    ``[S(k), S(n)]``, ``[R, S(k), S(n)]``, ``k`` and ``n`` the weight's contracted and output
    dims), and checks that every weight contraction can run the algorithm (its batch and weight
    dims divide by the grid); raises naming the node."""
    if mode == "auto":
        return {}
    mesh = check_mesh(mode, mesh_shape)
    pins: dict = {}
    for node in graph.nodes:
        wc = weight_contraction(node)
        if wc is None:
            continue
        op = op_view(node)
        x_shape, w_shape = op.in_shapes[wc[0]], op.in_shapes[wc[1]]
        row_axes = _row_axis_sizes(mode, mesh)
        if not rows_divisible(x_shape[:-1], row_axes):
            where = info(node).module_path or "top level"
            raise ValueError(
                f"tensor_parallel={mode!r} on mesh {mesh}: node {node.name} ({where}) has tokens "
                f"{' x '.join(map(str, x_shape[:-1]))} (batch first), which the grid's row axes {tuple(row_axes)} "
                f"cannot split (each axis cuts one of these dims evenly); give a batch or sequence length that "
                f"the row axes divide, or another mesh"
            )
        w = tensor_input_nodes(node)[wc[1]]
        dims = _weight_dims(node, wc)
        if mode not in ("2d", "2.5d") or w.op != "placeholder" or dims is None:
            continue
        n_dim, k_dim = dims
        q = mesh[-1]
        if w_shape[n_dim] % q or w_shape[k_dim] % q:
            raise ValueError(
                f"tensor_parallel={mode!r} on mesh {mesh}: weight {info(w).name} of shape {tuple(w_shape)} "
                f"cannot be cut into {q} x {q} blocks; use dims divisible by {q} or another mesh"
            )
        grid = (Shard(k_dim), Shard(n_dim))
        pins[w] = grid if mode == "2d" else (R,) + grid
    return pins


def _row_axis_sizes(mode: str, mesh: tuple) -> list:
    """The sizes of the axes that split an activation's tokens under ``mode`` (outer first): the
    ``ROW`` axes of its layout between layers (3D's second row axis is gathered for use), the
    data axes of ``"1d"``."""
    if mode in ACTIVATION_LAYOUTS:
        layout = sorted(ACTIVATION_LAYOUTS[mode])[0]
        return [n for n, part in zip(mesh, layout) if part == ROW and n > 1]
    return [n for role, n in zip(grid_roles(mode, len(mesh)), mesh) if role == {"M"} and n > 1]


def linear_comm_bytes(mode: str, m: int, k: int, n: int, mesh_shape, elem: int = 4, *, input_grad: bool = True):
    """Bytes per device one linear ``Y[m, n] = X[m, k] W[k, n]`` communicates under ``mode``,
    as ``{phase: {kind: {axis: bytes}}}`` (payloads: an all-gather counts the gathered buffer,
    a reduce-scatter its full input, an all-reduce its buffer; see :mod:`passes.plan.cost_model`).

    X arrives and Y leaves in the algorithm's layout; W is stored as the algorithm stores it
    (3D: W/p, cut innermost over axis 0, :func:`cube_storage`), its gathered copy kept for
    backward. ``input_grad``: X needs a gradient (every layer but one fed by the
    model's inputs). Derivations in ``docs/ARCHITECTURE.md``, "2D, 2.5D and 3D tensor parallelism".
    """
    mesh = check_mesh(mode, mesh_shape)
    out: dict = {"fwd": {}, "bwd": {}}

    def add(phase, kind, axis, nbytes):
        out[phase].setdefault(kind, {})
        out[phase][kind][axis] = out[phase][kind].get(axis, 0) + nbytes * elem

    if mode == "2d":
        q = mesh[0]
        add("fwd", "all_gather", 1, m * k / q)  # X[m/q, k] gathered along the columns
        add("fwd", "all_gather", 0, k * n / q)  # W[k, n/q] gathered along the rows
        if input_grad:
            add("bwd", "reduce_scatter", 1, m * k / q)  # dX[m/q, k] partial over the columns
        add("bwd", "reduce_scatter", 0, k * n / q)  # dW[k, n/q] partial over the rows
    elif mode == "2.5d":
        d, q = mesh[0], mesh[1]
        add("fwd", "all_gather", 2, m * k / (d * q))
        add("fwd", "all_gather", 1, k * n / q)
        if input_grad:
            add("bwd", "reduce_scatter", 2, m * k / (d * q))
        add("bwd", "reduce_scatter", 1, k * n / q)
        add("bwd", "all_reduce", 0, k * n / (q * q))  # dW[k/q, n/q] summed over the depth
    elif mode == "3d":
        c = mesh[0]
        # roles (axis 0 M, axis 1 N, axis 2 K): X[m/c^2, k/c] gathered along axis 1,
        # W[k/c^2, n/c] along axis 0, Y partial on axis 2, reduce-scattered onto its rows there
        add("fwd", "all_gather", 1, m * k / c**2)
        add("fwd", "all_gather", 0, k * n / c**2)
        add("fwd", "reduce_scatter", 2, m * n / c**2)
        if input_grad:
            add("bwd", "reduce_scatter", 1, m * k / c**2)  # dX partial over axis 1
        add("bwd", "all_gather", 2, m * n / c**2)  # dY gathered back along axis 2
        add("bwd", "reduce_scatter", 0, k * n / c**2)  # dW[k/c, n/c] partial over axis 0, scattered
    else:
        raise ValueError(f"linear_comm_bytes covers '2d', '2.5d' and '3d', not {mode!r}")
    return out


def grid_lines(records: Sequence[NodeRecord], data: dict) -> list:
    """Text for the plan summary (and ``dump``'s ``plan.txt``): the grid (which mesh axes are
    rows, columns, depth), the algorithm each weight contraction runs, and per contraction
    (repeated layers once) its per-axis roles and the blocks a device holds of X, W and Y
    (``records``: the plan's, typed)."""
    from passes.core.placements import local_shape, parse_spec

    rows = [r for r in records if r.tp_roles]
    if not rows:
        return []
    mode = data.get("tensor_parallel", "auto")
    names = data["mesh"]["axis_names"]
    mesh = tuple(data["mesh"]["shape"])
    counts: dict = {}
    for r in rows:
        counts[r.tensor_parallel] = counts.get(r.tensor_parallel, 0) + 1
    head = f"grid (tensor_parallel={mode!r})"
    if mode in GRID_NAMES:
        head += ": " + ", ".join(f"{a} {role}" for a, role in zip(names, GRID_NAMES[mode](len(mesh))))
    lines = [head + "; weight contractions: " + ", ".join(f"{k} on {n}" for k, n in sorted(counts.items()))]
    shapes = {r.name: r.shapes or [] for r in records}
    for r in rows:
        if r.rep != r.name:
            continue
        blocks = []
        for label, name, spec in zip(("X", "W"), r.inputs, r.ins):
            shape = (shapes.get(name) or [None])[0]
            if shape is not None and spec is not None:
                blocks.append(f"{label} {'x'.join(map(str, local_shape(shape, parse_spec(spec, len(mesh)), mesh)))}")
        if r.local_shapes and r.local_shapes[0] is not None:
            blocks.append(f"Y {'x'.join(map(str, r.local_shapes[0]))}")
        roles = " ".join(f"{a}={role}" for a, role in zip(names, r.tp_roles.split(",")))
        lines.append(f"  {r.name} ({r.module or 'top level'}): {r.tensor_parallel}, {roles}; " + ", ".join(blocks))
    return lines
