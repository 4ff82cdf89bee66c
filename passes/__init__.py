"""Graph passes: capture, analysis, the op rule registry, the cost model, the intra-op
solver and lowering. Passes read and annotate graphs; they never start processes."""
