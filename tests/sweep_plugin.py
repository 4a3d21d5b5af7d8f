"""A user's plugin module for the sweep tests: registers one kl part (imported only in a subprocess)."""

from polgrad.registry import register


@register("kl", "sweeptest_k1")
def sweeptest_k1(logp, ref_logp, mask, *, logits=None, ref_logits=None):
    """k1 = logp - ref_logp (test double; never trained with)."""
    return (logp - ref_logp) * mask
