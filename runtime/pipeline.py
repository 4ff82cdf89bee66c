"""The pipeline executor: one interpreter runs a rank's action list (decision 8).

Each rank owns one or more pipeline stages (:class:`StageProgram`: a lowered stage program with
its local parameters). ``PipelineRunner.train_step(batch)`` cuts the batch into microbatches
and walks the rank's actions from :mod:`passes.pipeline_schedules`:

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
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = ["StageProgram", "PipelineRunner"]


class StageProgram(torch.nn.Module):
    """One stage on this rank: its lowered program, local parameters and input order."""

    def __init__(self, index, program, inputs, outputs, params: dict, buffers: dict, input_specs, comm, plan,
                 strided=None):
        super().__init__()
        self.strided = strided or {}
        object.__setattr__(self, "program", program)
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "plan", plan)
        self.index, self.inputs, self.outputs = index, list(inputs), list(outputs)
        self.input_specs = input_specs
        self._param_names, self._buffer_names = dict(params), dict(buffers)   # placeholder -> FQN
        self.weights = torch.nn.ParameterDict()
        self._keys = {}
        for placeholder, (fqn, value) in params.items():
            key = fqn.replace(".", "__")
            self.weights[key] = torch.nn.Parameter(value)
            self._keys[placeholder] = key
        for placeholder, (fqn, value) in buffers.items():
            key = "buf__" + fqn.replace(".", "__")
            self.register_buffer(key, value)
            self._keys[placeholder] = key

    def named_fqn_parameters(self):
        for placeholder, (fqn, _) in self._param_names.items():
            yield fqn, self.weights[self._keys[placeholder]]

    def tied_weights(self, names):
        for placeholder in self._param_names:
            if placeholder in names:
                yield placeholder, self.weights[self._keys[placeholder]]

    def gathered(self, grads: bool) -> dict:
        """Whole parameters (or their gradients) of this stage, gathered over its sub-mesh."""
        from runtime.parallel_module import gather_tensor
        out = {}
        for placeholder, (fqn, _) in self._param_names.items():
            p = self.weights[self._keys[placeholder]]
            value = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach()
            out[fqn] = gather_tensor(value, self.input_specs[placeholder], self.comm, self.strided.get(fqn))
        return out

    def run(self, values: dict) -> dict:
        args = []
        for name in self.inputs:
            if name in self._param_names:
                args.append(self.weights[self._keys[name]])
            elif name in self._buffer_names:
                args.append(getattr(self, self._keys[name]))
            else:
                args.append(values[name])
        out = self.program(*args)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return dict(zip(self.outputs, out))


class PipelineRunner(torch.nn.Module):
    """Runs a schedule's actions for this rank; ``train_step(batch)`` -> the batch loss."""

    def __init__(self, *, stages: dict, schedule, stage_graphs, comm_pp, peer_rank, microbatches: int,
                 input_names: list, in_spec, loss_name: str, carried_meta: dict, plan, tied=()):
        super().__init__()
        self.stages = torch.nn.ModuleDict({str(k): v for k, v in stages.items()})
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "plan", plan)
        self.stage_graphs = stage_graphs
        self.comm_pp = comm_pp            # (group, this rank's pp coordinate, pp size)
        self.peer_rank = peer_rank        # stage -> global rank of its owner at my sub-mesh coordinates
        self.microbatches = microbatches
        self.input_names, self.in_spec, self.loss_name = input_names, in_spec, loss_name
        self.carried_meta = carried_meta  # value name -> (local shape, dtype)
        self.tied = list(tied)            # (group of the ranks holding a tied weight, its placeholder names)
        self.trace = []

    # -- helpers -----------------------------------------------------------------------------
    def _split(self, batch):
        args, kwargs = (batch, {}) if isinstance(batch, (tuple, list)) else ((), dict(batch))
        if kwargs and self.in_spec is not None:
            from torch.export._tree_utils import reorder_kwargs
            kwargs = reorder_kwargs(kwargs, self.in_spec)
        flat, _ = pytree.tree_flatten((tuple(args), kwargs))
        m = self.microbatches
        per = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                if x.shape[0] % m:
                    raise ValueError(f"batch dim {x.shape[0]} does not split into {m} microbatches")
                per.append(x.chunk(m, dim=0))
            else:
                per.append([x] * m)
        return [dict(zip(self.input_names, [p[i] for p in per])) for i in range(m)]

    def _tag(self, edge, mb, kind, i):
        """Unique per message: the stage pair (its lower stage), microbatch, direction, tensor."""
        stage = edge
        return ((mb * 64 + stage) * 2 + (kind == "B")) * 256 + i

    def _send(self, values, dst, stage, mb, kind):
        return [dist.isend(v.detach().contiguous(), dst, tag=self._tag(stage, mb, kind, i)) for i, v in enumerate(values)]

    def _post_recv(self, names, src, stage, mb, kind):
        """Post the receives for one message now; returns (buffers, works) to wait on later."""
        bufs, works = [], []
        for i, name in enumerate(names):
            shape, dtype = self.carried_meta[name]
            buf = torch.empty(shape, dtype=dtype)
            works.append(dist.irecv(buf, src, tag=self._tag(stage, mb, kind, i)))
            bufs.append(buf)
        return bufs, works

    def _post_all_receives(self, actions) -> dict:
        """Every receive of the step, posted before the first action so transfers start as soon
        as the peer sends (gloo moves data only once a receive is posted)."""
        posted = {}
        for a in actions:
            if a.kind == "RECV_F":
                names = self.stage_graphs[a.stage].receives
                posted[("F", a.stage, a.microbatch)] = self._post_recv(
                    names, self.peer_rank[a.peer], min(a.stage, a.peer), a.microbatch, "F")
            elif a.kind == "RECV_B":
                names = self.stage_graphs[a.stage].sends
                posted[("B", a.stage, a.microbatch)] = self._post_recv(
                    names, self.peer_rank[a.peer], min(a.stage, a.peer), a.microbatch, "B")
        return posted

    @staticmethod
    def _wait(posted):
        bufs, works = posted
        for work in works:
            work.wait()
        return bufs

    # -- the interpreter ---------------------------------------------------------------------
    def train_step(self, batch):
        micro = self._split(batch)
        m = self.microbatches
        received, grads_in, ctx, pending, losses, deferred = {}, {}, {}, [], {}, {}
        actions = self.schedule.actions[self.comm_pp[1]]
        self.trace = []
        posted = self._post_all_receives(actions)
        for action in actions:
            s, mb, kind = action.stage, action.microbatch, action.kind
            graph = self.stage_graphs[s]
            t0 = time.perf_counter()
            if kind == "F":
                values = dict(micro[mb])
                leaves = {}
                for name, tensor in zip(graph.receives, received.pop((s, mb), [])):
                    if tensor.is_floating_point():
                        tensor.requires_grad_(True)
                    leaves[name] = tensor
                values.update(leaves)
                outputs = self.stages[str(s)].run(values)
                ctx[(s, mb)] = (leaves, {**leaves, **outputs})
                if s == len(self.stage_graphs) - 1:
                    losses[mb] = outputs[self.loss_name]
            elif kind == "SEND_F":
                _, produced = ctx[(s, mb)]
                pending += self._send([produced[n] for n in graph.sends], self.peer_rank[action.peer],
                                      min(s, action.peer), mb, "F")
            elif kind == "RECV_F":
                received[(s, mb)] = self._wait(posted.pop(("F", s, mb)))
            elif kind in ("B", "I"):
                leaves, produced = ctx[(s, mb)]
                if s == len(self.stage_graphs) - 1:
                    tensors, grads = [losses[mb]], [torch.full_like(losses[mb], 1.0 / m)]
                else:
                    pairs = [(produced[n], g) for n, g in zip(graph.sends, grads_in.pop((s, mb), []))
                             if produced[n].requires_grad]
                    tensors, grads = [p for p, _ in pairs], [g for _, g in pairs]
                activation = [leaf for leaf in leaves.values() if leaf.requires_grad]
                if kind == "B":
                    if tensors:
                        torch.autograd.backward(tensors, grads)
                    ctx[(s, mb)] = (leaves, None)
                else:   # input gradients only; keep the graph for W
                    if tensors and activation:
                        torch.autograd.backward(tensors, grads, inputs=activation, retain_graph=True)
                    ctx[(s, mb)] = (leaves, None)
                    deferred[(s, mb)] = (tensors, grads)
            elif kind == "W":   # weight gradients, then the graph can go
                tensors, grads = deferred.pop((s, mb))
                params = [p for p in self.stages[str(s)].parameters() if p.requires_grad]
                if tensors and params:
                    torch.autograd.backward(tensors, grads, inputs=params)
            elif kind == "SEND_B":
                leaves = ctx[(s, mb)][0]
                out = [leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])
                       for n in graph.receives]
                pending += self._send(out, self.peer_rank[action.peer], min(s, action.peer), mb, "B")
                if (s, mb) not in deferred:
                    ctx.pop((s, mb))
            elif kind == "RECV_B":
                grads_in[(s, mb)] = self._wait(posted.pop(("B", s, mb)))
            # absolute times, so ranks on one host line up whatever moment each entered the step
            self.trace.append((str(action), t0, time.perf_counter()))
        for work in pending:
            work.wait()
        for group, names in self.tied:    # a tied weight's gradient is the sum over the stages using it
            for stage in self.stages.values():
                for placeholder, weight in stage.stage.tied_weights(names):
                    if weight.grad is None:
                        weight.grad = torch.zeros_like(weight)
                    dist.all_reduce(weight.grad, group=group)
        group, coord, size = self.comm_pp
        last_owner = self.schedule.stage_to_rank[len(self.stage_graphs) - 1]
        loss = torch.stack([losses[i].detach() for i in range(m)]).mean() if losses else torch.zeros(())
        dist.broadcast(loss, group_src=last_owner, group=group)
        return loss

    # -- state ---------------------------------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for stage in self.stages.values():
            yield from stage.named_fqn_parameters()

    def _everywhere(self, grads: bool) -> dict:
        mine = {}
        for stage in self.stages.values():
            mine.update(stage.stage.gathered(grads))
        parts = [None] * self.comm_pp[2]
        dist.all_gather_object(parts, mine, group=self.comm_pp[0])
        out = {}
        for part in parts:
            out.update(part)
        return out

    def full_state_dict(self) -> dict:
        """Every parameter, whole, on every rank (collective over stages and sub-meshes)."""
        return self._everywhere(grads=False)

    def full_grads(self) -> dict:
        """Every parameter's gradient, whole, on every rank."""
        return self._everywhere(grads=True)
