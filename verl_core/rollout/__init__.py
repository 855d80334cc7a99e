"""Sampling completions for online RL: the contract every backend meets (:mod:`.contract`: the
sampling settings, the batch layout, the backend protocol), one module per backend (:mod:`.hf_backend`,
:mod:`.vllm_backend`), the backend registry and its per-backend options (:mod:`.registry`), and the
rollout workers of asynchronous RL as processes (:mod:`.worker`) or Ray actors (:mod:`.ray_actor`)."""
