"""``partitioner calibrate``: measure this machine into a cluster file the cost model prices with.

Algorithm
---------
1. **Ranks are the devices.** ``ranks`` local gloo processes start (``runtime.launch.run_on_ranks``,
   one thread each) and every figure is measured with all of them working at once, as they do in
   a job: on a machine with fewer cores than ranks, each rank's share of the cores is its device.
2. **Compute.** Every rank times ``torch.mm`` of ``n x n`` matrices for each dtype and size, an
   elementwise ``add`` over buffers of several sizes, and forward + backward of fx programs of
   ``k`` tiny elementwise ops that require grad (the median of ``trials`` timed loops, slowest
   rank: not the best loop, as a step meets the machine's typical share, not its best moment). The
   cost model prices an op as ``op_overhead_s + max(flops / peak[dtype], bytes /
   memory_bandwidth)`` in forward and again per backward product
   (:func:`passes.plan.cost_model.compute_time`): the programs' time per op (a line ``t = a + k *
   u``) is two overheads, ``u = 2 op_overhead_s`` (what an op costs a lowered program, fx and
   autograd included, beyond its arithmetic); the elementwise times give ``memory_bandwidth``
   (``t = a + bytes * u``, ``a`` a bare call's cost), the matmul times ``peak[dtype]`` and its
   curve: square and narrow ``m x k x n`` products, each at its arithmetic intensity ``I =
   flops / bytes`` (inputs and output) reaching ``r = flops / (t - a)``; ``peak`` is the best
   ``r`` and ``matmul_curve[dtype]`` the points ``(I, r / peak)`` (the mean where shapes share an
   intensity), which the cost model reads piecewise linearly in ``log I``: a narrow product (a
   tensor-parallel shard, a small head dimension) is priced at the rate its shape reaches, not at
   the square matmuls' peak.
   **As a step meets them.** The elementwise samples and a linear layer's forward run on the next
   of distinct operand sets that fill more than a core's cache, what each call makes kept
   (:func:`~partitioner.calibration.timing.cold_calls`): a step's ops read what it streamed through
   the cache earlier and write fresh memory; fx programs of views give ``view_overhead_s`` as those
   of tiny ops give ``op_overhead_s``.
   **A contraction's forward and backward.** Every matmul shape is also timed as a linear layer's
   forward recording for autograd (the bias added, the node kept), backward and zero-bubble weight
   pass through autograd (:mod:`~partitioner.calibration.measure_backward`:
   transposed operands, a reduction over the tokens, the bias sum, ``.grad`` stores, autograd's
   own work), and each gives a curve of the same kind, ``forward_curve``, ``backward_curve`` and
   ``weight_curve`` (:func:`~partitioner.calibration.fit.pass_curves`): the rate of each product
   (the forward's FLOPs) beyond the fixed cost the cost model adds to it, as a fraction of the same
   peak, by the forward product's intensity. The cost model prices a contraction's forward, its
   backward products and its ``W`` pass at them (``compute_time(..., product=...)``).
   **Rated ops.** Ops that reach neither the matmul curve nor memory bandwidth (on a CPU:
   activations whose ``erf``, ``exp`` or ``tanh`` dominate, normalisations with several passes
   over their input, a fused attention's blocked kernel) are timed forward + backward through
   autograd on a transformer's activations (``op_tokens x op_width``; attention on a grid of
   sequence lengths and head dimensions), and each op's rule is asked what it counts (its FLOPs
   and the backward multiples the cost model charges, :func:`passes.plan.cost_model.backward_factor`).
   ``op_rates[dtype][op]`` is those FLOPs over the time beyond each pass's ``op_overhead_s``, so
   the cost model prices each sample at the time it took: one number for an activation or a
   norm; for attention, whose kernel here runs at 21-87 GFLOP/s (float32) depending on the
   sequence length and head dimension (short sequences and small or odd head dimensions are
   slow), the grid of rates, read at an attention's own shape
   (:func:`passes.plan.cost_model.measured_rate`; flat beyond the grid, so a 32k-token attention
   reads the 1,024-token rate).
   **Optimizer steps.** AdamW and SGD step over sets of float32 parameters (many tiny tensors, a
   few large ones): the line ``t = tensors * tensor_s + bytes / bandwidth`` (bytes as the cost
   model counts them) is ``optimizer_steps[optimizer]``. On a CPU torch steps one tensor at a
   time (tens of microseconds of Python per tensor for AdamW) and streams the state from DRAM,
   well below the cache-resident elementwise ops' bandwidth the roofline would use.
   In fresh processes (fixing the threshold cannot be undone, and a used heap serves requests
   from its freed blocks), with glibc's mmap threshold fixed as a CPU job under a memory budget
   runs (``runtime/host_memory.py``), an ``add`` writing a fresh output is
   timed against one writing a kept buffer, at sizes above the threshold: the difference per
   byte (the median over sizes) is ``fresh_page_s_per_byte``, the zero-filled pages of a
   fresh mapping, which the cost model adds per large tensor an op allocates in such a job.
3. **Collectives.** Every kind the runtime issues (all-reduce, all-gather, reduce-scatter,
   all-to-all, and a ring exchange of sends and receives) is timed at several payloads on the
   whole group and, with 4 ranks or more, on pairs too, **as a training step meets it**: each
   call follows a burst of computation (``burst`` seconds of small matmuls on every rank), and
   only the call is timed, from the moment its rank enters it (the mean over ranks and
   trials). Ranks then arrive apart, as they do between a step's ops, and on a machine with fewer
   free cores than ranks a rank that waits must be scheduled again: a tight loop of collectives
   (ranks arriving together) measures a fraction of what a step pays.
   The cost model prices one as ``collective_overhead_s + steps(n) * latency_s + wire(n) *
   payload / (bandwidth * efficiency[kind])`` (:func:`passes.plan.cost_model.collective_time`): one
   linear least-squares fit over every sample, with unknowns ``collective_overhead_s``,
   ``latency_s`` and one seconds-per-wire-byte per kind; the all-reduce's is the link's
   ``bandwidth`` and the other kinds' are its ``efficiency``. Both fixed terms stay >= 0 (a
   negative one is dropped and the rest refitted).
   **Arrival.** The collective samples follow a short burst (``burst``); in a step, ranks
   compute longer between calls, and ranks sharing cores progress unevenly, so they arrive
   further apart. For ``burst`` and each of the longer computations ``waits`` (nominally 10-100
   ms), runs of matmuls each followed by a tiny all-reduce are timed: a run's time and the time
   inside the all-reduce after it (the mean over runs and ranks, the collective samples'
   statistic). ``arrival_wait`` is, per measured run time, the time inside beyond the ``burst``
   one (kept >= 0 and non-decreasing), which the estimate adds per collective call by the compute
   since the previous call (:func:`passes.plan.collective_calls.arrival_wait_s`).
   **Overlap.** A prefetched weight gather (``passes/lower/prefetch_gathers.py``) runs asynchronously
   beside compute; on a GPU it has its own engine, on gloo its transfers run on threads that
   compete with the compute for the cores. Every rank times an all-gather of a weight's size
   (the largest payload up to 2 MiB) alone, matmuls about as long alone, and the gather started
   before the matmuls and waited for after them: ``prefetch_overlap = (compute + gather - both)
   / min(compute, gather)`` (within 0-1) is the fraction of the shorter one that running them
   together hides, the fraction of the overlapped compute the cost model credits a prefetched
   gather with.
4. **Fits minimise relative error** (every sample weighted by ``1 / t**2``), so small and large
   sizes count alike. The written model is the least-squares optimum over its own samples: the
   weighted residuals are orthogonal to every fitted term (what the test checks).

The cluster file is JSON: ``{"cluster": ClusterSpec fields, "samples": {...}, "machine": ...}``;
``cluster=<path>`` reads it everywhere (``partitioner.get_cluster``).

Modules: :mod:`~partitioner.calibration.sizes` (what is measured), :mod:`~partitioner.calibration.timing`
(timing loops), :mod:`~partitioner.calibration.measure_compute` and
:mod:`~partitioner.calibration.measure_backward` (step 2),
:mod:`~partitioner.calibration.measure_collectives` (step 3), :mod:`~partitioner.calibration.measure`
(every rank's samples, repeated passes), :mod:`~partitioner.calibration.fit` (step 4) and
:mod:`~partitioner.calibration.calibrate` (the command: measure, fit, write the cluster file).
"""
