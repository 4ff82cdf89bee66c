"""The intra-op ILP (decision 5 in docs/ARCHITECTURE.md), solved by HiGHS through ``scipy.optimize.milp``.

Given groups ``g`` with options ``i`` (node cost ``c[g,i]`` seconds, memory ``m[g,i]`` bytes)
and edges ``e = (g, h)`` whose cost depends only on the class ``o = cls_g(i)`` of the
producer's option and the class ``s = cls_h(j)`` of the consumer's option (``C_e[o, s]``):

    minimise    sum_{g,i} c[g,i] x[g,i]  +  sum_e sum_{o,s} C_e[o,s] f[e,o,s]
    subject to  sum_i x[g,i] = 1                                   (one option per group)
                sum_s f[e,o,s] = sum_{i: cls_g(i)=o} x[g,i]         (flow leaves the producer's class)
                sum_o f[e,o,s] = sum_{j: cls_h(j)=s} x[h,j]         (and arrives at the consumer's)
                sum_{g,i} m[g,i] x[g,i] + sum_{e,o,s} M_e[o,s] f[e,o,s] <= budget   (memory)
                sum_{g,i} h[g,i] x[g,i] <= host budget                        (offloaded state, if any)
                sum_{i in A} x[g,i] = sum_{j in B} x[h,j]          (links: chosen together)
                x binary, f >= 0

The two flow families are the transportation form of the product ``x[g,i] x[h,j]``: at an
integer ``x`` the only feasible ``f`` is the product, and the relaxation is much tighter than
``f >= x + x' - 1``. Classes (distinct placements on the edge) keep ``f`` small. Links tie
decisions that must agree (every group of one repeated block recomputes, or none does:
:mod:`passes.plan.recompute`). With
``objective="memory"`` the memory sum is minimised instead, with time as a tie-break.

Relaxation first. The LP relaxation is solved before branch and bound; when its optimum has
every ``x`` integral (each edge's flows are then the product of its ends' choices) it is the
ILP's optimum, and when it is infeasible so is the ILP: either way branch and bound is skipped.
Most plans solve so (every solve without a binding budget measured on GPT, GPT-2, LLaMA, ViT
and BERT on 4 devices: integrality is observed there, not guaranteed), at 2-4x less CPU than
the MILP's presolve, root heuristics and symmetry detection; a binding budget's relaxation is
fractional and costs one LP more.

Presolve. On the small budgeted problems the tests and pipeline stages make, HiGHS's MIP
presolve and the restarts it triggers at the root cost more than they save: over 41 budgeted
solves of 300-3,600 variables (GPT, GPT-2, BERT, ViT plans with ZeRO, recomputation and budget
fitting) branch and bound without it took 20.0 CPU-s instead of 29.4 for the same objectives (it
may end on another plan of the same objective). Problems above :data:`PRESOLVE_ABOVE` variables
keep it (not measured without).

Search limits. Branch and bound stops at a relative gap of ``gap`` (1e-6: optimal), after
``node_limit`` nodes (1,000 by default), or after ``time_limit`` seconds, whichever comes first. The node limit is
the one that binds on a hard budgeted problem: HiGHS usually finds its best plan in
the first few hundred nodes and then spends minutes proving it; a node count, unlike a clock,
stops at the same point on every machine, so the plan chosen does not depend on the machine's
speed or load. HiGHS's clock is wall time, so the default ``time_limit`` (``TIME_LIMIT_S``,
600 s) is only a safety net, ten times the longest solve seen (a 29,541-variable budgeted
plan of an HF model on a 2x2 mesh, optimal in 15 nodes and 17.7 s on a quiet core): a 60 s
limit stopped that solve at a 24% gap on a loaded machine, and the same call planned twice
gave two plans. HiGHS sees the objective in units of a lower bound of it (the sum of each group's
cheapest option): its absolute tolerances (1e-6) then act as relative ones, where on seconds they
stopped small models' searches up to 1% from the optimum. (Dividing the byte rows by their limit
as well was tried: it changed which plan the peak re-solves end at, for the worse, on GPT-175B
stages.) The result carries the gap proven (``IlpResult.gap``: 0 when optimal), and the planner
logs it when the search stopped early.
"""

from __future__ import annotations

import hashlib

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

__all__ = ["IlpResult", "solve_ilp", "problem_key", "min_memory", "NODE_LIMIT", "TIME_LIMIT_S", "PRESOLVE_ABOVE"]


NODE_LIMIT = 1000
TIME_LIMIT_S = 600.0  # wall-clock safety net (module docstring): the node limit is what binds


class IlpResult:
    def __init__(self, choice, objective, status, message, gap=None):
        self.choice = choice
        self.objective = objective
        self.status = status
        self.message = message
        self.gap = gap  # relative gap proven between the plan and the best bound (0: optimal)

    @property
    def optimal(self) -> bool:
        return self.status == 0


def min_memory(costs_memory: list) -> float:
    """The least memory of the groups' own terms (they separate): what any assignment needs at
    least (edge terms, buffers kept for backward, only add to it)."""
    return float(sum(np.min(m) for m in costs_memory))


def solve_ilp(
    node_costs: list,
    memories: list,
    edges: list,
    *,
    budget: float | None = None,
    links: list | None = None,
    objective: str = "time",
    time_limit: float = TIME_LIMIT_S,
    gap: float = 1e-6,
    node_limit: int = NODE_LIMIT,
    forbidden: list | None = None,
    host: tuple | None = None,
    time_cap: float | None = None,
    relaxation_first: bool = True,
) -> IlpResult:
    """``edges``: list of (g, h, cls_g, cls_h, matrix) as numpy arrays; ``links``: list of
    (g, options of g, h, options of h) whose sums of ``x`` must be equal; ``forbidden``: (g, i)
    pairs whose ``x`` is fixed at 0 (options left out of this solve); ``host``: (host-memory bytes
    per group and option, host budget), a second memory row (offloaded optimizer state);
    ``time_cap``: a row holding the plan's seconds at most this (with ``objective="memory"``: the
    plan that keeps the least among those as fast as a given one); ``relaxation_first``: solve
    the LP relaxation first and skip branch and bound when it settles the problem
    (:func:`_relaxation_if_integral`; False: always branch and bound)."""
    offsets = np.cumsum([0] + [len(c) for c in node_costs])
    n_x = int(offsets[-1])
    flow_offsets = [n_x]
    for edge in edges:
        flow_offsets.append(flow_offsets[-1] + edge[4].size)
    n = flow_offsets[-1]
    x_mem = np.concatenate(memories) if memories else np.zeros(0)
    flow_mem = np.zeros(n - n_x)  # bytes an edge's buffers keep, on its flow variables
    for e, edge in enumerate(edges):
        if len(edge) > 5 and edge[5] is not None:
            flow_mem[flow_offsets[e] - n_x : flow_offsets[e + 1] - n_x] = edge[5].ravel()
    c = _objective(node_costs, x_mem, flow_mem, edges, flow_offsets, objective)
    constraints = [_choice_and_flow_rows(node_costs, edges, links, offsets, flow_offsets)]
    if budget is not None:
        mem_row = np.zeros(n)
        mem_row[:n_x] = x_mem
        mem_row[n_x:] = flow_mem
        constraints.append(LinearConstraint(mem_row.reshape(1, -1), -np.inf, budget))
    if time_cap is not None and time_cap > 0:
        time_row = np.concatenate([np.concatenate(node_costs)] + [edge[4].ravel() for edge in edges])
        # in units of the cap: HiGHS's absolute feasibility tolerance (1e-6) is then a relative one
        constraints.append(LinearConstraint(time_row.reshape(1, -1) / time_cap, -np.inf, 1.0))
    if host is not None and any(np.any(h) for h in host[0]):
        host_row = np.zeros(n)
        host_row[:n_x] = np.concatenate(host[0])
        constraints.append(LinearConstraint(host_row.reshape(1, -1), -np.inf, host[1]))
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    upper = np.ones(n)
    for g, i in forbidden or ():
        upper[offsets[g] + i] = 0.0
    # in units of a lower bound of the objective (each group's cheapest option): values near 1,
    # so HiGHS's absolute tolerances (1e-6) are relative ones (dividing by the largest coefficient
    # instead let one huge option loosen them: worse plans on large models)
    unit = float(sum(np.min(np.abs(cost)) for cost in node_costs if len(cost))) if objective != "memory" else 0.0
    unit = unit if unit > 0 else float(np.abs(c).max(initial=0.0))
    scaled, bounds = (c / unit if unit > 0 else c), Bounds(np.zeros(n), upper)
    res = _relaxation_if_integral(scaled, constraints, bounds, n_x, time_limit) if relaxation_first else None
    if res is None:
        res = milp(
            scaled,
            constraints=constraints,
            integrality=integrality,
            bounds=bounds,
            options={
                "time_limit": time_limit,
                "mip_rel_gap": gap,
                "node_limit": node_limit,
                "presolve": n > PRESOLVE_ABOVE,
                "disp": False,
            },
        )
    if res.x is None:
        return IlpResult(None, None, res.status, res.message)
    choice = [int(np.argmax(res.x[offsets[g] : offsets[g + 1]])) for g in range(len(node_costs))]
    total = float(sum(node_costs[g][i] for g, i in enumerate(choice)))
    for g, h, cls_g, cls_h, m, *_ in edges:
        total += float(m[cls_g[choice[g]], cls_h[choice[h]]])
    proven = getattr(res, "mip_gap", None)
    return IlpResult(choice, total, res.status, res.message, 0.0 if res.status == 0 else proven)


def problem_key(node_costs: list, memories: list, edges: list, **options) -> bytes:
    """A digest of everything :func:`solve_ilp` reads (its arguments, arrays by their bytes and
    shapes): two calls with the same key pose the same problem, which HiGHS solves to the same
    plan, so a caller may keep one result per key."""
    digest = hashlib.blake2b(digest_size=20)

    def feed(value) -> None:
        if isinstance(value, np.ndarray):
            digest.update(f"a{value.dtype}{value.shape}".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, (list, tuple)):
            digest.update(f"[{len(value)}".encode())
            for item in value:
                feed(item)
            digest.update(b"]")
        elif value is None or isinstance(value, (bool, int, float, str, np.number)):
            digest.update(f"{type(value).__name__}:{value!r};".encode())
        else:  # a repr may summarise (a tensor's, a sparse matrix's): two problems could share it
            raise TypeError(f"problem_key: no digest for {type(value).__name__}; pass numpy arrays or numbers")

    feed([node_costs, memories, edges, sorted(options.items())])
    return digest.digest()


PRESOLVE_ABOVE = 10_000
"""Branch and bound runs HiGHS's MIP presolve only on problems with more variables than this
(module docstring, "Presolve")."""
INTEGRAL_TOL = 1e-6
"""An ``x`` of the relaxation within this of 0 or 1 counts as integral (HiGHS's own MIP
feasibility tolerance)."""


def _relaxation_if_integral(c, constraints, bounds, n_x: int, time_limit: float):
    """The LP relaxation's result when it settles the ILP, else None (branch and bound runs).

    The relaxation settles it when it is infeasible (so is every integer point) or when its
    optimum has every ``x`` integral: then each edge's flows are the product of its two ends'
    ``x`` (the transportation rows leave no other choice), so that vertex is an integer plan
    whose objective equals the bound every integer plan is above: it is optimal. Unbudgeted
    plans and most budgets that do not bind solve this way, at about half the cost of the MILP
    (HiGHS's MIP presolve, root heuristics and symmetry detection are skipped); where the
    relaxation is fractional (a budget that binds) the MILP pays one LP more (a few percent)."""
    res = milp(c, constraints=constraints, bounds=bounds, options={"time_limit": time_limit, "disp": False})
    if res.status == 2:  # infeasible
        return res
    if res.status != 0 or res.x is None:
        return None
    x = res.x[:n_x]
    return res if bool(np.all(np.minimum(x, 1.0 - x) <= INTEGRAL_TOL)) else None


def _objective(node_costs: list, x_mem, flow_mem, edges: list, flow_offsets: list, objective: str):
    """The objective's coefficient per variable (the ``x`` first, then each edge's ``f``): seconds,
    or for ``objective="memory"`` bytes (scaled by the largest option's) with seconds as a
    tie-break."""
    n_x, n = flow_offsets[0], flow_offsets[-1]
    c = np.zeros(n)
    x_cost = np.concatenate(node_costs) if node_costs else np.zeros(0)
    scale = 1.0
    if objective == "memory":
        scale = max(1.0, float(np.abs(x_mem).max(initial=1.0)))
        c[:n_x] = x_mem / scale + 1e-9 * x_cost
    else:
        c[:n_x] = x_cost
    for e, (_g, _h, _cls_g, _cls_h, m, *_) in enumerate(edges):
        base = flow_offsets[e]
        if objective == "memory":
            c[base : base + m.size] = flow_mem[base - n_x : base - n_x + m.size] / scale + 1e-9 * m.ravel()
        else:
            c[base : base + m.size] = m.ravel()
    return c


def _choice_and_flow_rows(node_costs: list, edges: list, links, offsets, flow_offsets: list) -> LinearConstraint:
    """The equality rows: one option per group, each edge's flow leaving its producer's class
    and arriving at its consumer's, and the links."""
    n_x, n = flow_offsets[0], flow_offsets[-1]
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_entries(row_index, col_index, values):
        rows.append(row_index)
        cols.append(col_index)
        vals.append(values)

    def add_rows(low, high):
        lo.append(low)
        hi.append(high)

    n_groups = len(node_costs)
    sizes = np.diff(offsets)
    add_entries(np.repeat(np.arange(n_groups), sizes), np.arange(n_x), np.ones(n_x))
    add_rows(np.ones(n_groups), np.ones(n_groups))
    r = n_groups
    for e, (g, h, cls_g, cls_h, m, *_) in enumerate(edges):
        base = flow_offsets[e]
        n_src, n_dst = m.shape
        flows = base + np.arange(m.size)
        # producer side: one row per source class
        add_entries(r + np.repeat(np.arange(n_src), n_dst), flows, np.ones(m.size))
        add_entries(r + np.asarray(cls_g), offsets[g] + np.arange(len(cls_g)), -np.ones(len(cls_g)))
        r += n_src
        # consumer side: one row per destination class
        add_entries(r + np.tile(np.arange(n_dst), n_src), flows, np.ones(m.size))
        add_entries(r + np.asarray(cls_h), offsets[h] + np.arange(len(cls_h)), -np.ones(len(cls_h)))
        r += n_dst
        add_rows(np.zeros(n_src + n_dst), np.zeros(n_src + n_dst))
    for g, opts_g, h, opts_h in links or ():
        add_entries(np.full(len(opts_g), r), offsets[g] + np.asarray(opts_g), np.ones(len(opts_g)))
        add_entries(np.full(len(opts_h), r), offsets[h] + np.asarray(opts_h), -np.ones(len(opts_h)))
        add_rows(np.zeros(1), np.zeros(1))
        r += 1
    matrix = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, n)).tocsr()
    return LinearConstraint(matrix, np.concatenate(lo), np.concatenate(hi))
