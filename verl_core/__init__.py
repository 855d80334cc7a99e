"""verl_core: LLM post-training on one shared engine.

    from verl_core import SFTTrainer, RewardTrainer
    SFTTrainer("path/to/model", train_dataset=rows, max_steps=300).train()
"""
from verl_core.algorithms.dpo import DPOConfig, DPOTrainer, ORPOConfig, ORPOTrainer, SimPOConfig, SimPOTrainer
from verl_core.algorithms.grpo import GRPOConfig, GRPOTrainer, ReinforcePPConfig, ReinforcePPTrainer, RLOOConfig, RLOOTrainer
from verl_core.algorithms.kto import KTOConfig, KTOTrainer
from verl_core.algorithms.ppo import PPOConfig, PPOTrainer, Trainer
from verl_core.algorithms.reward_model import RewardConfig, RewardTrainer
from verl_core.algorithms.sft import SFTConfig, SFTTrainer
from verl_core.callbacks import Callback, ConsoleCallback, MLflowCallback
from verl_core.config import ConfigError
from verl_core.data import DataError
from verl_core.engine import Engine, LossOutput, TrainConfig, TrainingError, TrainResult
from verl_core.models import LoraSettings, ModelLoadError, load_causal_lm, load_reward_model, load_tokenizer
from verl_core.tiny import tiny_model_path

__all__ = [
    "DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "KTOConfig", "KTOTrainer", "ORPOConfig", "ORPOTrainer",
    "PPOConfig", "PPOTrainer", "RLOOConfig", "RLOOTrainer", "ReinforcePPConfig", "ReinforcePPTrainer",
    "SimPOConfig", "SimPOTrainer", "Trainer",
    "Callback", "ConfigError", "ConsoleCallback", "DataError", "Engine", "LoraSettings", "LossOutput",
    "MLflowCallback", "ModelLoadError", "RewardConfig", "RewardTrainer", "SFTConfig", "SFTTrainer",
    "TrainConfig", "TrainResult", "TrainingError", "load_causal_lm", "load_reward_model", "load_tokenizer",
    "tiny_model_path",
]
