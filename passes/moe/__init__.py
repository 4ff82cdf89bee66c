"""Mixture-of-experts layers: captured as one op (:mod:`passes.moe.experts_op`), routing
measured on the example batch (:mod:`passes.moe.routing`); the op's strategies are
:mod:`passes.rules.experts` and its runtime :mod:`runtime.expert_dispatch`."""
