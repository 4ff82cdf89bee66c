"""What runs on a rank: collectives with autograd, local kernels for sharded ops, the
per-rank module that trains a lowered program, and a launcher for local gloo ranks.

``runtime/`` never searches plans: it executes the placements a ShardingPlan names.
"""
