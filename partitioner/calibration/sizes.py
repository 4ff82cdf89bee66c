"""What ``partitioner calibrate`` measures: the sizes of a full, a quick and a test run, and the
collective kinds."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

DEFAULT_SIZES = {
    "matmul": (64, 128, 256, 512),
    "matmul_shapes": (
        (512, 64, 512),
        (2048, 64, 256),
        (1024, 256, 64),
        (2048, 256, 1024),
        (512, 1024, 128),
        (1024, 512, 1024),
    ),
    "dtypes": ("float32", "bfloat16"),
    "elementwise": (1 << 10, 1 << 14, 1 << 18, 1 << 21),
    "chains": (8, 32, 128),
    "payloads": (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23),
    "trials": 3,
    "seconds": 0.05,
    "burst": 2e-3,
    "fresh": (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 23),
    "waits": (1e-2, 3e-2, 1e-1),
    "op_tokens": 512,
    "op_width": 768,
    "attention": {"seq": (64, 256, 1024), "head_dim": (16, 32, 64, 128), "rows": 4096, "heads": 4},
    "optimizer": ((64, 64), (16, 1 << 16), (4, 1 << 20)),
}
"""Matrix sides and ``(m, k, n)`` shapes of narrow products, dtypes, elementwise elements
(float32), ops per fx program, collective payload bytes, timed trials per point, the length of
one timed loop, the computation before each collective, the bytes of the fresh allocations
timed last, the longer runs of matmuls before a tiny all-reduce (``arrival_wait``), and the
activations the rated ops are timed on (``op_tokens x op_width``; attention: a grid of sequence
lengths and head dimensions, ``heads`` heads and ``rows`` query rows (batch x heads x sequence)
at every point), and the parameter sets the optimizers step (``(tensors, elements
each)``)."""

QUICK_SIZES = {
    "matmul": (128, 256, 512),
    "matmul_shapes": ((512, 64, 512), (2048, 64, 256), (1024, 256, 64), (512, 1024, 128), (1024, 512, 1024)),
    "dtypes": ("float32", "bfloat16"),
    "elementwise": (1 << 12, 1 << 18, 1 << 21),
    "chains": (8, 64),
    "payloads": (1 << 12, 1 << 16, 1 << 20, 1 << 22),
    "trials": 3,
    "seconds": 0.015,
    "burst": 2e-3,
    "fresh": (1 << 19, 1 << 21, 1 << 23),
    "waits": (1e-2, 5e-2),
    "op_tokens": 512,
    "op_width": 768,
    "attention": {"seq": (64, 256, 1024), "head_dim": (32, 64), "rows": 4096, "heads": 4},
    "optimizer": ((64, 64), (4, 1 << 20)),
}
"""What ``cluster="cpu"`` measures when no calibration is installed (:mod:`partitioner.local_cluster`):
every figure of :data:`DEFAULT_SIZES`, on fewer sizes and shorter loops (about half a minute for
2 ranks on a 2-core machine). Three loops per figure, their median
(:func:`partitioner.calibration.timing.timed`): two loops' mean moved the priced matmuls of a GPT
layer by 5% between measurements (max - min over four, in CPU time), three loops' median by 2-3%,
for about a tenth more time. The ``1024 x 512 x 1024`` product is the intensity (128 FLOPs per
byte) of a GPT layer's linears at 512 tokens, beyond the squares' 85, where its backward runs
faster than at 85 (read flat beyond the last point, it was priced 10-15% high)."""

TINY_SIZES = {
    "matmul": (16, 32),
    "matmul_shapes": ((64, 8, 32),),
    "dtypes": ("float32",),
    "elementwise": (1 << 8, 1 << 12),
    "chains": (2, 4),
    "payloads": (1 << 8, 1 << 12),
    "trials": 1,
    "seconds": 0.002,
    "burst": 1e-4,
    "fresh": (1 << 17, 1 << 18),
    "waits": (1e-3,),
    "op_tokens": 16,
    "op_width": 32,
    "attention": {"seq": (8, 16), "head_dim": (8, 16), "rows": 32, "heads": 2},
    "optimizer": ((4, 16), (2, 256)),
}
"""A quick run for tests: the same code on sizes that take milliseconds."""
