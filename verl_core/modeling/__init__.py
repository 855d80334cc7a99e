"""Models: loading (folder or hub id, dtype, LoRA, gradient checkpointing; :mod:`.loading`), the forward
pass and its attention implementation (:mod:`.forward`), log-probs from logits (:mod:`.logprobs`) and
straight from hidden states through the LM head (:mod:`.lm_head`), and the packed, prefix-shared forward
with the reward head's pair scores (:mod:`.packed_forward`)."""
