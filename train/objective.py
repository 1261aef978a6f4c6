"""The module the backends wrap: the drafter and its loss in one `forward`.

DDP reduces gradients only for computation run inside the wrapped module's forward, FSDP2 gathers
parameters only there, and neither forwards custom methods (`combine_aux_hidden_states`, `mask_hidden`).
So everything a step computes with the drafter's parameters happens in `DrafterObjective.forward`, whatever
the backend; the frozen teacher head is held by the loss function, outside the module's state.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from draftsmith.train.drafter import Drafter

# (drafter, row) -> (loss, metrics of tensors); drafter.training tells a training row from held-out evaluation
RowLoss = Callable[[Drafter, dict], tuple]


class DrafterObjective(nn.Module):
    """state_dict() is the drafter's under the prefix `drafter.`."""

    def __init__(self, drafter: Drafter, row_loss: RowLoss):
        super().__init__()
        self.drafter = drafter
        self.row_loss = row_loss

    def forward(self, row: dict):
        return self.row_loss(self.drafter, row)
