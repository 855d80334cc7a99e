"""Stop training at the first non-finite number, before that step's checkpoint exists.

Three places a NaN/inf can first appear in a step, each with its own message naming the step and
what was measured (not a guessed cause): the loss (so the parameters or the batch produce it),
the gradients (the loss was finite, the backward pass was not), the parameters after the update
(loss and gradients were finite, the optimizer update itself was not).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verl_core.errors import TrainingError

_NOT_SAVED = "the update was not kept: no checkpoint or model of this step was written"


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(list(tensors))))


def check_loss(loss: torch.Tensor, step: int, micro_batch: int, params: Sequence[torch.nn.Parameter]) -> None:
    """Raise if the loss of ``micro_batch`` of ``step`` is not finite; say whether the parameters already were not."""
    if bool(torch.isfinite(loss.detach())):
        return
    weights = [p.detach() for p in params]
    if not _all_finite(weights):
        cause = "the model's parameters were already non-finite before this step (the model or checkpoint it started from)"
    else:
        largest = max(float(w.abs().max()) for w in weights if w.numel())
        cause = (
            f"the parameters were finite (largest magnitude {largest:.3g}), so the forward pass on this batch overflowed "
            "or the inputs produce it"
        )
    raise TrainingError(f"non-finite loss ({loss.item()}) at step {step}, micro-batch {micro_batch}: {cause}; {_NOT_SAVED}")


def check_gradients(grad_norm: float, loss: float, step: int) -> None:
    if not math.isfinite(grad_norm):
        raise TrainingError(
            f"non-finite gradient norm ({grad_norm}) at step {step} with a finite loss ({loss:.6g}): the backward pass "
            f"overflowed; {_NOT_SAVED}"
        )


def update_overflowed(err: RuntimeError, step: int, settings: str) -> TrainingError:
    """The error for an optimizer step that raised on a number beyond the float range (torch's AdamW
    does for a step size over ~3.4e38); any other RuntimeError is returned unchanged."""
    if "overflow" not in str(err):
        return err
    return TrainingError(f"the optimizer update of step {step} overflowed ({err}); optimizer settings: {settings}; {_NOT_SAVED}")


def check_update(params: Sequence[torch.nn.Parameter], step: int, loss: float, grad_norm: float, settings: str) -> None:
    """Raise if the optimizer update of ``step`` made a parameter non-finite (after finite loss and gradients)."""
    if not _all_finite([p.detach() for p in params]):
        raise TrainingError(
            f"the optimizer update of step {step} made parameters non-finite although its loss ({loss:.6g}) and "
            f"gradient norm ({grad_norm:.6g}) were finite, so the update itself overflowed (optimizer settings: "
            f"{settings}); {_NOT_SAVED}"
        )
