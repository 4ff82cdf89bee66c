"""The pipeline executor: one interpreter runs a rank's action list (decision 8).

Each rank owns one or more pipeline stages (:class:`StageProgram`: a lowered stage program with
its local parameters). ``PipelineRunner.train_step(batch)`` cuts the batch into microbatches
and walks the rank's actions from :mod:`passes.schedules`:

* ``F``: run the stage on the microbatch's inputs (activations received from the previous
  stage become leaves that require grad) and keep what backward needs;
* ``B``: backpropagate the gradients received for the values this stage sent (on the last
  stage: the loss, scaled by 1/microbatches) into the parameters and the received leaves;
* ``I`` / ``W`` (zero-bubble): the same split in two, input gradients first (the graph is kept),
  weight gradients later;
* ``SEND_*`` / ``RECV_*``: point-to-point ``isend`` / ``irecv`` with the peer stage's rank at the
  same coordinates of the stage sub-mesh; every message has its own tag, every wait a timeout
  (the process group's).

Values that skip stages are carried through the stages between (a carried leaf is sent on as
itself, so its gradient comes back through the same path). Gradients land in ``.grad`` as after
a single-device ``loss.backward()`` on the whole batch; the loss is broadcast to every rank.

Parameter gradients are reduced by one of two rules, decided per parameter edge (each use of
a parameter in a stage program) from its backward's placements:

* **reduced once per step** when the backward communicates and leaves each device no less than
  it gets (a data-parallel all-reduce onto replicated storage, ``P -> R``): the edge holds its
  unreduced gradient in the stage's :class:`runtime.grad_sync.DeferredSyncs` during the stage's
  ``B`` / ``W`` actions; once the rank has issued every action of the step (its last sends
  included, so the stage before never waits for the reduction) each held sum is moved in one
  collective, the rank's stages in order (the moves are linear). Holding costs the gradient's
  size, which the parameter's storage has too.
* **reduced in every microbatch** when the backward shrinks the gradient (a reduce-scatter onto
  a weight stored sharded, ZeRO-2 / ZeRO-3: ``Reshard.backward_shrinks``): holding it would keep
  a full-size sum beside the shard all step, so each ``B`` / ``W`` moves it at once and the
  shard accumulates in ``.grad``. It sends ``m`` collectives of the gradient's size per step
  (``m`` microbatches) instead of one: time traded for the memory. A mixed
  edge (a reduce-scatter on one axis and an all-reduce on another) follows this rule whole, its
  all-reduce too, so nothing beyond the shard in ``.grad`` outlives a microbatch's backward.

**ZeRO-1 weights** (plan record ``stored``; :mod:`runtime.optimizer_shards`) follow the first
rule in their own way: the program reads a whole compute copy, whose gradient sums over the
step's microbatches in the copy (its edges leave it ``Partial``: nothing moves per microbatch);
after the held sums are moved, the copies' sums are reduce-scattered into the shards' ``.grad``
(one flat collective per mesh axis), the user's optimizer steps the shards (its state is
sharded), and the next ``train_step`` all-gathers the copies whose shards changed before its
first action. So a step sends one reduce-scatter and one all-gather of each such weight, however
many microbatches it runs: ``zero1_collectives``, priced once per step with the held syncs.

Tied weights are unaffected: each use's edge follows its own rule into the one ``.grad``, and
the sum over the stages holding the weight is all-reduced after the step, as before. The cost
model prices the same: ``Estimate.grad_sync_s`` (the held-back all-reduces) once per step, the
reduce-scatters with the per-microbatch collectives, and ``MemoryBreakdown.held_gradients``
the held sums only (:func:`passes.plan.cost_model.grad_held_back`, the estimate's side of the rule).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from passes.core.placements import replicated
from runtime.collectives import MeshComm
from runtime.grad_sync import DeferredSyncs
from runtime.input_checks import refuse_meta_inputs
from runtime.optimizer_shards import ZERO1_KEY, OptimizerShards
from runtime.parallel_module import run_under_autocast
from runtime.pretrained_io import PretrainedIO
from runtime.reshard import Reshard
from runtime.sharded_io import ShardedCheckpointIO
from runtime.tensor_shards import gather_tensor, shard_tensor
from runtime.unstaged_state import UnstagedState

if TYPE_CHECKING:
    from partitioner.sharding_plan import ShardingPlan

__all__ = ["StageProgram", "PipelineRunner"]


class StageProgram(torch.nn.Module):
    """One stage on this rank: its lowered program, local parameters and input order.

    ``input_specs``: placeholder -> the stage plan's placement (a ZeRO-1 weight's: its optimizer
    shard's). The stage cuts the user inputs it is given (whole microbatches) to its plan's
    placements; ``activations`` (values from the previous stage) arrive already as this rank's
    piece and are used as they are.

    ``held_syncs``: the gradient all-reduces its ``B`` / ``W`` actions hold back over a step;
    ``optimizer_shards``: its ZeRO-1 weights (:mod:`runtime.optimizer_shards`), whose shards are
    the parameters and whose whole compute copies the program reads; their gradients sum in the
    copies over the step's microbatches (the reduction is held with the syncs)."""

    # Set with object.__setattr__ (kept out of nn.Module's submodule registry).
    program: torch.fx.GraphModule
    comm: MeshComm
    plan: ShardingPlan
    optimizer_shards: OptimizerShards
    held_syncs: DeferredSyncs
    _zero1: set

    def __init__(
        self,
        index,
        program,
        inputs,
        outputs,
        params: dict,
        buffers: dict,
        input_specs,
        comm,
        plan,
        strided=None,
        activations=(),
        autocast_dtype=None,
        frozen=(),
    ):
        super().__init__()
        self.autocast_dtype = autocast_dtype  # the graph was captured, and runs, under autocast in it
        self.strided = strided or {}
        self.activations = frozenset(activations)
        object.__setattr__(self, "program", program)
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "plan", plan)
        self.index, self.inputs, self.outputs = index, list(inputs), list(outputs)
        self.input_specs = input_specs
        self._param_names, self._buffer_names = dict(params), dict(buffers)  # placeholder -> (FQN, tensor)
        self.held_syncs = DeferredSyncs()
        object.__setattr__(self, "optimizer_shards", OptimizerShards(comm, self.held_syncs))
        self._zero1 = set()  # placeholders of ZeRO-1 weights (read as compute copies)
        self.weights = torch.nn.ParameterDict()
        self._keys = {}
        shared = {}  # tied names come as one local tensor: one Parameter (its gradient sums both uses)
        for placeholder, (fqn, value) in params.items():
            if id(value) not in shared:
                shared[id(value)] = fqn.replace(".", "__")
                # a parameter of requires_grad=False (``frozen``: FQNs) stays so: never trained
                self.weights[shared[id(value)]] = torch.nn.Parameter(value, requires_grad=fqn not in frozen)
            self._keys[placeholder] = shared[id(value)]
        for placeholder, (fqn, value) in buffers.items():
            key = "buf__" + fqn.replace(".", "__")
            self.register_buffer(key, value)
            self._keys[placeholder] = key
        self.add_zero1_weights(program)

    def add_zero1_weights(self, program) -> None:
        """Register the ZeRO-1 weights ``program`` (the stage's, or a variant's) reads as compute copies."""
        for placeholder, (compute, stored, host) in (program.meta.get(ZERO1_KEY) or {}).items():
            fqn = self._param_names[placeholder][0]
            if host:
                raise ValueError(f"{fqn}: pipeline stages keep their optimizer state on the device (not offloaded)")
            self.optimizer_shards.add(self.param(placeholder), compute, stored, fqn, self.strided.get(fqn))
            self._zero1.add(placeholder)

    def _distinct_params(self):
        """(placeholder, FQN, Parameter), once per Parameter (tied names share one)."""
        seen = set()
        for placeholder, (fqn, _) in self._param_names.items():
            key = self._keys[placeholder]
            if key not in seen:
                seen.add(key)
                yield placeholder, fqn, self.weights[key]

    def named_fqn_parameters(self):
        for _, fqn, p in self._distinct_params():
            yield fqn, p

    def placed_parameters(self):
        """(placeholder, Parameter, its placement on the stage mesh), once per Parameter."""
        for placeholder, _, p in self._distinct_params():
            yield placeholder, p, self.input_specs[placeholder]

    def tied_weights(self, names):
        for placeholder, _, p in self._distinct_params():
            if placeholder in names:
                yield placeholder, p

    def gathered(self, grads: bool) -> dict:
        """Whole parameters (every name of a tied one) and buffers, or the parameters' gradients
        (once per Parameter, under its first name), of this stage, gathered over its sub-mesh;
        with ``grads``, a parameter no gradient reached has no entry (its ``.grad`` is None)."""
        out, whole = {}, {}
        for placeholder, (fqn, _) in self._param_names.items():
            key = self._keys[placeholder]
            if grads and key in whole:
                continue
            if key not in whole:  # one gather per Parameter
                p = self.weights[key]
                value = p.grad if grads else p.detach()
                # the same on every rank of the stage: they run one program
                spec, strided = self.input_specs[placeholder], self.strided.get(fqn)
                whole[key] = None if value is None else gather_tensor(value, spec, self.comm, strided)
            if whole[key] is not None:
                out[fqn] = whole[key]
        for placeholder, (fqn, _) in self._buffer_names.items() if not grads else ():
            value = getattr(self, self._keys[placeholder]).detach()
            out[fqn] = gather_tensor(value, self.input_specs[placeholder], self.comm, self.strided.get(fqn))
        return out

    def state_layouts(self) -> dict:
        """FQN -> (this rank's tensor, its ``TensorLayout`` on the stage mesh) for the stage's
        parameters (every name of a tied one) and buffers."""
        from runtime.sharded_state import TensorLayout

        out = {}
        for placeholder, (fqn, _) in self._param_names.items():
            tensor = self.param(placeholder)
            out[fqn] = (
                tensor,
                TensorLayout.from_local(self.comm, self.input_specs[placeholder], tensor, self.strided.get(fqn)),
            )
        for placeholder, (fqn, _) in self._buffer_names.items():
            tensor = getattr(self, self._keys[placeholder])
            out[fqn] = (
                tensor,
                TensorLayout.from_local(self.comm, self.input_specs[placeholder], tensor, self.strided.get(fqn)),
            )
        return out

    def weight_meeting_points(self):
        """For a real input/weight split of backward: the ops whose inputs join data (stage
        inputs) with parameter-only values, each with the parameters behind those values.

        Their output gradients are computed anyway by the input-gradient pass; a weight pass that
        starts from them (``backward(y, dy, inputs=params)``) walks only the weight branches.
        Parameters reached from several such ops are left to a full pass (so nothing is counted
        twice). Returns ([(node name, params)], rest); :meth:`run_recording` returns those
        nodes' values from the forward."""
        if hasattr(self, "_meeting"):
            return self._meeting
        graph = self.program.graph
        kind, params_of = {}, {}
        for node in graph.nodes:
            if node.op == "placeholder":
                is_param = node.name in self._param_names
                kind[node] = "param" if is_param else ("const" if node.name in self._buffer_names else "data")
                params_of[node] = {node.name} if is_param else set()
                continue
            if node.op == "output":
                continue
            inputs = node.all_input_nodes
            kinds = {kind[a] for a in inputs}
            kind[node] = "data" if "data" in kinds else ("param" if "param" in kinds else "const")
            params_of[node] = set().union(*(params_of[a] for a in inputs)) if inputs else set()
        points, seen, shared = [], {}, set()
        for node in graph.nodes:
            if kind.get(node) != "data" or node.op == "placeholder":
                continue
            behind = (
                set().union(*(params_of[a] for a in node.all_input_nodes if kind[a] == "param"))
                if any(kind[a] == "param" for a in node.all_input_nodes)
                else set()
            )
            if behind:
                points.append((node, behind))
                for name in behind:
                    if name in seen:
                        shared.add(name)
                    seen[name] = node
        points = [(n.name, b - shared) for n, b in points if b - shared]
        rest = set(self._param_names) - {name for _, b in points for name in b}
        self._meeting = (points, rest)
        return self._meeting

    def param(self, placeholder):
        return self.weights[self._keys[placeholder]]

    def compute_tensor(self, placeholder):
        """What the program reads for a parameter: its compute copy (ZeRO-1), else the parameter."""
        p = self.param(placeholder)
        return self.optimizer_shards.copy_of(p) if placeholder in self._zero1 else p

    def add_variant(self, shapes, program) -> None:
        """Serve microbatches of input ``shapes`` (a key of :meth:`PipelineRunner._shapes_key`) with
        ``program``: the same plan lowered at those shapes (same nodes, same weights)."""
        self.__dict__.setdefault("_variants", {})[shapes] = program
        self.add_zero1_weights(program)

    def _program(self, shapes):
        return self.program if shapes is None else self.__dict__["_variants"][shapes]

    def run_recording(self, values: dict, names, shapes=None) -> tuple:
        """``run``, also returning the values of the nodes ``names`` (for the weight pass).

        Runs a copy of the program whose output also lists those nodes (generated once per set of
        names), so recording costs nothing over a plain forward."""
        names = tuple(names)
        cache = self.__dict__.setdefault("_recording_programs", {})
        if (shapes, names) not in cache:
            cache[shapes, names] = _with_extra_outputs(self._program(shapes), names)
        out = run_under_autocast(cache[shapes, names], self._args(values), self.autocast_dtype)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        n = len(out) - len(names)
        return dict(zip(self.outputs, out[:n])), dict(zip(names, out[n:]))

    def _args(self, values):
        args = []
        for name in self.inputs:
            if name in self._param_names:
                args.append(self.compute_tensor(name))
            elif name in self._buffer_names:
                args.append(getattr(self, self._keys[name]))
            else:
                args.append(self._cut(name, values[name]))
        return args

    def _cut(self, name, value):
        """This rank's piece of a user input under the stage plan (activations: as received)."""
        spec = self.input_specs.get(name)
        if (
            not isinstance(value, torch.Tensor)
            or spec is None
            or name in self.activations
            or tuple(spec) == replicated(len(spec))
        ):
            return value
        return shard_tensor(value, spec, self.comm)

    def run(self, values: dict, shapes=None) -> dict:
        """The stage on one microbatch; ``shapes``: a variant's key (None: the captured shapes)."""
        out = run_under_autocast(self._program(shapes), self._args(values), self.autocast_dtype)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return dict(zip(self.outputs, out))


def _with_extra_outputs(program: torch.fx.GraphModule, names) -> torch.fx.GraphModule:
    """A copy of ``program`` (sharing its submodules) that returns its outputs, then ``names``.
    Stage programs come from lowering, with fx's plain code generation (no pytree output spec
    that more outputs would break)."""
    if type(program.graph._codegen) is not torch.fx.graph.CodeGen:
        raise TypeError(f"cannot add outputs to a program with {type(program.graph._codegen).__name__} code generation")
    graph = torch.fx.Graph()
    env = {}
    for node in program.graph.nodes:
        if node.op == "output":
            result = node.args[0]
            result = list(result) if isinstance(result, (list, tuple)) else [result]
            mapped = torch.fx.map_arg(tuple(result), lambda a: env[a])
            graph.output(tuple(mapped) + tuple(env[n] for n in _nodes_named(env, names)))
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    copy = torch.fx.GraphModule(program, graph)
    copy.meta.update(program.meta)  # e.g. ZeRO-3 edges (runtime/regather.py)
    return copy


def _nodes_named(env, names):
    by_name = {node.name: node for node in env}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise KeyError(f"the stage program has no nodes named {missing}")
    return [by_name[n] for n in names]


def _distinct(tensors) -> list:
    """``tensors`` without repeats (tied placeholders share one Parameter), in order."""
    return list({id(t): t for t in tensors}.values())


def _recv_key(action) -> tuple:
    """("F" | "B", stage, microbatch) of a receive: the message it waits for."""
    return ("F" if action.kind == "RECV_F" else "B", action.stage, action.microbatch)


@dataclass
class _Step:
    """What one ``train_step`` keeps between actions (keyed by (stage, microbatch))."""

    micro: list
    shapes: list  # per microbatch: its variant's key (None: the shapes the stages were captured at)
    weights: list  # per microbatch: its share of the batch's samples (the loss is their weighted sum)
    received: dict = field(default_factory=dict)  # activations in, before their F
    grads_in: dict = field(default_factory=dict)  # gradients in, before their B / I
    ctx: dict = field(default_factory=dict)  # (leaves, produced values) between F and B
    losses: dict = field(default_factory=dict)  # microbatch -> loss (last stage)
    recorded: dict = field(default_factory=dict)  # weight ops' outputs, F -> I
    deferred: dict = field(default_factory=dict)  # what W needs, I -> W
    pending: list = field(default_factory=list)  # send works, waited at the end


class PipelineRunner(ShardedCheckpointIO, PretrainedIO, torch.nn.Module):
    """Runs a schedule's actions for this rank; ``train_step(batch)`` -> the batch loss."""

    unstaged: UnstagedState

    def __init__(
        self,
        *,
        stages: dict,
        schedule,
        stage_graphs,
        comm_pp,
        peer_rank,
        microbatches: int,
        input_names: list,
        in_spec,
        loss_name: str,
        carried_meta: dict,
        plan,
        tied=(),
        unstaged: UnstagedState | None = None,
        specialize=None,
    ):
        super().__init__()
        self.stages = torch.nn.ModuleDict({str(k): v for k, v in stages.items()})
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "plan", plan)
        self.stage_graphs = stage_graphs
        self.comm_pp = comm_pp  # (group, this rank's pp coordinate, pp size)
        self.peer_rank = peer_rank  # stage -> global rank of its owner at my sub-mesh coordinates
        self.microbatches = microbatches
        self.input_names, self.in_spec, self.loss_name = input_names, in_spec, loss_name
        self.carried_meta = carried_meta  # value name -> (local shape, dtype)
        # microbatch input shapes the stages were not captured at -> receive buffers' (shape, dtype);
        # their programs live in the stages (StageProgram.add_variant)
        self._carried_at: dict = {}
        # (whole user inputs of one microbatch, in the user's format) -> ({stage: program}, carried
        # meta): the plan lowered at other shapes (partitioner.pipeline_shapes); None: refused
        self.specialize = specialize
        self.tied = list(tied)  # (group of the ranks holding a tied weight, its placeholder names)
        # the model's names no stage holds: tied aliases, and unread state on the first pipeline rank
        object.__setattr__(self, "unstaged", unstaged or UnstagedState())
        self.trace = []
        self._split_backward = any(a.kind == "W" for acts in schedule.actions for a in acts)
        self._register_parameters()
        # a stage's all-reduced gradient syncs (and its ZeRO-1 reductions) are held back in its
        # B / W actions and moved after the rank's last action; reduce-scatters onto weights
        # stored sharded run in every one
        self._held: dict[int, DeferredSyncs] = {}
        for key, module in self.stages.items():
            self._held[int(key)] = cast(StageProgram, module).held_syncs
            self._hold_syncs(int(key), cast(StageProgram, module).program)

    def _hold_syncs(self, s: int, program) -> None:
        """Wire ``program``'s all-reduced parameter gradient syncs to stage ``s``'s held sums."""
        stage = cast(StageProgram, self.stages[str(s)])
        for edge in program.modules():
            if not isinstance(edge, Reshard) or edge.param_edge is None:
                continue
            if edge.backward_communicates and not edge.backward_shrinks:
                edge.sync_param, edge.deferred = stage.param(edge.param_edge), self._held[s]

    # -- helpers -----------------------------------------------------------------------------
    def _microbatch_shapes(self) -> dict:
        """User input name -> the (whole, not sharded) microbatch shape its stages were captured for."""
        from passes.core.node_info import info

        shapes = {}
        for g in self.stage_graphs:
            for node in g.captured.graph.find_nodes(op="placeholder"):
                if node.name in self.input_names and info(node).shape is not None:
                    shapes[node.name] = tuple(info(node).shape)
        return shapes

    def _split(self, batch) -> tuple:
        """The batch cut into the schedule's microbatches like ``torch.tensor_split`` (the first
        ``B % m`` one sample more): (microbatches by input name, the variant key of each, each
        one's share of the samples). Shapes other than the captured ones get their programs here."""
        args, kwargs = (batch, {}) if isinstance(batch, (tuple, list)) else ((), dict(batch))
        refuse_meta_inputs(args, kwargs)
        if kwargs and self.in_spec is not None:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self.in_spec)
        flat, tree = pytree.tree_flatten((tuple(args), kwargs))
        m = self.microbatches
        per: list = []
        for name, x in zip(self.input_names, flat):
            if isinstance(x, torch.Tensor) and x.dim():
                if x.shape[0] < m:
                    raise ValueError(
                        f"input '{name}' has {x.shape[0]} samples on dim 0, fewer than this pipeline's {m} "
                        f"microbatches: a microbatch would be empty; pass at least {m} samples (for a "
                        f"DataLoader's last batch: drop_last=True)"
                    )
                per.append(x.tensor_split(m, dim=0))
            else:
                per.append([x] * m)
        micro = [[p[i] for p in per] for i in range(m)]
        samples = [next((len(x) for x in mb if isinstance(x, torch.Tensor) and x.dim()), 1) for mb in micro]
        shapes = [self._variant(mb, tree) for mb in micro]
        weights = [n / sum(samples) for n in samples]
        return [dict(zip(self.input_names, mb)) for mb in micro], shapes, weights

    def _variant(self, microbatch: list, tree):
        """The variant key of a microbatch (None: the captured shapes), its programs made on first use."""
        expected = self._microbatch_shapes()
        shapes = tuple(
            (name, tuple(x.shape)) for name, x in zip(self.input_names, microbatch) if isinstance(x, torch.Tensor)
        )
        if all(expected.get(name, shape) == shape for name, shape in shapes):
            return None
        if shapes not in self._carried_at:
            if self.specialize is None:
                raise ValueError(
                    f"microbatch inputs {dict(shapes)} differ from the shapes this pipeline's stages were captured "
                    f"at ({expected}), and this runner cannot lower its plan at others; pass batches of the "
                    f"example inputs' shape"
                )
            args, kwargs = pytree.tree_unflatten(microbatch, tree)
            programs, self._carried_at[shapes] = self.specialize(kwargs if kwargs else args)
            for s, program in programs.items():
                cast(StageProgram, self.stages[str(s)]).add_variant(shapes, program)
                self._hold_syncs(s, program)
        return shapes

    def _tag(self, edge, mb, kind, i):
        """Unique per message: the stage pair (its lower stage), microbatch, direction, tensor."""
        if edge >= 64 or i >= 256:
            raise ValueError(
                f"pipeline messages are tagged for up to 64 stages and 256 tensors per message; "
                f"got stage {edge}, tensor {i}"
            )
        return ((mb * 64 + edge) * 2 + (kind == "B")) * 256 + i

    def _send(self, values, dst, stage, mb, kind):
        return [
            dist.isend(v.detach().contiguous(), dst, tag=self._tag(stage, mb, kind, i)) for i, v in enumerate(values)
        ]

    def _post_recv(self, names, src, stage, mb, kind, shapes=None):
        """Post the receives for one message now; returns (buffers, works) to wait on later."""
        bufs, works = [], []
        carried = self.carried_meta if shapes is None else self._carried_at[shapes]
        for i, name in enumerate(names):
            shape, dtype = carried[name]
            buf = torch.empty(shape, dtype=dtype)
            works.append(dist.irecv(buf, src, tag=self._tag(stage, mb, kind, i)))
            bufs.append(buf)
        return bufs, works

    def _post_all_receives(self, actions, shapes: list) -> dict:
        """Every receive of the step, posted before the first action so transfers start as soon
        as the peer sends (gloo moves data only once a receive is posted)."""
        posted = {}
        for a in actions:
            if a.is_recv:
                key = _recv_key(a)
                graph = self.stage_graphs[a.stage]
                names = graph.receives if key[0] == "F" else graph.sends
                peer, edge = self.peer_rank[a.peer], min(a.stage, a.peer)
                posted[key] = self._post_recv(names, peer, edge, a.microbatch, key[0], shapes[a.microbatch])
        return posted

    @staticmethod
    def _wait(posted):
        bufs, works = posted
        for work in works:
            work.wait()
        return bufs

    # -- the interpreter ---------------------------------------------------------------------
    def train_step(self, batch):
        micro, shapes, weights = self._split(batch)
        step = _Step(micro=micro, shapes=shapes, weights=weights)
        actions = self.schedule.actions[self.comm_pp[1]]
        self.trace = []
        own = [cast(StageProgram, self.stages[str(s)]) for s in sorted(self._held)]
        for stage in own:  # ZeRO-1: the copies whose shards the optimizer stepped, gathered again
            stage.optimizer_shards.refresh()
        posted = self._post_all_receives(actions, shapes)
        for action in actions:
            t0 = time.perf_counter()
            if action.makes_weight_grads:
                with self._held[action.stage].deferred():
                    self._run(action, step, posted)
            else:
                self._run(action, step, posted)
            # absolute times, so ranks on one host line up whatever moment each entered the step
            self.trace.append((str(action), t0, time.perf_counter()))
        # the step's held gradient sums, one reduction per edge, once this rank has issued every
        # action (its last input gradients are on their way: the stage before does not wait);
        # then the ZeRO-1 copies' sums, reduce-scattered into their shards (one flat collective)
        for stage in own:
            stage.held_syncs.flush()
            stage.optimizer_shards.flush()
        for work in step.pending:
            work.wait()
        for group, names in self.tied:  # a tied weight's gradient is the sum over the stages using it
            for stage in self.stages.values():
                for _, weight in stage.tied_weights(names):
                    if weight.grad is None:
                        weight.grad = torch.zeros_like(weight)
                    dist.all_reduce(weight.grad, group=group)
        group, coord, size = self.comm_pp
        last_owner = self.schedule.stage_to_rank[len(self.stage_graphs) - 1]
        losses = step.losses
        # each microbatch's loss weighted by its share of the samples: the mean over the batch
        share = step.weights
        loss = sum(share[i] * losses[i].detach() for i in range(self.microbatches)) if losses else torch.zeros(())
        dist.broadcast(loss, group_src=last_owner, group=group)
        return loss

    def forward(self, *args, **kwargs):
        """A pipeline runs forward and backward together, microbatch by microbatch: refused."""
        raise TypeError(
            "this model was parallelized as a pipeline (PipelineRunner): a step is "
            "`loss = model.train_step(batch)` (forward, backward and gradient reduction of every "
            "microbatch; then optimizer.step()), not model(batch); give auto_parallelize a mesh= "
            "without pipeline= for a module called like the original"
        )

    def _run(self, action, step, posted):
        s, mb, kind = action.stage, action.microbatch, action.kind
        graph = self.stage_graphs[s]
        if kind == "F":
            self._forward(s, mb, step)
        elif kind == "SEND_F":
            _, produced = step.ctx[(s, mb)]
            step.pending += self._send(
                [produced[n] for n in graph.sends], self.peer_rank[action.peer], min(s, action.peer), mb, "F"
            )
        elif kind == "RECV_F":
            step.received[(s, mb)] = self._wait(posted.pop(_recv_key(action)))
        elif kind in ("B", "I"):
            self._backward(s, mb, step, weights_too=kind == "B")
        elif kind == "W":
            self._weight_pass(s, mb, step)
        elif kind == "SEND_B":
            leaves = step.ctx[(s, mb)][0]
            out = [
                leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n]) for n in graph.receives
            ]
            step.pending += self._send(out, self.peer_rank[action.peer], min(s, action.peer), mb, "B")
            if (s, mb) not in step.deferred:
                step.ctx.pop((s, mb))
        elif kind == "RECV_B":
            step.grads_in[(s, mb)] = self._wait(posted.pop(_recv_key(action)))

    def _forward(self, s, mb, step):
        graph = self.stage_graphs[s]
        values = dict(step.micro[mb])
        leaves = {}
        for name, tensor in zip(graph.receives, step.received.pop((s, mb), [])):
            if tensor.is_floating_point():
                tensor.requires_grad_(True)
            leaves[name] = tensor
        values.update(leaves)
        stage = self.stages[str(s)]
        if self._split_backward:
            points, _ = stage.weight_meeting_points()
            outputs, step.recorded[(s, mb)] = stage.run_recording(values, [n for n, _ in points], step.shapes[mb])
        else:
            outputs = stage.run(values, step.shapes[mb])
        step.ctx[(s, mb)] = (leaves, {**leaves, **outputs})
        if s == len(self.stage_graphs) - 1:
            step.losses[mb] = outputs[self.loss_name]

    def _backward(self, s, mb, step, weights_too: bool):
        """``B`` (``weights_too``): the whole backward of the stage for one microbatch. ``I``: the
        received activations' gradients only; the graph is kept, and the output gradients of the
        weight ops (captured by hooks on their recorded outputs) are kept for ``W``."""
        graph = self.stage_graphs[s]
        leaves, produced = step.ctx[(s, mb)]
        if s == len(self.stage_graphs) - 1:
            loss = step.losses[mb]
            tensors, grads = [loss], [torch.full_like(loss, step.weights[mb])]
        else:
            pairs = [
                (produced[n], g)
                for n, g in zip(graph.sends, step.grads_in.pop((s, mb), []))
                if produced[n].requires_grad
            ]
            tensors, grads = [p for p, _ in pairs], [g for _, g in pairs]
        activation = [leaf for leaf in leaves.values() if leaf.requires_grad]
        step.ctx[(s, mb)] = (leaves, None)
        if weights_too:
            if tensors:
                torch.autograd.backward(tensors, grads)
            return
        captured = {}
        hooks = [
            y.register_hook(lambda g, name=name: captured.__setitem__(name, g))
            for name, y in step.recorded.get((s, mb), {}).items()
            if isinstance(y, torch.Tensor) and y.requires_grad
        ]
        if tensors and activation:
            torch.autograd.backward(tensors, grads, inputs=activation, retain_graph=True)
        for hook in hooks:
            hook.remove()
        step.deferred[(s, mb)] = (tensors, grads, captured, step.recorded.pop((s, mb), {}))

    def _weight_pass(self, s, mb, step):
        """``W``: parameter gradients from the weight ops' captured output gradients; parameters
        no input gradient passes through get one full pass from the stage outputs."""
        tensors, grads, captured, seen = step.deferred.pop((s, mb))
        stage = self.stages[str(s)]
        points, rest = stage.weight_meeting_points()
        rest = set(rest)
        for name, params in points:
            weights = _distinct(stage.compute_tensor(p) for p in params if stage.param(p).requires_grad)
            if name in captured and weights:
                torch.autograd.backward([seen[name]], [captured[name]], inputs=weights, retain_graph=True)
            elif name not in captured:
                rest |= params
        leftover = _distinct(stage.compute_tensor(p) for p in rest if stage.param(p).requires_grad)
        if tensors and leftover:
            torch.autograd.backward(tensors, grads, inputs=leftover)

    # -- state ---------------------------------------------------------------------------------
    def stages_holding(self, placeholder: str) -> int:
        """How many stages hold a copy of this parameter (more than one for a weight shared by
        stages on several ranks, whose copies each hold the whole gradient after a step)."""
        for _, names in self.tied:
            if placeholder in names:
                return sum(1 for g in self.stage_graphs if names & set(g.inputs))
        return 1

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for stage in self.stages.values():
            yield from stage.named_fqn_parameters()

    def _everywhere(self, grads: bool) -> dict:
        mine = {}
        for stage in self.stages.values():
            mine.update(cast(StageProgram, stage).gathered(grads))
        if not grads:  # unread state: no gradient ever reaches it
            mine.update({name: t.detach() for name, t in self.unstaged.tensors.items()})
        parts: list = [None] * self.comm_pp[2]  # filled by all_gather_object
        dist.all_gather_object(parts, mine, group=self.comm_pp[0])
        out = {}
        for part in parts:
            out.update(part)
        if grads:  # each Parameter's once, as the stages hold them
            return out
        out = self.unstaged.with_aliases(out)
        return self.unstaged.in_model_order(out) if self.unstaged.names else out

    def full_state_dict(self) -> dict:
        """Every parameter and persistent buffer, whole, on every rank (collective over stages and
        sub-meshes): the keys of the model's own ``state_dict()``, tied names and state no stage
        reads included, so ``model.load_state_dict(runner.full_state_dict())`` loads strictly."""
        return self._everywhere(grads=False)

    def full_grads(self) -> dict:
        """Every parameter's gradient, whole, on every rank: a tied weight's once, under the name
        a stage reads it by; a parameter no gradient reached has no entry."""
        return self._everywhere(grads=True)

    def _pipeline_position(self) -> tuple:
        """(group, this rank's coordinate, size) of the pipeline axis (``save_pretrained``)."""
        return tuple(self.comm_pp)

    # state as checkpoints see it: the global view of each stage's tensors (runtime/sharded_state.py)
    def _own_stages(self) -> list[StageProgram]:
        return [cast(StageProgram, stage) for stage in self.stages.values()]

    def _register_parameters(self) -> None:
        """The stages' parameters join the registry optimizers' state hooks read."""
        from runtime.sharded_state import register_parameters

        for stage in self._own_stages():
            params = {id(p) for _, p in stage.named_fqn_parameters()}
            register_parameters(
                (fqn, t, layout) for fqn, (t, layout) in stage.state_layouts().items() if id(t) in params
            )

    def state_layouts(self) -> dict:
        """FQN -> (this rank's tensor, its ``TensorLayout``) for the parameters and buffers of this
        rank's stages (a weight two of its stages use: the first stage's tensor)."""
        out: dict = {}
        for stage in self._own_stages():
            for fqn, entry in stage.state_layouts().items():
                out.setdefault(fqn, entry)
        out.update(self.unstaged.layouts())
        return self.unstaged.with_aliases(out)

    def sharded_state_dict(self) -> dict:
        """This rank's stages' parameters and buffers, FQN -> DTensor over the stage mesh (whole
        tensors where the stage mesh is one device or the layout is strided)."""
        return {fqn: layout.to_global(t.detach()) for fqn, (t, layout) in self.state_layouts().items()}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Copy this rank's pieces out of ``state`` (FQN -> a DTensor of any layout, a whole tensor
        or this rank's piece) into every stage holding the FQN."""
        with torch.no_grad():
            for stage in self._own_stages():
                for fqn, (tensor, layout) in stage.state_layouts().items():
                    if fqn in state:
                        tensor.copy_(layout.to_local(state[fqn], fqn))
        self.unstaged.load(state)
