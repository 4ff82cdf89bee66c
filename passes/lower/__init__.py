"""Lowering: a solved graph becomes one rank's program on local tensors."""
