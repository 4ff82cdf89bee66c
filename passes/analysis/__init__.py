"""Analysis of a captured graph: node facts, saved tensors, aliases, routing, shape checks."""
