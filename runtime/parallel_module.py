"""``ParallelModule``: one rank's lowered program with its local parameters, ready to train.

It looks like the user's model: ``named_parameters()`` gives the original FQNs (holding this
rank's shards), ``forward`` takes the same arguments and returns the same output structure
(replicated loss; other outputs as this rank's pieces), and any ``torch.optim`` optimizer
steps the shards. Inputs: by default every rank passes the global batch and the module keeps
its own piece (``local_inputs=False``); with ``local_inputs=True`` each rank passes its piece.

State moves between full and sharded forms with :func:`runtime.tensor_shards.shard_tensor` /
:func:`runtime.tensor_shards.gather_tensor`, which follow the plan's placements (and the strided
layout of fused projections that are split after the matmul, e.g. GPT's QKV).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch.utils import _pytree as pytree

from passes.core.placements import format_spec
from runtime.collectives import MeshComm
from runtime.input_checks import refuse_meta_inputs
from runtime.pretrained_io import PretrainedIO
from runtime.reshard import Reshard
from runtime.sharded_io import ShardedCheckpointIO
from runtime.tensor_shards import gather_tensor, shard_tensor

if TYPE_CHECKING:
    from partitioner.sharding_plan import ShardingPlan
    from passes.capture.capture import CapturedGraph
    from runtime.grad_sync import DeferredSyncs, GradientBuckets
    from runtime.optimizer_shards import OptimizerShards

__all__ = ["ParallelModule", "Variant"]


def run_under_autocast(program, values: list, dtype):
    """``program(*values)``, under ``torch.autocast`` in ``dtype`` (the one the graph was captured
    under, so the local ops compute in the dtypes the plan priced) unless ``dtype`` is None, and
    with ZeRO-3's saved-tensor hooks when the program has such parameters (runtime/regather.py)."""
    from runtime.regather import regather_scope

    with regather_scope(program):
        if dtype is None:
            return program(*values)
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        with torch.autocast(device.type, dtype=dtype):
            return program(*values)


@dataclass
class Variant:
    """One lowered program of the module, for one training mode and one set of input shapes."""

    program: torch.fx.GraphModule
    captured: CapturedGraph
    """The captured graph it was lowered from."""
    input_specs: dict
    """User-input placeholder name -> placement."""

    @property
    def placeholder_order(self) -> list:
        return [n.name for n in self.captured.graph.nodes if n.op == "placeholder"]

    @property
    def user_placeholders(self) -> list:
        cap = self.captured
        return [n for n in self.placeholder_order if n not in cap.params and n not in cap.buffers]


def _offloaded(program, captured) -> set:
    """FQNs of the parameters a lowered program reads from host memory (offloaded state)."""
    from runtime.optimizer_shards import ZERO1_KEY

    entries = (program.meta.get(ZERO1_KEY) or {}).items()
    return {captured.params[name] for name, (_, _, host) in entries if host}


class ParallelModule(ShardedCheckpointIO, PretrainedIO, torch.nn.Module):
    """A rank's share of a model, running the plan's lowered program.

    Note: the program bakes in the training mode and the input shapes it was captured with.
    Inputs of other shapes, or a call in the other mode (``eval()``), run another *variant*:
    the ``specialize(training, args, kwargs)`` callable attached by :meth:`attach_specializer`
    captures and lowers the model for them under the same parameter placements, once per
    (mode, shapes); without one, such a call is refused with the difference named.
    """

    # Set with object.__setattr__ (kept out of nn.Module's parameter and submodule registries).
    plan: ShardingPlan
    comm: MeshComm
    _specialize: Callable[[bool, tuple, dict], Variant] | None
    _buckets: GradientBuckets
    _deferred: DeferredSyncs
    _shards: OptimizerShards
    _base: Variant
    _variants: dict[tuple, Variant]

    def __init__(
        self,
        *,
        program,
        plan,
        comm: MeshComm,
        captured,
        local_params: dict,
        local_buffers: dict,
        specs: dict,
        strided: dict,
        local_inputs: bool,
        global_shapes: dict,
    ):
        super().__init__()
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "_specialize", None)
        self.local_inputs = local_inputs
        self._specs = specs  # FQN (params, buffers) or input placeholder name -> spec
        self._global_shapes = dict(global_shapes)  # FQN -> whole shape
        self._strided = strided  # FQN -> {axis: pieces}
        self._param_fqns, self._buffer_fqns = list(local_params), list(local_buffers)
        self._non_persistent: frozenset = frozenset()  # set by attach_pretrained, from the model
        # where the program computes; weights whose optimizer state is offloaded live in host memory
        # (pinned on CUDA), so the user's optimizer keeps their state and runs their step there
        self._device = next((v.device for v in local_params.values()), torch.device("cpu"))
        host = _offloaded(program, captured)
        frozen = captured.frozen_params()
        shared = {}  # tied weights come as one local tensor under several FQNs: one Parameter
        for fqn, value in local_params.items():
            key = id(value)
            if key not in shared:
                if fqn in host and value.device.type != "cpu":
                    value = value.to("cpu").pin_memory() if torch.cuda.is_available() else value.to("cpu")
                shared[key] = torch.nn.Parameter(value, requires_grad=fqn not in frozen)
            self._owner(fqn).register_parameter(fqn.rpartition(".")[2], shared[key])
        for fqn, value in local_buffers.items():
            self._owner(fqn).register_buffer(fqn.rpartition(".")[2], value)
        from runtime.grad_sync import DeferredSyncs, GradientBuckets

        object.__setattr__(self, "_buckets", GradientBuckets(comm))
        object.__setattr__(self, "_deferred", DeferredSyncs())
        from runtime.optimizer_shards import OptimizerShards

        object.__setattr__(self, "_shards", OptimizerShards(comm, self._deferred))
        base = Variant(program, captured, {name: specs[name] for name in captured.user_inputs if name in specs})
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_variants", {})
        example = self._global_inputs(base, self._example_flat(captured), local=False)
        self._add_variant(self._key(captured.training, example), base)
        self._install_state_hooks()

    def _add_variant(self, key, variant: Variant) -> None:
        """Register a lowered program; its plain gradient all-reduces join the shared buckets."""
        program, cap = variant.program, variant.captured
        from runtime.optimizer_shards import ZERO1_KEY

        for placeholder, (compute, stored, host) in (program.meta.get(ZERO1_KEY) or {}).items():
            fqn = cap.params[placeholder]
            param = self._get(fqn)
            if host and param.device.type != "cpu":
                raise ValueError(
                    f"{fqn}: a program of this model reads it from host memory (offloaded), but it is on "
                    f"{param.device}; plan its other programs with the same host_memory_budget"
                )
            self._shards.add(param, compute, stored, fqn, self._strided.get(fqn), device=self._device)
        for module_name, placeholder in (program.meta.get("partita.bucketable_grads") or {}).items():
            module = cast(Reshard, program.get_submodule(module_name))  # lower_to_local's edge modules
            module.sync, module.sync_param = self._buckets, self._get(cap.params[placeholder])
        held = program.meta.get(ZERO1_KEY) or {}  # their gradients accumulate in compute copies
        for edge in program.modules():  # every parameter edge whose backward sends: no_sync defers it
            if (
                isinstance(edge, Reshard)
                and edge.param_edge is not None
                and edge.param_edge not in held
                and edge.backward_communicates
            ):
                edge.sync_param, edge.deferred = self._get(cap.params[edge.param_edge]), self._deferred
            if isinstance(edge, Reshard) and edge.param_edge is not None:
                edge.reduce_dtype = self._buckets.reduce_dtype
        program.train(self.training)
        self._variants[key] = variant

    def reduce_gradients_in(self, dtype: torch.dtype | None) -> None:
        """Reduce parameter gradients across ranks in ``dtype`` (the precision's reduce dtype; None:
        in their own dtype), in every program, the bucketed all-reduces included."""
        self._buckets.reduce_dtype = dtype
        self._shards.reduce_dtype = dtype
        for variant in self._variants.values():
            for edge in variant.program.modules():
                if isinstance(edge, Reshard) and edge.param_edge is not None:
                    edge.reduce_dtype = dtype

    def offloaded(self) -> list:
        """FQNs of the parameters kept in host memory with their optimizer state (offloaded)."""
        return [fqn for fqn in self._param_fqns if fqn in _offloaded(self._base.program, self._base.captured)]

    def compute_copies(self) -> list:
        """The whole copies ZeRO-1 weights are computed with (their shards are the parameters),
        gathered first where their shards changed (a collective: every rank must call it)."""
        self._shards.refresh()
        return self._shards.copies()

    def no_sync(self):
        """A context in which backward accumulates gradients without syncing them (as DDP's and
        FSDP's ``no_sync``), for all but the last micro-step of an optimizer step: each parameter
        edge whose backward communicates keeps its unreduced gradient, summed over the calls (for
        a weight stored sharded and gathered for use: at full size), and adds nothing to ``.grad``;
        the first backward outside syncs those sums with its own gradient, in one collective per
        edge. Activation collectives (Megatron's all-reduces) still run in every call."""
        return self._deferred.deferred()

    def free_source_weights(self) -> int:
        """Release the whole weights of the model this module was built from; returns the bytes.

        The user's module (kept to lower other input shapes) and its capture hold its parameters
        and buffers at full size: beside this rank's shards, a whole copy of the model on every
        rank, which no plan's memory estimate counts. This empties the storage of each of them
        that this module does not use itself (a weight passed through unmoved is kept), as
        FSDP2's ``fully_shard`` leaves the module it shards: the source model cannot run
        afterwards, and this module serves only the input shapes and modes it has programs for."""
        own = {t.untyped_storage().data_ptr() for t in [*self.parameters(), *self.buffers(), *self._shards.copies()]}
        sources: list = []
        model = getattr(self._specialize, "model", None)  # partitioner.specialize.Specializer's source
        if model is not None:
            sources += [*model.parameters(), *model.buffers()]
        for variant in self._variants.values():
            exported = variant.captured.exported
            if exported is not None:
                sources += [t for t in exported.state_dict.values() if isinstance(t, torch.Tensor)]
        freed = 0
        for t in sources:
            storage = t.untyped_storage()
            if storage.data_ptr() not in own and storage.nbytes() and t.device.type != "meta":
                freed += storage.nbytes()
                storage.resize_(0)
        object.__setattr__(self, "_specialize", None)
        object.__setattr__(self, "_sources_freed", True)
        return freed

    def attach_specializer(self, specialize) -> None:
        """``specialize(training, args, kwargs) -> Variant``: lowers the model for a call whose mode
        or input shapes no program here serves yet (``partitioner.specialize.Specializer``)."""
        object.__setattr__(self, "_specialize", specialize)

    def stored_placements(self) -> dict:
        """FQN -> the placement each parameter and buffer is stored in."""
        return {fqn: self._specs[fqn] for fqn in self._param_fqns + self._buffer_fqns}

    def strided_layouts(self) -> dict:
        """FQN -> {axis: pieces} for weights stored in the strided layout (fused projections)."""
        return dict(self._strided)

    # -- structure ---------------------------------------------------------------------------
    def _owner(self, fqn: str) -> torch.nn.Module:
        module: torch.nn.Module = self
        for part in fqn.split(".")[:-1]:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        return module

    def _get(self, fqn: str):
        owner = self._owner(fqn)
        leaf = fqn.rpartition(".")[2]
        return owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers[leaf]

    @property
    def program(self) -> torch.fx.GraphModule:
        """The lowered per-rank program for the example inputs (``.code`` is its Python source)."""
        return self._base.program

    @property
    def variants(self) -> dict:
        """(training, input shapes) -> the lowered program serving them (one per call signature seen)."""
        return {key: v.program for key, v in self._variants.items()}

    def train(self, mode: bool = True):
        super().train(mode)
        for variant in getattr(self, "_variants", {}).values():
            variant.program.train(mode)
        return self

    # -- running -------------------------------------------------------------------------------
    @staticmethod
    def _example_flat(cap) -> list:
        """The example inputs the graph was captured with, as fake tensors (shapes only)."""
        by_name = {n.name: n for n in cap.graph.nodes}
        return [by_name[name].meta.get("val") for name in cap.user_inputs]

    def _global_inputs(self, variant: Variant, flat, *, local=None) -> list:
        """Whole shapes of the user's flat inputs (``local``, by default ``local_inputs``:
        pieces scaled back up by the number of shards)."""
        local = self.local_inputs if local is None else local
        shapes: list[str | tuple[tuple[int, ...], str]] = []  # repr of a non-tensor, or (shape, dtype)
        for name, x in zip(variant.user_placeholders, flat):
            if not isinstance(x, torch.Tensor):
                shapes.append(repr(x))
                continue
            shape = list(x.shape)
            if local and name in variant.input_specs:
                for axis, p in enumerate(variant.input_specs[name]):
                    if getattr(p, "dim", None) is not None and p.dim < len(shape):
                        shape[p.dim] *= self.comm.shape[axis]
            shapes.append((tuple(shape), str(x.dtype)))
        return shapes

    @staticmethod
    def _key(training: bool, shapes) -> tuple:
        return (bool(training), tuple(shapes))

    def _flatten(self, args, kwargs):
        refuse_meta_inputs(args, kwargs)
        in_spec = self._base.captured.exported_program.call_spec.in_spec
        if kwargs and in_spec is not None:
            from torch.export._tree_utils import reorder_kwargs

            expected = set(in_spec.child(1).context)
            if set(kwargs) != expected:
                raise TypeError(
                    f"the parallel model was captured with the keyword arguments {sorted(expected)}; got "
                    f"{sorted(kwargs)} (missing {sorted(expected - set(kwargs))}, unexpected "
                    f"{sorted(set(kwargs) - expected)}). Pass the same arguments as the example inputs, or make "
                    f"the parallel model with example inputs of this form."
                )
            kwargs = reorder_kwargs(kwargs, in_spec)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if in_spec is not None and spec != in_spec:
            raise TypeError(
                f"the parallel model was captured with inputs structured as {in_spec}; got {spec}. "
                "Pass the same arguments (names and nesting) as the example inputs."
            )
        return flat, args, kwargs

    def _variant_for(self, flat, args, kwargs) -> Variant:
        key = self._key(self.training, self._global_inputs(self._base, flat))
        variant = self._variants.get(key)
        if variant is not None:
            return variant
        base_key = next(iter(self._variants))
        if self._specialize is None:
            mode = "training" if self.training else "eval"
            raise ValueError(
                f"this parallel model was lowered for {base_key} and is now called in {mode} mode with "
                f"inputs {key[1]}; build it with auto_parallelize to serve other shapes and modes"
                + (" (and do not call free_source_weights)" if getattr(self, "_sources_freed", False) else "")
            )
        if not self.local_inputs:
            call_args, call_kwargs = args, kwargs
        else:  # capture needs whole inputs: zeros of the global shapes
            whole = [
                torch.zeros(shape[0], dtype=x.dtype, device=x.device) if isinstance(x, torch.Tensor) else x
                for x, shape in zip(flat, key[1])
            ]
            call_args, call_kwargs = pytree.tree_unflatten(whole, pytree.tree_flatten((args, kwargs))[1])
        variant = self._specialize(self.training, call_args, call_kwargs)
        self._add_variant(key, variant)
        return variant

    def forward(self, *args, **kwargs):
        flat, args, kwargs = self._flatten(args, kwargs)
        variant = self._variant_for(flat, args, kwargs)
        cap = variant.captured
        user = iter(flat)
        values = []
        zero1 = variant.program.meta.get("partita.zero1") or {}
        if zero1:  # ZeRO-1 weights: compute copies gathered again where the shards changed
            self._shards.refresh()
        for name in variant.placeholder_order:
            if name in zero1:
                values.append(self._shards.copy_of(self._get(cap.params[name])))
            elif name in cap.params:
                values.append(self._get(cap.params[name]))
            elif name in cap.buffers:
                values.append(self._get(cap.buffers[name]))
            else:
                x = next(user)
                if isinstance(x, torch.Tensor) and not self.local_inputs:
                    x = shard_tensor(x, variant.input_specs[name], self.comm)
                values.append(x)
        outputs = run_under_autocast(variant.program, values, cap.autocast_dtype)
        object.__setattr__(self, "_last_variant", variant)
        flat_out = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        sig = cap.exported_program.graph_signature
        mutations = dict(getattr(sig, "buffers_to_mutate", {}) or {})
        n_mut = len(flat_out) - len(sig.user_outputs)
        for value, (_, fqn) in zip(flat_out[:n_mut], mutations.items()):
            with torch.no_grad():
                self._get(fqn).copy_(value)
        return pytree.tree_unflatten(flat_out[n_mut:], cap.exported_program.call_spec.out_spec)

    def gather_outputs(self, outputs):
        """``outputs`` of the last call as one device returns them: every tensor this rank holds a
        piece of (logits under a plan that cuts the batch or the vocabulary) gathered whole, on
        every rank (a collective: every rank must call it). The loss is replicated already. The
        gathered values are detached (for evaluation and logging; train through the loss)."""
        variant = getattr(self, "_last_variant", self._base)
        specs = variant.program.meta.get("partita.output_specs", [])
        flat, tree = pytree.tree_flatten(outputs)
        shapes = variant.program.meta.get("partita.output_shapes", [None] * len(specs))
        specs, shapes = specs[len(specs) - len(flat) :], shapes[len(shapes) - len(flat) :]  # buffer updates first
        whole = [
            gather_tensor(x.detach(), spec, self.comm, whole_shape=shape)
            if isinstance(x, torch.Tensor) and spec is not None
            else x
            for x, spec, shape in zip(flat, specs, shapes)
        ]
        return pytree.tree_unflatten(whole, tree)

    def shard_batch(self, batch):
        """Cut a global batch (same structure as the example inputs) to this rank's pieces."""
        args, kwargs = (batch, {}) if isinstance(batch, tuple) else ((), dict(batch))
        flat, spec = pytree.tree_flatten((args, kwargs))
        base = self._base
        pieces = [
            shard_tensor(x, base.input_specs[n], self.comm) if isinstance(x, torch.Tensor) else x
            for x, n in zip(flat, base.user_placeholders)
        ]
        args, kwargs = pytree.tree_unflatten(pieces, spec)
        return args if isinstance(batch, tuple) else kwargs

    # -- state -----------------------------------------------------------------------------------
    def placement_of(self, fqn: str) -> str:
        return format_spec(self._specs[fqn])

    def full_state_dict(self) -> dict:
        """Every parameter and persistent buffer, whole, on every rank (a collective): the keys of
        the model's own ``state_dict()`` (non-persistent buffers, such as rotary ``inv_freq``, left
        out as the model leaves them out), so ``model.load_state_dict(pm.full_state_dict())``
        loads strictly into the model this was built from."""
        out = {}
        for fqn in self._param_fqns + self._buffer_fqns:
            if fqn in self._non_persistent:
                continue
            out[fqn] = gather_tensor(self._get(fqn).detach(), self._specs[fqn], self.comm, self._strided.get(fqn))
        return out

    def full_grads(self) -> dict:
        """Every parameter's gradient, whole, on every rank (a collective). A parameter no gradient
        reached (frozen, or read by nothing the loss depends on) has no entry, as its ``.grad`` is
        None on one device: every rank runs the same program, so every rank leaves out the same."""
        out = {}
        for fqn in self._param_fqns:
            grad = self._get(fqn).grad
            if grad is not None:
                out[fqn] = gather_tensor(grad, self._specs[fqn], self.comm, self._strided.get(fqn))
        return out

    def load_full_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Copy this rank's pieces out of a full (single-device) state dict."""
        missing = [f for f in self._param_fqns if f not in state]
        if strict and missing:
            raise KeyError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for fqn in self._param_fqns + self._buffer_fqns:
                if fqn in state:
                    self._get(fqn).copy_(shard_tensor(state[fqn], self._specs[fqn], self.comm, self._strided.get(fqn)))

    def attach_pretrained(self, layout) -> None:
        """Record the model's checkpoint layout (``save_pretrained``) and mirror its buffers'
        persistence: a buffer the model keeps out of its ``state_dict()`` is kept out of this
        module's too."""
        super().attach_pretrained(layout)
        self._non_persistent = frozenset(layout.non_persistent) if layout is not None else frozenset()
        for fqn in self._buffer_fqns:
            owner, leaf = self._owner(fqn), fqn.rpartition(".")[2]
            if fqn in self._non_persistent:
                owner._non_persistent_buffers_set.add(leaf)
            else:
                owner._non_persistent_buffers_set.discard(leaf)

    def _pipeline_position(self) -> tuple:
        """(group, coordinate, size) of the pipeline axis: none here, one stage."""
        return (None, 0, 1)

    # state as checkpoints see it: the global view (runtime/sharded_state.py)
    def state_layouts(self) -> dict:
        """FQN -> (this rank's tensor, its ``TensorLayout``) for every parameter and buffer (tied
        names: one tensor under each name)."""
        from runtime.sharded_state import TensorLayout

        def layout(fqn):
            shape = tuple(self._global_shapes[fqn])
            return TensorLayout(self.comm, tuple(self._specs[fqn]), shape, self._strided.get(fqn) or {})

        return {fqn: (self._get(fqn), layout(fqn)) for fqn in self._param_fqns + self._buffer_fqns}

    def _install_state_hooks(self) -> None:
        """``state_dict()`` gives the global view, ``load_state_dict()`` takes any form back, and
        the parameters join the registry optimizers' state hooks read."""
        from runtime.sharded_state import register_parameters

        self.register_state_dict_post_hook(ParallelModule._state_dict_to_global)
        self.register_load_state_dict_pre_hook(ParallelModule._state_dict_to_local)
        layouts = self.state_layouts()
        register_parameters((fqn, *layouts[fqn]) for fqn in self._param_fqns)

    @staticmethod
    def _state_dict_to_global(module, state_dict, prefix, local_metadata) -> None:
        """State-dict post-hook: each parameter and buffer as a DTensor over the job's mesh (strided
        or 1-device ones whole, gathered: a collective), as ``torch.distributed.checkpoint`` needs."""
        for fqn, (_, layout) in module.state_layouts().items():
            if prefix + fqn in state_dict:
                state_dict[prefix + fqn] = layout.to_global(state_dict[prefix + fqn])

    @staticmethod
    def _state_dict_to_local(module, state_dict, prefix, *unused) -> None:
        """Load pre-hook: DTensors of any layout, whole tensors or this rank's pieces, to this
        rank's pieces (the checks of ``load_state_dict`` then see local shapes)."""
        for fqn, (_, layout) in module.state_layouts().items():
            if prefix + fqn in state_dict:
                state_dict[prefix + fqn] = layout.to_local(state_dict[prefix + fqn], prefix + fqn)

    def sharded_state_dict(self) -> dict:
        """Parameters and buffers as DTensors over this job's DeviceMesh (for
        ``torch.distributed.checkpoint``); strided-layout tensors are stored whole. The same view
        ``state_dict()`` gives, keyed by FQN."""
        return {fqn: layout.to_global(tensor.detach()) for fqn, (tensor, layout) in self.state_layouts().items()}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Copy this rank's pieces out of ``state`` (FQN -> a DTensor of any layout, a whole
        tensor or this rank's piece); FQNs it lacks are left as they are."""
        with torch.no_grad():
            for fqn, (tensor, layout) in self.state_layouts().items():
                if fqn in state:
                    tensor.copy_(layout.to_local(state[fqn], fqn))

    def local_parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
