"""Features that hook into the training loop at a few named points: distillation (``distill``), Mixture of
Experts' metrics and aux-loss scale (``moe``) and DiLoCo's outer steps (``diloco``). The loop calls them; they
never call the loop."""
