"""Preference data from a policy: sample ``n`` completions per prompt, score them, pair and label them.

``generate_preference_data(policy_path, prompts, config, output_dir)`` writes::

    output_dir/
      shards/manifest.json            what the shards were sampled with (a rerun must match it)
      shards/shard-00000.jsonl        raw samples + scores of prompts [0, shard_size), one JSON line each
      shards/shard-00001.jsonl        prompts [shard_size, 2 * shard_size), ...
      pairs/       pairs.parquet      prompt / chosen / rejected / chosen_score / rejected_score / ...
      unpaired/    unpaired.parquet   prompt / completion / label / score / ... (KTO)
      best_of_n/   best_of_n.parquet  prompt / completion / score / ... (SFT on the best sample)
      provenance.json                 policy + weights fingerprint, reward source, sampling, seed, counts, stats

(``pairs/`` etc. are ``save_to_disk`` folders.) Every row carries ``prompt_index`` (its row in the
input) and ``ground_truth``. Conversational prompts (message lists) give assistant message lists as
completions, so :func:`~verl_core.data.tokenize_pairs` / ``tokenize_unpaired`` / ``tokenize_sft`` read
the rows as they are.

Resumability: shard ``i`` always covers the same prompt range and is sampled with a seed derived from
``(seed, i)`` (and the batch within the shard), so a rerun that skips the shards already on disk
produces exactly the output of an uninterrupted run. A shard file appears only once it is complete
(temp file + rename). The final datasets are always rebuilt from the shards, so changing only the
pairing / labelling options and rerunning re-pairs without sampling again. "Same seed, same bytes"
holds on one device type with one torch version and thread count (float sums may differ otherwise).

Pairing rules, per prompt: blank completions (the row formats reject them) and repeated completions
(the first sample is kept) are not used. ``best_worst`` pairs the highest-scored against the
lowest-scored sample; ``all_pairs`` every two samples whose scores differ. A pair needs
``chosen_score - rejected_score >= min_margin`` and ``> 0``. Among equal scores the earlier sample
wins, or with ``tie_break="logprob"`` the best is the most likely and the worst the least likely
sample under the policy (clearer negatives when the reward is binary; each shard record keeps the
sequence log-prob at the sampling temperature). A prompt whose samples all got the same
score is an *all-tie* prompt: it gives no pair and is listed in the statistics.
"""

from verl_core.preference_data.config import OUTPUT_KINDS, PreferenceDataConfig, PreferenceDataResult, ShardMismatchError
from verl_core.preference_data.generate import derive_seed, fingerprint_weights, generate_preference_data
from verl_core.preference_data.rows import build_rows

__all__ = [
    "OUTPUT_KINDS",
    "PreferenceDataConfig",
    "PreferenceDataResult",
    "ShardMismatchError",
    "build_rows",
    "derive_seed",
    "fingerprint_weights",
    "generate_preference_data",
]
