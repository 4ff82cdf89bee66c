"""Plans of ``objective="memory"`` (the smallest footprint, whatever it sends): their exotic
per-axis placements, trained on 4 gloo ranks against one device.

The memory objective places activations like ``[P, S(1)]`` and ``[S(1), S(0)]`` on a (2, 2)
mesh (Mistral's grouped-query attention, whose head dim has 2 elements). A gradient moved from
``[S(1), S(0)]`` to ``[R, S(1)]`` once went through ``[S(1), S(1)]``, a dim of 2 cut 4 ways, and
failed in backward. Here:

* every move between two placements that fit a tensor passes only through placements that fit
  it (all pairs on small meshes, no process group);
* that edge alone, forward and backward, on 4 ranks against slices of the whole tensors;
* labels shifted right in place (BART's and T5's ``shift_tokens_right``: a zero tensor written
  through a slice and a select, then masked in place and read): the planner keeps that alias
  class replicated (a sharded slice of it was a copy, the writes were lost), and a small model
  doing it trains like one device; ``x += y; return x`` (Falcon) is left free;
* a softmax whose reduced dim both axes cut (``[S(1), S(1)]``, XGLM's attention under the memory
  objective): its row statistics sent what the estimate says (it had halved them);
* a value written in place into a tensor made from nothing that needs a gradient
  (RecurrentGemma's scan: ``out = zeros_like(x)``, ``out[:, t] = h``): that tensor carries a
  gradient, so a partial one sent back to it is summed (it was not: wrong gradients upstream);
* Mistral planned with ``objective="memory"`` on (2, 2): loss and every gradient equal the
  single-device model's, and the communication counted at run time equals the plan's estimate.
"""

import copy
import itertools

import pytest
import torch
from parity_utils import Checks, call, check_grads_by_alias, loss_of, nested_approx_equal, prebuilt, run_checked

from benchmarks.zoo_families import RECURRENT
from partitioner import hf_families
from passes.core.placements import P, R, Shard, format_spec, spec_fits, transition_steps

TIMEOUT_S = 240
VOCAB, WIDTH = 16, 8


class ShiftedLabels(torch.nn.Module):
    """Decoder inputs made from the labels as BART and T5 make them: written in place."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 1
        shifted.masked_fill_(shifted == -100, 0)
        logits = self.head(self.embed(shifted))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class AddInPlace(torch.nn.Module):
    """``x += y`` whose result alone is read on (Falcon's ``mlp_output += attention_output``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.a(x)
        y += self.b(x)
        return y.sum()


def _labels():
    labels = torch.randint(2, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    labels[0, 3] = -100
    return labels


def test_in_place_writes_through_views_keep_their_aliases_replicated():
    from passes.analysis.mutated_aliases import mutated_alias_pins
    from passes.capture.capture import capture

    pinned = mutated_alias_pins(capture(ShiftedLabels(), (_labels(),)).graph, 2)
    assert {str(n.target) for n in pinned} == {
        "aten.new_zeros.default",
        "aten.slice.Tensor",
        "aten.copy_.default",
        "aten.select.int",
        "aten.fill_.Tensor",
        "aten.masked_fill_.Scalar",
    }, pinned
    assert all(spec == (R, R) for spec in pinned.values())
    assert mutated_alias_pins(capture(AddInPlace(), (torch.randn(4, WIDTH),)).graph, 2) == {}


@pytest.mark.parametrize("shape, mesh", [((4, 2), (2, 2)), ((2, 4), (4, 2)), ((4, 2, 3), (2, 2, 2))])
def test_moves_pass_only_through_placements_that_fit(shape, mesh):
    places = [R, P] + [Shard(d) for d in range(len(shape))]
    specs = [s for s in itertools.product(places, repeat=len(mesh)) if spec_fits(shape, s, mesh)]
    unfit = []
    for src, dst in itertools.product(specs, repeat=2):
        cur = list(src)
        for axis, p, q in transition_steps(src, dst):
            assert cur[axis] == p, (src, dst, axis, p)
            cur[axis] = q
            if not spec_fits(shape, cur, mesh):
                unfit.append(f"{format_spec(src)} -> {format_spec(dst)} via {format_spec(cur)}")
        assert tuple(cur) == dst, (src, dst, cur)
    assert not unfit, unfit[:5]


def _piece(whole, spec, comm):
    from runtime.tensor_shards import shard_runs

    runs = shard_runs(whole.shape, spec, comm)
    return whole[tuple(slice(*r[0]) for r in runs)]


def _edge_checks(comm, checks):
    """``[P, S(1)] -> [S(1), S(0)]``, gradient ``[S(1), S(0)] -> [R, S(1)]``, of a (4, 2, 3) tensor."""
    from runtime.reshard import Reshard

    torch.manual_seed(0)
    whole, whole_grad = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    src, dst = (P, Shard(1)), (Shard(1), Shard(0))
    piece = _piece(whole, src, comm)
    x = (piece if comm.coords[0] == 0 else torch.zeros_like(piece)).requires_grad_()
    edge = Reshard(comm, src, dst, grad=dst)
    out = edge(x)
    checks.close("edge forward", out, _piece(whole, dst, comm))
    out.backward(_piece(whole_grad, dst, comm))
    checks.close("edge backward", x.grad, _piece(whole_grad, (R, Shard(1)), comm))


def _shifted_labels_checks(checks):
    """The shifted-labels model planned for the least memory on (2, 2): loss and gradients."""
    import partitioner

    torch.manual_seed(0)
    model = ShiftedLabels()
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, (_labels(),), mesh=(2, 2), cluster="h100", objective="memory")
    loss, ref_loss = pm(_labels()), ref(_labels())
    loss.backward()
    ref_loss.backward()
    checks.close("shifted labels: loss", loss.detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)


class SoftmaxRows(torch.nn.Module):
    """A softmax whose reduced dim two mesh axes cut (XGLM's attention under the memory objective)."""

    def __init__(self):
        super().__init__()
        self.proj, self.softmax = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Softmax(dim=-1)

    def forward(self, x):
        return (self.softmax(self.proj(x)) * torch.arange(4.0 * WIDTH)).sum()


def _softmax_rows_checks(checks):
    """Its row statistics are all-reduced over each axis at their full row count: the estimate
    had divided them by the other axis too (as if it cut the rows); counted = estimate."""
    import partitioner
    from runtime.collectives import CommCounter

    torch.manual_seed(0)
    model, x = SoftmaxRows(), torch.randn(4, WIDTH)
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, (x,), mesh=(2, 2), cluster="h100", pins={"softmax": ["S(1)", "S(1)"]})
    with CommCounter() as counter:
        loss = pm(x)
        loss.backward()
    ref_loss = ref(x)
    ref_loss.backward()
    checks.close("softmax rows: loss", loss.detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"softmax rows: communication: {diff}", False)


def memory_objective_worker(rank, world, cfg):
    import partitioner
    from partitioner.parallelize import _device_mesh
    from runtime.collectives import CommCounter, MeshComm

    checks = Checks(rank)
    if cfg.get("small_cases", True):
        _edge_checks(MeshComm(_device_mesh(cfg["mesh"], ("a0", "a1"), "cpu")), checks)
        _shifted_labels_checks(checks)
        _softmax_rows_checks(checks)
    model, inputs = prebuilt(cfg["family"]) or hf_families.build(cfg["family"], spec=cfg.get("spec"))
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(
        model, inputs, mesh=cfg["mesh"], cluster="h100", recompute="none", zero=2, objective="memory"
    )
    with CommCounter() as counter:
        out = call(pm, inputs)
        loss_of(out).backward()
    ref_out = call(ref, inputs)
    loss_of(ref_out).backward()
    checks.close("loss", loss_of(out).detach(), loss_of(ref_out).detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"communication: {diff}", False)
    return {"failures": checks.failures}


def test_mistral_memory_objective_parity_on_2x2():
    cfg = {"family": "mistral", "mesh": (2, 2)}
    run_checked(memory_objective_worker, cfg, TIMEOUT_S, prebuild=("mistral", lambda: hf_families.build("mistral")))


def test_deit_distilled_sends_what_its_estimate_says():
    """DeiT with its distillation head: the model also averages the two heads' logits, which the
    training loss (each head's cross-entropy) never reads. Backward was priced on that average
    and on the moves of the gradients it would send (320 B more than the run sent); no gradient
    reaches it (:mod:`passes.analysis.gradient_reach`), so none is priced, and the counted
    communication equals the estimate, with loss and gradients equal to one device's."""
    from passes.analysis.analyze import analyze, info
    from passes.capture.capture import capture

    model, inputs = hf_families.build("deit_distilled")
    cap = capture(model, inputs)
    analyze(cap)
    dead = [n.name for n in cap.graph.nodes if n.users == {} and n.op == "call_function"]
    assert dead, "the averaged logits are no longer in the graph: this test checks nothing"
    assert not any(info(n).requires_grad for n in cap.graph.nodes if n.name in dead)
    cfg = {"family": "deit_distilled", "mesh": (2, 2), "small_cases": False}
    build = lambda: hf_families.build("deit_distilled")  # noqa: E731
    run_checked(memory_objective_worker, cfg, TIMEOUT_S, prebuild=("deit_distilled", build))


class CastLike(torch.nn.Module):
    """``a(x).type_as(b(x))`` (Gemma's norms): ``b(x)`` lends only its dtype."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.a(x).type_as(self.b(x)).sum()


def test_type_as_moves_nothing_for_the_tensor_it_reads_the_dtype_of():
    """Its edge had a backward priced (one move per placement change) that autograd never runs:
    Gemma's plan under objective="memory" estimated 12-29 KB more than its run sent."""
    from passes.analysis.analyze import analyze
    from passes.capture.capture import capture
    from passes.rules import op_view, rule_for

    cap = capture(CastLike(), (torch.randn(4, WIDTH),))
    analyze(cap)
    (node,) = [n for n in cap.graph.nodes if n.target is torch.ops.aten.type_as.default]
    strategies = rule_for(node).axis_strategies(op_view(node))
    assert strategies and all(s.ins[1] is None and s.ins[0] is not None for s in strategies), strategies


class ZerosBeside(torch.nn.Module):
    """``cat([zeros_like(y), y])`` (Mamba-2's padded chunk states): the zeros lend only a shape."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.a(x)
        return torch.cat([torch.zeros_like(y), y], dim=1).sum()


def test_a_factory_like_op_needs_no_gradient():
    """``zeros_like`` of a value that needs a gradient needs none itself: its edges' backward
    moves were priced (Mamba-2 under the memory objective estimated 2 all-to-alls more than its
    run sent); a factory's output is marked as needing no gradient."""
    from passes.analysis.analyze import analyze, info
    from passes.capture.capture import capture

    cap = capture(ZerosBeside(), (torch.randn(4, WIDTH),))
    analyze(cap)
    by_target = {n.target: n for n in cap.graph.nodes}
    assert info(by_target[torch.ops.aten.linear.default]).requires_grad
    assert not info(by_target[torch.ops.aten.zeros_like.default]).requires_grad
    assert info(by_target[torch.ops.aten.cat.default]).requires_grad


class FourierMix(torch.nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT, complex in between."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.fft.fftn(self.a(x), dim=(1, 2)).real.sum()


def test_a_complex_value_passes_its_gradient_on():
    """A complex value computed from one that needs a gradient needs one too: the FFT's output was
    marked as needing none (not floating point), so the edge into it moved no gradient back and
    FNet's embeddings and first layers trained on wrong gradients (a silent wrong answer)."""
    from passes.analysis.analyze import analyze, info
    from passes.capture.capture import capture

    cap = capture(FourierMix(), (torch.randn(2, 4, WIDTH),))
    analyze(cap)
    ffts = [n for n in cap.graph.nodes if "fft" in str(n.target)]
    assert ffts and all(info(n).requires_grad for n in ffts), [(n.target, info(n).requires_grad) for n in ffts]


class ScanInto(torch.nn.Module):
    """RecurrentGemma's scan: each step written in place into a ``zeros_like``, which is read on."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.a(x)
        out = torch.zeros_like(h)
        for t in range(h.shape[1]):
            out[:, t] = h[:, t] * 2
        return (out * x).sum()


# the held-out zoo's RecurrentGemma: a recurrent block (its scan is ScanInto's), an attention block
RECURRENT_GEMMA = RECURRENT["recurrent_gemma"]


def test_a_tensor_written_with_a_gradient_carries_one():
    """``zeros_like`` needs no gradient of its own, but one written into it in place makes it,
    its views and the ops reading it carry one: the edges out of it moved no gradient back, and
    RecurrentGemma planned with ``objective="memory"`` on (2, 2) (``x_branch * y_branch`` partial,
    its partial gradient sent into the scan unsummed) trained its embedding and recurrent block on
    wrong gradients, a silent wrong answer; there, loss and every gradient now equal one device's."""
    from passes.analysis.analyze import analyze, info
    from passes.capture.capture import capture

    cap = capture(ScanInto(), (torch.randn(2, 3, WIDTH),))
    analyze(cap)
    (zeros,) = [n for n in cap.graph.nodes if n.target is torch.ops.aten.zeros_like.default]
    assert info(zeros).requires_grad and all(info(u).requires_grad for u in zeros.users), list(zeros.users)
    cfg = {"family": "recurrent_gemma", "spec": RECURRENT_GEMMA, "mesh": (2, 2), "small_cases": False}
    build = lambda: hf_families.build("recurrent_gemma", spec=RECURRENT_GEMMA, seq=8)  # noqa: E731
    run_checked(memory_objective_worker, cfg, TIMEOUT_S, prebuild=("recurrent_gemma", build))
