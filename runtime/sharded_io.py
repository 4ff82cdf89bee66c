"""Writing and reading a module's shards with ``torch.distributed.checkpoint``, shared by
:class:`runtime.parallel_module.ParallelModule` and :class:`runtime.pipeline.PipelineRunner`.

Each rank writes only its own pieces (no rank ever holds the whole model); reading asks the
checkpoint for this module's current layout, so a checkpoint written under any plan, mesh or
pipeline loads, resharded, into any other.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ShardedCheckpointIO"]


class _ShardedState(Protocol):
    def sharded_state_dict(self) -> dict: ...

    def load_sharded_state_dict(self, state: dict) -> None: ...


class ShardedCheckpointIO:
    """``save_sharded`` / ``load_sharded`` for a module with ``sharded_state_dict()`` (FQN ->
    DTensor or whole tensor) and ``load_sharded_state_dict(state)``."""

    def save_sharded(self: _ShardedState, path) -> None:
        """Each rank writes its own shards (a collective: every rank must call it)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.sharded_state_dict(), checkpoint_id=str(path))

    def load_sharded(self: _ShardedState, path) -> None:
        """Read a checkpoint of the same model written under any plan, mesh or pipeline."""
        import torch.distributed.checkpoint as dcp

        state = self.sharded_state_dict()
        dcp.load(state, checkpoint_id=str(path))
        self.load_sharded_state_dict(state)
