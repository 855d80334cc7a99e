"""Sampling completions for online RL: the contract every backend meets (:mod:`.contract`: the
sampling settings, the batch layout, the backend protocol), one module per backend (:mod:`.hf_backend`,
:mod:`.vllm_backend`), greedy answers for evaluation and judges (:mod:`.greedy`, inside the CPU decode kernels of
:mod:`.decode_kernels`), the backend registry and its per-backend options (:mod:`.registry`), and the
rollout workers of asynchronous RL as processes (:mod:`.worker`) or Ray actors (:mod:`.ray_actor`)."""
