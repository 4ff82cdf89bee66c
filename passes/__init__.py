"""Graph passes, one folder per compiler phase, in the order a model goes through them:

* ``core/``: the vocabulary every phase and the runtime share (placements and the moves
  between them, what analysis knows about a node, the rules' options). Imports nothing else.
* ``capture/``: ``nn.Module`` + example inputs -> an aten-level ``torch.fx`` graph (repeated
  layers found and reused, eager attention and MoE experts captured as one op each).
* ``analysis/``: what each node is (shapes, FLOPs, saved tensors, aliases written in place,
  the router's load), and whether a plan fits other input shapes.
* ``rules/``: the registry of op semantics: each op's placements per mesh axis.
* ``plan/``: the cost model, the strategy space, the ILP, recomputation and the stage split.
* ``lower/``: a solved graph -> one rank's program on local tensors.
* ``schedules/``: pipeline schedules as data: generated, lowered, checked and simulated.

Passes read and annotate graphs; they never start processes."""
