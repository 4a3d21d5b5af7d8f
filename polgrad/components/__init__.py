"""Built-in parts, one module per kind; importing this package registers them all."""

from polgrad.components import (  # noqa: F401
    advantage,
    aggregate,
    clip,
    filter,
    kl,
    kl_controller,
    preference,
    reward,
    reward_ensemble,
    reward_shaping,
    tracker,
    value_init,
    value_loss,
)
from polgrad.registry import StepCounts  # noqa: F401
