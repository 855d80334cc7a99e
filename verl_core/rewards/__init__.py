"""Reward functions: rule-based scorers of completions against ground truths."""
