"""Rollouts with a Hugging Face causal LM on CPU (the default backend) and the log-prob recompute.

    generate(model, tokenizer, examples, *, group_size, ...)      -> Rollout
    response_logprobs(model, rollout | ids..., *, temperature)     -> logp [B,T] (+ entropy, logits)
    response_values(critic, rollout | ids...)                      -> values [B,T]
    rollout_scores(reward_model, rollout)                          -> scores [B] at the EOS token

Sampling is a hand-written KV-cache loop: one prefill with the model's forward, then one token per
step. For Qwen2/Llama-style models the step is `static_decode.StaticDecoder` (preallocated cache,
fused q|k|v, GQA without K/V copies): 1.7-1.9x faster than the HF forward per token on the tiny
model; other models (or ZeRO-3-partitioned weights) use the model's forward with a DynamicCache,
which is as fast as `model.generate`. The loop draws from a private
`torch.Generator(generator_seed)`, so the same seed gives the same rollout whatever else touched
torch's global RNG, and the log-probs it records are exactly the ones defined below.

Layout. Row b of a rollout is prompt `b // group_size` (`group_ids[b]`). The prompt is BOS +
characters, left-padded (`prompt_ids`, `prompt_mask`); the response is right-padded with PAD after
the EOS. `mask[b, t]` is 1 on generated tokens up to and including the EOS, 0 after; a row with no EOS
within `max_new_tokens` is `truncated` and its mask is all ones. The model sees
`concat(prompt, response)` with attention `concat(prompt_mask, 1)` and position ids
`cumsum(attention) - 1`: the token at response position t is predicted from the hidden state at
sequence position P - 1 + t. Tokens after the EOS are never attended by tokens at or before it
(causality), so no mask over the response is needed and holes that a trainer punches into `mask`
cannot change a log-prob.

Log-probs and top-p. `rollout_logp[b, t] = log softmax(logits / temperature)[token]`, the
temperature-scaled distribution *before* the top-p cut. This is the number `response_logprobs`
recomputes with the same temperature, so on-policy the importance ratio starts at exactly 1 (up to
float error); with top_p < 1 it is not the nucleus-renormalised probability the token was actually
drawn with (that one is log p - log(mass of the nucleus)). Temperature 0 means greedy decoding and
log-probs at temperature 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from polgrad import collective, hooks
from polgrad.errors import ConfigError, ShapeError
from polgrad.models import encode_prompts, position_ids_from_mask, sequence_scores, torch_threads
from polgrad.models.compiled import is_compiled
from polgrad.models.threads import decode_threads
from polgrad.rollout.fused_logprobs import TokenLogprobs, scored_logprobs
from polgrad.rollout.rollout import Rollout
from polgrad.rollout.static_decode import StaticDecoder
from polgrad.tasks.base import Example

# The most sampling distributions (B x T x V floats: 128 MiB in fp32) a sampler keeps for the exact
# KL (`generate(keep_distribution=True)`); above it the loop runs the policy's own no-grad forward
# for it instead (a large vocabulary, long responses).
MAX_KEPT_DISTRIBUTION = 2**25


def distribution_fits(model, rows: int, max_new_tokens: int) -> bool:
    """Whether the sampling distributions of `rows` responses of up to `max_new_tokens` tokens fit
    MAX_KEPT_DISTRIBUTION (the model's config gives the vocabulary)."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    return 0 < rows * max_new_tokens * vocab <= MAX_KEPT_DISTRIBUTION


def _sample_tokens(
    logits: Tensor, temperature: float, top_p: float, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row from logits [B,V]; returns (token [B], log-prob at the temperature [B], the
    temperature-scaled log-softmax [B,V] it was drawn from, before any top-p cut)."""
    if temperature == 0.0:
        logp_all = F.log_softmax(logits, dim=-1)
        token = logits.argmax(-1)
        return token, logp_all.gather(1, token[:, None]).squeeze(1), logp_all
    logp_all = F.log_softmax(logits / temperature, dim=-1)
    probs = logp_all.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # the mass before this token already reaches top_p
        drop[:, 0] = False
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    token = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return token, logp_all.gather(1, token[:, None]).squeeze(1), logp_all


@torch.no_grad()
def _decode(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    rows: Tensor,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    gen: torch.Generator,
    lean: bool = True,
    keep_distribution: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """KV-cache sampling loop -> (response_ids [B,T], mask [B,T], logp [B,T], truncated [B],
    logp_all [B,T,V] or None).

    `keep_distribution`: also return the temperature-scaled log-softmax over the vocabulary at every
    response position (what each token was drawn from; the sampling computes it anyway), so the
    exact KL to the reference needs no second policy forward (`polgrad.evaluation.exact_kl`).

    `prompt_ids`/`prompt_mask` [U,P] are the distinct prompts and `rows` [B] the prompt of each row:
    each prompt is prefilled once by the model's own forward and its K/V copied to its rows (a group
    of G samples shares one prefill). Each new token then goes through `StaticDecoder.step` (static
    cache, see static_decode.py) when the model supports it and `lean`, else through the model's
    forward with a growing `DynamicCache`.
    """
    from transformers import DynamicCache

    b = rows.shape[0]
    device = prompt_ids.device
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        position_ids=position_ids_from_mask(prompt_mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[rows, -1].float()
    attn = prompt_mask[rows].long()
    next_pos = position_ids_from_mask(attn)[:, -1] + 1
    static = None
    if lean and StaticDecoder.unsupported(model) is None:
        static = StaticDecoder(model, b, prompt_ids.shape[1] + max_new_tokens, compiled=is_compiled(model))
        static.load_prefill(cache, attn, rows)
        del cache
    else:
        cache.reorder_cache(rows)
    tokens, logps, dists = [], [], []
    synced = _partitioned(model) and collective.world_size() > 1
    done = torch.zeros(b, dtype=torch.bool, device=device)
    ones = torch.ones((b, 1), dtype=attn.dtype, device=device)
    width = max_new_tokens  # the response width this rank's own rows need (below)
    for step in range(max_new_tokens):
        token, logp, logp_all = _sample_tokens(logits, temperature, top_p, gen)
        if keep_distribution:
            dists.append(logp_all)
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        logps.append(logp.masked_fill(done, 0.0))
        done = done | (token == eos_id)
        if width == max_new_tokens and bool(done.all()):
            width = step + 1
        if step == max_new_tokens - 1 or _all_done(done, synced):
            break
        if static is not None:
            logits = static.step(token, next_pos).float()
        else:
            attn = torch.cat([attn, ones], dim=1)
            out = model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    # A synced rank (ZeRO-3) decodes padding until every rank is done; those columns are PAD for all
    # of its rows. Cut them, so a rollout's width is its own rows' and not the other ranks': the same
    # rollout as an unsynced decode's (a plain copy's, the async producer's), whose shape the update's
    # matmuls follow bit for bit (with the extra columns they summed in another blocking order).
    tokens, logps, dists = tokens[:width], logps[:width], dists[:width]
    response = torch.stack(tokens, 1)
    is_eos = response == eos_id
    # 1 up to and including the first EOS: no EOS strictly before position t
    before = is_eos.long().cumsum(1) - is_eos.long()
    mask = (before == 0).float()
    logp_all = torch.stack(dists, 1) if keep_distribution else None
    return response, mask, torch.stack(logps, 1) * mask, ~done, logp_all


def _partitioned(model) -> bool:
    """True if the model's weights are ZeRO-3 partitions (every forward is a collective then)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _all_done(done: Tensor, synced: bool) -> bool:
    """Whether decoding can stop: every row of this rank has its EOS, and with `synced` (ZeRO-3 at
    world size > 1, where each forward all-gathers the weights, so every rank must run the same
    number of forwards) every row of every rank. A rank whose rows are done keeps decoding padding
    until the others are done; its rows do not change (done rows emit PAD with log-prob 0)."""
    if not synced:
        return bool(done.all())
    pending = collective.all_sum(torch.tensor([float((~done).sum())]))
    return float(pending[0]) == 0.0


def decode_texts(tokenizer, response_ids: Tensor, mask: Tensor, eos_id: int) -> list[str]:
    """The responses as text: the masked-in tokens of each row without the EOS (both backends use it)."""
    out = []
    for row, m in zip(response_ids.tolist(), mask.tolist(), strict=True):
        keep = [t for t, k in zip(row, m, strict=True) if k > 0 and t != eos_id]
        out.append(tokenizer.decode(keep, skip_special_tokens=True))
    return out


def assemble_rollout(
    tokenizer,
    examples: Sequence[Example],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    rows: Tensor,
    decoded: tuple[Tensor, ...],
    *,
    eos_id: int,
    temperature: float,
    baseline: Rollout | None = None,
) -> Rollout:
    """The Rollout of `decoded` = (response_ids, mask, logp, truncated[, logp_all]) [B,...] for
    prompts [U,P]; `logp_all` [B,T,V] (the sampling distributions, optional) becomes
    `Rollout.policy_logp_all`.

    Row b answers prompt `rows[b]` of `examples`/`prompt_ids` (the layout in the module docstring);
    texts are decoded here. Both backends build their Rollouts, greedy baselines included, with it.
    """
    response, mask, logp, truncated, *rest = decoded
    logp_all = rest[0] if rest else None
    row_list = rows.tolist()
    return Rollout(
        prompt_ids=prompt_ids[rows],
        prompt_mask=prompt_mask[rows],
        response_ids=response,
        mask=mask,
        rollout_logp=logp,
        group_ids=rows.clone(),
        truncated=truncated,
        response_lengths=mask.sum(1).long(),
        texts=decode_texts(tokenizer, response, mask, eos_id),
        examples=[examples[i] for i in row_list],
        temperature=float(temperature),
        baseline_texts=None if baseline is None else list(baseline.texts),
        baseline=baseline,
        policy_logp_all=logp_all,
    )


def check_generate_args(
    examples: Sequence[Example], group_size: int, max_new_tokens: int, temperature: float, top_p: float
) -> None:
    """The argument checks every rollout backend's `generate` shares (one-line ConfigErrors)."""
    if not examples:
        raise ConfigError("generate: no examples")
    if group_size < 1 or max_new_tokens < 1:
        raise ConfigError(
            f"generate: group_size ({group_size}) and max_new_tokens ({max_new_tokens}) must be >= 1"
        )
    if temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError(f"generate: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")


def generate(
    model,
    tokenizer,
    examples: Sequence[Example],
    *,
    group_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int,
    greedy_baseline: bool = False,
    generator_seed: int,
    lean_decode: bool = True,
    own_threads: bool = True,
    keep_distribution: bool = False,
) -> Rollout:
    """Sample `group_size` responses for each example (KV cache, private RNG); see the module docstring.

    Deterministic given `generator_seed` (same model, examples and arguments -> identical rollout).
    `temperature=0` decodes greedily. With `greedy_baseline`, also decodes one greedy response per
    prompt (ReMax's baseline) into `rollout.baseline` / `rollout.baseline_texts`. The model is put in
    eval mode for the call and restored afterwards, and so is torch's thread count (`decode_threads`).
    `lean_decode=False` forces the generic HF decode
    step even where the static-cache one (static_decode.py) applies. `own_threads=False` leaves the
    thread count alone: the async producer (polgrad/producer.py) decodes in its own thread, and
    torch.set_num_threads would reach the trainer's thread too. `keep_distribution`: the sampled rows'
    Rollout carries `policy_logp_all` [B,T,V], the distribution each token was drawn from (the greedy
    baseline's does not).
    """
    check_generate_args(examples, group_size, max_new_tokens, temperature, top_p)
    device = next(model.parameters()).device
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids, pmask = encode_prompts(tokenizer, [ex.prompt for ex in examples])
    ids, pmask = ids.to(device), pmask.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch_threads(decode_threads(model, len(examples) * group_size) if own_threads else None):
            rows = torch.arange(len(examples), device=device).repeat_interleave(group_size)
            gen = torch.Generator(device=device).manual_seed(int(generator_seed))
            with hooks.phase("decode"):
                decoded = _decode(
                    model,
                    ids,
                    pmask,
                    rows,
                    temperature=float(temperature),
                    top_p=float(top_p),
                    max_new_tokens=max_new_tokens,
                    eos_id=eos_id,
                    pad_id=pad_id,
                    gen=gen,
                    lean=lean_decode,
                    keep_distribution=keep_distribution,
                )
            baseline = None
            if greedy_baseline:  # one greedy decode per prompt, repeated for each of its rows
                prompts = torch.arange(len(examples), device=device)
                with hooks.phase("decode"):
                    greedy = _decode(
                        model,
                        ids,
                        pmask,
                        prompts,
                        temperature=0.0,
                        top_p=1.0,
                        max_new_tokens=max_new_tokens,
                        eos_id=eos_id,
                        pad_id=pad_id,
                        gen=gen,
                        lean=lean_decode,
                    )
                baseline = assemble_rollout(
                    tokenizer, examples, ids, pmask, prompts, greedy, eos_id=eos_id, temperature=0.0
                ).select(rows)
    finally:
        model.train(was_training)
    return assemble_rollout(
        tokenizer,
        examples,
        ids,
        pmask,
        rows,
        decoded,
        eos_id=eos_id,
        temperature=temperature,
        baseline=baseline,
    )


def _unpack(what: str, rollout_or_ids, prompt_mask, response_ids) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(rollout_or_ids, Rollout):
        return rollout_or_ids.prompt_ids, rollout_or_ids.prompt_mask, rollout_or_ids.response_ids
    if prompt_mask is None or response_ids is None:
        raise ShapeError(f"{what}: pass a Rollout, or prompt_ids, prompt_mask and response_ids")
    prompt_ids = rollout_or_ids
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ShapeError(
            f"{what}: prompt_ids and prompt_mask must both be [B,P], got "
            f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}"
        )
    if response_ids.dim() != 2 or response_ids.shape[0] != prompt_ids.shape[0]:
        raise ShapeError(
            f"{what}: response_ids must be [B,T] with B={prompt_ids.shape[0]}, "
            f"got {tuple(response_ids.shape)}"
        )
    return prompt_ids, prompt_mask, response_ids


def sequence_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, position_ids) [B,P+T] of concat(prompt, response) (module docstring)."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask.long(), torch.ones_like(response_ids, dtype=torch.long)], dim=1)
    return input_ids, attn, position_ids_from_mask(attn)


def response_logprobs(
    model,
    rollout_or_prompt_ids: Rollout | Tensor,
    prompt_mask: Tensor | None = None,
    response_ids: Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_logits: bool = False,
    logit_rows: bool = False,
) -> Tensor | TokenLogprobs:
    """Log-prob of each response token under `model`, from ONE forward over concat(prompt, response).

    Call as `response_logprobs(model, rollout)` or `response_logprobs(model, prompt_ids [B,P],
    prompt_mask [B,P], response_ids [B,T])` (e.g. on a micro-batch). Logits are divided by
    `temperature` (pass the rollout's; 0 is treated as 1) before the log-softmax, so for the sampling
    model and temperature the result equals `rollout.rollout_logp` on masked-in tokens.
    Differentiable (no no_grad here). Values at positions after the EOS are meaningless: multiply by
    `mask`.

    Without `return_logits`, where `output_projection(model)` finds the projection and the [B,T,V]
    logits exceed one chunk (`fused_logprobs.fuses`), they are never held: the last hidden states go
    through `fused_logprobs.token_logprobs` (a chunk of rows at a time, recomputed in the backward),
    whose values equal the plain log-softmax's up to float reordering of the projection's sums and
    of the backward. Otherwise the plain path: the logits, fp32, then
    log_softmax over the vocabulary.

    Returns logp [B,T] fp32; if `with_entropy`, `return_logits` or `logit_rows`, a
    TokenLogprobs(logp, entropy [B,T] of the temperature-scaled distribution, logits already divided
    by the temperature) with None for what was not asked. The logits: [B,T,V] for `return_logits`;
    for `logit_rows` (an exact-KL part's input) a LogitRows: on the fused path a `HeadLogits` over
    the same hidden states, never held whole; on the plain path the [B,T,V] tensor wrapped.
    """
    prompt_ids, prompt_mask, response_ids = _unpack(
        "response_logprobs", rollout_or_prompt_ids, prompt_mask, response_ids
    )
    input_ids, attn, pos = sequence_inputs(prompt_ids, prompt_mask, response_ids)
    return scored_logprobs(
        model,
        input_ids,
        attn,
        pos,
        response_ids,
        temperature=temperature,
        with_entropy=with_entropy,
        return_logits=return_logits,
        logit_rows=logit_rows,
    )


def response_values(
    critic,
    rollout_or_prompt_ids: Rollout | Tensor,
    prompt_mask: Tensor | None = None,
    response_ids: Tensor | None = None,
) -> Tensor:
    """Critic values V(s_t) [B,T]: the scalar at the position that predicts response token t.

    `critic` is a ScalarHeadModel ((input_ids, attention_mask, position_ids) -> [B,S]); one forward over
    concat(prompt, response), like `response_logprobs`. Differentiable; multiply by `mask`.
    """
    prompt_ids, prompt_mask, response_ids = _unpack(
        "response_values", rollout_or_prompt_ids, prompt_mask, response_ids
    )
    t = response_ids.shape[1]
    input_ids, attn, pos = sequence_inputs(prompt_ids, prompt_mask, response_ids)
    values = critic(input_ids, attn, pos)
    return values[:, -t - 1 : -1]


def rollout_scores(reward_model, rollout: Rollout) -> Tensor:
    """Reward-model scores [B], read at each row's last generated token (the EOS unless truncated)."""
    return sequence_scores(reward_model, rollout.input_ids, rollout.attention_mask)
