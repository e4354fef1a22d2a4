"""The step loop: a StepPlan executed on the model and the KV cache (runner.py), with its per-step inputs,
forward context, CUDA decode graphs, and the work done beside it (LoRA loads, grammar matchers)."""
