"""Planning: prices, the strategy space, the ILP that chooses placements, stage splits."""
