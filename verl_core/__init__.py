"""verl_core: LLM post-training on one shared engine.

    from verl_core import SFTTrainer, DPOTrainer, GRPOTrainer
    SFTTrainer("path/to/model", train_dataset=rows, max_steps=300).train()

Every policy-optimisation algorithm's trainer and config class is exported here from the
algorithm registry (:data:`verl_core.algorithms.registry.ALGORITHMS`). This package never
imports Prefect or MLflow; the pipeline layer lives in :mod:`verl_core.pipeline`.
"""

from verl_core.algorithms.ppo import Trainer
from verl_core.algorithms.registry import ALGORITHMS, Algorithm, get_algorithm
from verl_core.algorithms.reward_model import RewardConfig, RewardTrainer
from verl_core.algorithms.sft import SFTConfig, SFTTrainer
from verl_core.bundled import arithmetic  # the bundled task, for examples: arithmetic.sft_rows(64)
from verl_core.bundled.tiny_model import tiny_model_path
from verl_core.config import ConfigError
from verl_core.data import DataError
from verl_core.errors import TrainingError
from verl_core.modeling.loading import LoraSettings, load_causal_lm, load_reward_model, load_tokenizer
from verl_core.modeling.model_files import ModelLoadError
from verl_core.train.callbacks import Callback, ConsoleCallback, MLflowCallback
from verl_core.train.config import TrainConfig
from verl_core.train.engine import Engine, LossOutput, TrainResult

# DPOTrainer, DPOConfig, KTOTrainer, ..., ReinforcePPTrainer, ReinforcePPConfig
_ALGORITHM_EXPORTS = {cls.__name__: cls for a in ALGORITHMS.values() for cls in (a.trainer, a.config_cls)}
globals().update(_ALGORITHM_EXPORTS)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Callback",
    "ConfigError",
    "ConsoleCallback",
    "DataError",
    "Engine",
    "LoraSettings",
    "LossOutput",
    "MLflowCallback",
    "ModelLoadError",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "arithmetic",
    "get_algorithm",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "tiny_model_path",
]
__all__ += sorted(_ALGORITHM_EXPORTS)
