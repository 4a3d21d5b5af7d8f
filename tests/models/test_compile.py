"""train.compile: the compiled hot paths agree with the eager ones to float tolerance.

Inductor fuses and reorders float operations, so the compiled path is not bit-identical to the eager
one; the eager path (train.compile = False, the default) is not touched by any of it.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import built_run

from polgrad import registry
from polgrad.models import build_tiny, compiled, encode_prompts, position_ids_from_mask
from polgrad.rollout.static_decode import StaticDecoder

pytestmark = pytest.mark.cpu_matrix

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _decoders(model, tok, prompts: list[str], rows: torch.Tensor, length: int):
    from transformers import DynamicCache

    ids, pmask = encode_prompts(tok, prompts)
    decoders = []
    for flag in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(
                input_ids=ids,
                attention_mask=pmask.long(),
                position_ids=position_ids_from_mask(pmask),
                past_key_values=cache,
                use_cache=True,
            )
        dec = StaticDecoder(model, len(rows), ids.shape[1] + length, compiled=flag)
        dec.load_prefill(cache, pmask[rows].long(), rows)
        decoders.append(dec)
    start = position_ids_from_mask(pmask[rows].long())[:, -1] + 1
    return decoders, start


# The model of these tests: the tiny default with 2 layers instead of 4. Inductor's time grows with the
# graph, which unrolls every layer; two layers keep what the tests check per layer (each layer's own
# cache slot: a step that wrote or read another layer's cache differs from the eager one at the second).
LAYERS = 2


def test_the_compiled_decode_step_gives_the_eager_steps_logits():
    """Teacher-forced through 12 tokens of 6 rows (2 prompts of different lengths, left-padded): the
    compiled fixed-shape step (whole cache under the key mask) and the eager step give the same
    logits to float error."""
    task = registry.get("task", "add")()
    model, tok = build_tiny(task, layers=LAYERS, seed=0)
    model.eval()
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    (eager, comp), start = _decoders(model, tok, ["1+2=", "12+34="], rows, 12)
    tokens = torch.randint(0, model.config.vocab_size, (6, 12), generator=torch.Generator().manual_seed(0))
    for i in range(12):
        a = eager.step(tokens[:, i], start + i)
        b = comp.step(tokens[:, i], start + i)
        # fp32 logits of size ~1-10: summation order differs (measured ~5e-7); 1e-4 absolute is
        # far below any change a wrong mask, position or cache write makes (>= 1e-2)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    assert comp.t == eager.t


def _built(tmp_path, name: str, bindings: list[str]):
    """PPO's models (policy, reference, critic, HF sampler) as a run builds them, for 8 prompts of group
    size 1; built under the run's seed, so two builds start from the same weights."""
    return built_run(tmp_path, "ppo", name, bindings, layers=LAYERS)


def _weights(m) -> dict[str, torch.Tensor]:
    out = {f"policy.{k}": v.detach().clone() for k, v in m.engine.module.state_dict().items()}
    critic = m.critic.engines()
    for name, engine in critic:
        out.update({f"{name}.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()})
    return out


@pytest.mark.slow
def test_compiled_ppo_forwards_backward_and_update_agree_with_eager_ones_on_one_rollout(
    tmp_path, monkeypatch
):
    """PPO built twice from the same seed, eager and with train.compile = True (policy, reference and
    critic compiled), fed ONE rollout sampled by the eager sampler: the compiled reference, critic and
    policy forwards, the loss, the backward and the optimizer steps of one PPO update give the eager
    ones' numbers to float tolerance. On the same tokens the two paths differ by rounding alone (two
    runs that each sample could draw different tokens, and every later number would differ). The
    compiled sampler is run once too, with its decode step left eager (its compiled graph is the
    decode test's above): the rollout takes the compiled path, and its log-probs (the first token's
    from the compiled prefill, the others from the decode step reading the K/V cache that prefill
    wrote) are the eager policy's on the tokens drawn."""
    from polgrad import trainer
    from polgrad.rollout import hf as hf_rollout
    from polgrad.rollout import static_decode
    from polgrad.sampling import step_seed

    seen, steps = [], []
    real = compiled.compile_models

    def spy(*modules):
        real(*modules)
        seen.append(sum(compiled.is_compiled(m) for m in modules if m is not None))

    monkeypatch.setattr(compiled, "compile_models", spy)
    monkeypatch.setattr(
        static_decode, "_compiled_step", lambda: (steps.append(1), static_decode.step_fixed)[1]
    )
    cfg, algo, task, eager = _built(tmp_path, "eager", [])
    assert seen == []
    _, _, _, comp = _built(tmp_path, "compiled", ["train.compile = True"])
    assert seen == [3]  # policy, reference, critic
    w0 = _weights(eager)
    assert all(torch.equal(w0[k], v) for k, v in _weights(comp).items())  # the same starting weights
    seed = step_seed(cfg.seed, 0)

    # Sampling with the compiled policy (compiled prefill, decode through the fixed-shape step).
    drawn = comp.sampler.sample(seed)
    assert len(steps) >= 1
    with torch.no_grad():
        redo = hf_rollout.response_logprobs(eager.engine.module, drawn, temperature=cfg.temperature)
    mask = drawn.mask.bool()
    # fp32 log-probs of size ~1-10 from forwards that sum in another order: ~1e-6 apart; a wrong cache
    # write or position in the compiled prefill moves them by >= 1e-2
    torch.testing.assert_close(drawn.rollout_logp[mask], redo[mask], rtol=0, atol=1e-4)

    # One rollout, sampled eagerly, and each compiled model's view of it.
    got = trainer.collect_once(cfg, algo, eager, task, seed)
    # Scores that split the batch, whatever the responses: PPO whitens its advantages, so a batch
    # whose 8 responses all score alike (it happens with one warm start or another CPU's kernels)
    # trains on whitened rounding noise, which Adam turns into lr-sized moves in any direction
    # (measured on the AVX2 leg: updates 75% of their norm apart, entropy 0.617 vs 0.626).
    fixed = got.batch.replace(scores=torch.tensor([1.0, 0.0] * 4, dtype=got.batch.scores.dtype))
    ref = comp.reference.collect(comp.engine.module, fixed.rollout, cfg.temperature)
    values = comp.critic.old_values(fixed.rollout, fixed.mask)
    m = fixed.mask.bool()
    # float64 copies of fp32 forwards, as above. The values are not trivial (a zero head would make
    # every value 0 on both paths); the exact KL is ~0 at step 0 (the reference is the policy), so its
    # check is a sanity check of the compiled reference's wiring, not of its numbers (ref_logp is).
    assert fixed.values[m].abs().max() > 1e-3
    torch.testing.assert_close(values[m], fixed.values[m], rtol=0, atol=1e-4)
    torch.testing.assert_close(ref["ref_logp"][m], fixed.ref_logp[m], rtol=0, atol=1e-4)
    torch.testing.assert_close(ref["kl_exact"], fixed.kl_exact, rtol=0, atol=1e-4)
    mine = fixed.replace(ref_logp=ref["ref_logp"], kl_exact=ref["kl_exact"], values=values, old_values=values)

    # One PPO update (ppo_epochs 2 x minibatches 2: 4 optimizer steps of policy and critic) on each.
    beta = algo.kl_coef
    out_e, n_e, _ = trainer.update(cfg, algo, eager, algo.prepare(fixed, kl_coef=beta)[0], beta, seed, step=0)
    out_c, n_c, _ = trainer.update(cfg, algo, comp, algo.prepare(mine, kl_coef=beta)[0], beta, seed, step=0)
    assert n_e == n_c == 4 and out_e.keys() == out_c.keys()
    for key in ("pg_loss", "value_loss", "entropy"):
        # float64 means of fp32 forwards that round differently (~1e-7 relative)
        assert out_c[key] == pytest.approx(out_e[key], rel=1e-4, abs=1e-6), key
    # The weights, through the update (after - before), over every weight of policy and critic. Adam
    # moves an element by about lr * m / sqrt(v) per step, at most ~lr whatever the gradient's size, so
    # where a gradient sits at rounding level the two may move an element opposite ways: at most
    # 2 lr per step, here 4 steps at lr 1e-4. The bulk of the update follows the gradient continuously,
    # so the two updates differ by a small fraction of the update's norm; a wrong mask, position or
    # cache in a compiled forward or backward changes the gradient, and so the update, by O(1) of it.
    # Measured at 2 layers: 2.0e-5 of the norm on an AMD EPYC with AVX-512, 1.1e-5 on its AVX2 leg.
    w_e, w_c = _weights(eager), _weights(comp)
    d_e = torch.cat([(w_e[k] - w0[k]).flatten() for k in w0])
    d_c = torch.cat([(w_c[k] - w0[k]).flatten() for k in w0])
    assert d_e.norm() > 0 and (d_c - d_e).abs().max() <= 2 * 1e-4 * 4
    ratio = float((d_c - d_e).norm() / d_e.norm())
    print(f"compiled vs eager: update difference {ratio:.2e} of the update's norm")
    assert ratio <= 1e-2
