"""The optimisation settings every algorithm shares (each algorithm's config extends them)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from verl_core.config import StrictConfig
from verl_core.train.precision import resolve_mixed_precision


class TrainConfig(StrictConfig):
    """Optimisation settings shared by every algorithm."""

    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    fused_optimizer: bool = Field(
        True,
        description="AdamW's fused kernel (one pass per parameter on CPU and CUDA, ~6x the default's speed on "
        "CPU at a 32k vocabulary); off under FSDP / DeepSpeed, which bring their own",
    )
    lr_scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    max_steps: int | None = Field(None, ge=1)
    num_epochs: float | None = Field(None, gt=0)
    batch_size: int = Field(16, ge=1, description="global batch per optimizer step: all processes and micro-batches")
    shrink_batch_to_data: bool = Field(
        False, description="a dataset with fewer rows than batch_size: true trains on batches of what there is; false: an error"
    )
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_grad_norm: float | None = 1.0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "no", description="'auto': bf16 where it is fast (GPU, or a CPU with AVX512-BF16/AMX), else no (fp32)"
    )
    gradient_checkpointing: bool = False
    offload_optimizer: bool = Field(
        False,
        description="DeepSpeed ZeRO optimizer offload under `accelerate launch` with a DeepSpeed config; "
        "no effect in one CPU process",
    )
    seed: int = 0
    output_dir: str | None = None
    save_steps: int | None = Field(None, ge=1)
    save_total_limit: int = Field(2, ge=1)
    resume: bool = True
    logging_steps: int = Field(
        10, ge=1, description="log metric means every N steps; at most max_steps/20, so a short run still draws a curve"
    )
    eval_steps: int | None = Field(None, ge=1)
    progress: bool = True

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        # YAML 1.1 reads a bare `no` as False
        return "no" if value is False else value

    @field_validator("output_dir")
    @classmethod
    def _a_folder(cls, value):
        if value is not None and Path(value).expanduser().exists() and not Path(value).expanduser().is_dir():
            raise ValueError(f"{value} is a file, not a folder; choose another output_dir or move the file")
        return value

    @model_validator(mode="after")
    def _resolve_precision(self):
        self.__dict__["mixed_precision"] = resolve_mixed_precision(self.mixed_precision)
        return self

    @model_validator(mode="after")
    def _one_length(self):
        if self.max_steps is None and self.num_epochs is None:
            self.__dict__["num_epochs"] = 1.0
        return self
