"""Re-export: the call signatures (Protocols) and StepCounts live in `polgrad.registry.kinds`."""

from polgrad.registry.kinds import (  # noqa: F401
    AdvantageFn,
    AggregateFn,
    ClipFn,
    FilterFn,
    KLControllerFn,
    KLFn,
    RewardShapingFn,
    StepCounts,
    TaskFn,
    ValueInitFn,
    ValueLossFn,
)
