"""Built-in kl_controller parts: how the KL coefficient `kl_coef` (beta in the formulas) moves per step.

Call signature: `polgrad.registry.kinds.KLControllerFn`. The parts
are pure: the training loop holds beta and calls the controller once per optimizer step with the
KL it measured on that step's rollouts (per sequence: see `adaptive`).
"""

from __future__ import annotations

import math

from polgrad.checks import is_int, is_real
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import register


def _state(where: str, kl_coef, measured_kl, n_steps) -> tuple[float, float, int]:
    """Check the loop's inputs: kl_coef >= 0, measured_kl finite (float or 0-dim tensor), n_steps >= 0 int."""
    try:  # a 0-dim tensor converts; a vector or a string does not
        kl_coef, measured_kl = float(kl_coef), float(measured_kl)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ShapeError(f"{where}: kl_coef and measured_kl must be scalars ({exc})") from None
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ShapeError(f"{where}: kl_coef must be a finite number >= 0, got {kl_coef}")
    if not math.isfinite(measured_kl):
        raise ShapeError(f"{where}: measured_kl must be finite, got {measured_kl}")
    if not is_int(n_steps, abc=True) or n_steps < 0:
        raise ShapeError(f"{where}: n_steps must be an int >= 0, got {n_steps!r}")
    return kl_coef, measured_kl, int(n_steps)


@register("kl_controller", "fixed", formula="beta", constant=True)
def fixed(kl_coef: float, measured_kl: float, n_steps: int) -> float:
    """Constant coefficient: beta_{k+1} = beta_k.

    Source: Ziegler et al. 2019 ("Fine-tuning language models from human preferences"), the
    fixed-beta baseline; GRPO/DeepSeekMath use a fixed beta.

    Shapes: floats (measured_kl may be a 0-dim tensor) -> float.
    """
    kl_coef, _, _ = _state("kl_controller.fixed", kl_coef, measured_kl, n_steps)
    return kl_coef


@register("kl_controller", "adaptive", formula="beta*(1 + clip(KL/KL_target - 1, -0.2, 0.2)*n/H)")
def adaptive(
    kl_coef: float, measured_kl: float, n_steps: int, *, target: float = 6.0, horizon: int = 10000
) -> float:
    """Proportional controller driving the measured KL toward `target`.

        e_k        = clip(KL_k / KL_target - 1, -0.2, 0.2)
        beta_{k+1} = beta_k * (1 + e_k * n_steps / horizon)

    KL_k is the per-sequence KL of the step's rollouts: the mean over the batch's sequences of
    sum_t (log pi(y_t) - log pi_ref(y_t)) over each response's valid tokens, in nats per sequence.
    That is the quantity Ziegler et al.'s target (6 nats) is expressed in; a per-token mean would
    be smaller by the response length and drive beta the wrong way. The clip bounds the relative
    change per call to 0.2 * n_steps / horizon. `n_steps` is the number of samples since the last
    update (Ziegler et al. use the batch size, as does OpenRLHF's
    `kl_ctl.update(kl, rollout_batch_size)`). n_steps must stay below 5 * horizon, else the factor
    could reach zero or flip the sign of beta.

    Source: Ziegler et al. 2019, "Fine-tuning language models from human preferences", section
    2.2 (the log-space proportional controller that adapts beta to a KL target); the
    n_steps / horizon gain and the defaults KL_target = 6, horizon = 10000 are those of their
    lm-human-preferences code (`AdaptiveKLController` in train_policy.py, fed the batch mean of
    the summed per-token KL), kept by TRL's, OpenRLHF's and verl's AdaptiveKLController.

    Shapes: floats (measured_kl may be a 0-dim tensor) -> float.
    """
    for name, value in (("target", target), ("horizon", horizon)):
        if not is_real(value, abc=True) or not 0 < value < math.inf:
            raise ConfigError(f"kl_controller.adaptive.{name} must be > 0 and finite, got {value!r}")
    kl_coef, measured_kl, n_steps = _state("kl_controller.adaptive", kl_coef, measured_kl, n_steps)
    if 0.2 * n_steps >= horizon:
        raise ConfigError(
            f"kl_controller.adaptive.horizon must be > 0.2 * n_steps = {0.2 * n_steps:g} (got {horizon}), "
            "else one update can zero or negate the coefficient"
        )
    error = min(max(measured_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)
