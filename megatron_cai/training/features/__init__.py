"""Features that hook into the training loop at a few named points: distillation (``distill``), Mixture of
Experts' metrics and aux-loss scale (``moe``), DiLoCo's outer steps (``diloco``), the replicas' weight-hash check
(``weight_hash``), --deterministic-mode's set-up (``determinism``) and Megatron's rerun state machine
(``rerun``). The loop calls them; they never call the loop."""
