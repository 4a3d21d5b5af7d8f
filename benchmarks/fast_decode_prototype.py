"""Prototype (not used by polgrad): a leaner KV-cache decode step for the tiny Qwen2, to size the gain.

polgrad.rollout.hf._decode calls the Hugging Face Qwen2 forward once per new token. On the bench
workload (64 rows, 4 layers, hidden 128) that costs ~3.5-5 ms per token while the matmuls of a step are
~0.1 GFLOP (well under 1 ms at the machine's measured ~100 GFLOP/s): the step is overhead-bound. The
profile shows where: DynamicCache grows by torch.cat every step (O(L^2) copying), GQA K/V are
materialised by repeat_kv every step, a 4-D mask is rebuilt every step, RoPE cos/sin recomputed, q/k/v
and gate/up are separate matmuls, plus the module/kwargs machinery around ~40 small ops per layer.

This file decodes with the same weights using: a preallocated cache written in place, one fused
qkv matmul and one fused gate-up matmul per layer, SDPA with enable_gqa (no K/V copies), a RoPE table
computed once, a boolean mask built once. The prefill still runs the HF forward (its KV is copied into
the static cache). `python benchmarks/fast_decode_prototype.py` checks that its logits match the HF
forward step by step and times both (interleaved) on the bench workload.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F


class StaticDecoder:
    def __init__(self, model, batch: int, max_len: int):
        cfg = model.config
        self.m = model.model
        self.lm_head = model.lm_head.weight
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.nh
        self.eps = cfg.rms_norm_eps
        self.layers = []
        for layer in self.m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                dict(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                    bqkv=torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach(),
                    wo=a.o_proj.weight,
                    wgu=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                    wd=mlp.down_proj.weight,
                    k=torch.zeros(batch, self.nkv, max_len, self.hd),
                    v=torch.zeros(batch, self.nkv, max_len, self.hd),
                )
            )
        inv_freq = self.m.rotary_emb.inv_freq
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_len = max_len

    def _norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def _rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def load_prefill(self, cache, prompt_mask):
        p = prompt_mask.shape[1]
        for lay, cl in zip(self.layers, cache.layers, strict=True):
            lay["k"][:, :, :p] = cl.keys
            lay["v"][:, :, :p] = cl.values
        self.mask = torch.zeros(prompt_mask.shape[0], 1, 1, self.max_len, dtype=torch.bool)
        self.mask[:, 0, 0, :p] = prompt_mask.bool()
        self.t = p

    @torch.no_grad()
    def step(self, token, pos):
        """token [B], pos [B] (positions counting attended tokens) -> logits [B,V]."""
        b = token.shape[0]
        t = self.t
        self.mask[:, 0, 0, t] = True
        x = F.embedding(token, self.m.embed_tokens.weight)[:, None]  # [B,1,H]
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [B,1,1,D]
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        for lay in self.layers:
            h = self._norm(x, lay["ln1"])
            qkv = F.linear(h, lay["wqkv"], lay["bqkv"])
            q = qkv[..., :nq].view(b, 1, self.nh, self.hd).transpose(1, 2)
            k = qkv[..., nq : nq + nk].view(b, 1, self.nkv, self.hd).transpose(1, 2)
            v = qkv[..., nq + nk :].view(b, 1, self.nkv, self.hd).transpose(1, 2)
            q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
            lay["k"][:, :, t : t + 1] = k
            lay["v"][:, :, t : t + 1] = v
            o = F.scaled_dot_product_attention(
                q,
                lay["k"][:, :, : t + 1],
                lay["v"][:, :, : t + 1],
                attn_mask=self.mask[..., : t + 1],
                enable_gqa=True,
            )
            x = x + F.linear(o.transpose(1, 2).reshape(b, 1, nq), lay["wo"])
            h = self._norm(x, lay["ln2"])
            g, u = F.linear(h, lay["wgu"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, lay["wd"])
        x = self._norm(x, self.m.norm.weight)
        self.t = t + 1
        return F.linear(x[:, 0], self.lm_head)


def _sample(logits, gen):
    logp = F.log_softmax(logits, -1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


@torch.no_grad()
def decode_static(model, prompt_ids, prompt_mask, max_new_tokens, seed, check=False):
    from transformers import DynamicCache

    from polgrad.models import position_ids_from_mask

    b, p = prompt_ids.shape
    dec = StaticDecoder(model, b, p + max_new_tokens)
    attn = prompt_mask.long()
    pos = position_ids_from_mask(attn)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompt_ids,
        attention_mask=attn,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    dec.load_prefill(cache, prompt_mask)
    logits = out.logits[:, -1].float()
    next_pos = pos[:, -1] + 1
    gen = torch.Generator().manual_seed(seed)
    toks, max_diff = [], 0.0
    for i in range(max_new_tokens):
        tok, _ = _sample(logits, gen)
        toks.append(tok)
        if i == max_new_tokens - 1:
            break
        logits = dec.step(tok, next_pos)
        if check:  # the HF forward on the same token, same cache contents
            attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype)], 1)
            ref = model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            max_diff = max(max_diff, float((ref - logits).abs().max()))
        next_pos = next_pos + 1
    return torch.stack(toks, 1), max_diff


def main() -> None:
    import tempfile

    from polgrad import bench, models
    from polgrad.rollout import hf

    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    w = bench.Workload()
    with tempfile.TemporaryDirectory() as d:
        bench.make_model(d, w)
        model = models.load_policy(d).eval()
        tok = models.load_tokenizer(d)
    ex = bench._task().examples("train", w.prompts, 0)
    ids, pm = models.encode_prompts(tok, [e.prompt for e in ex])
    rows = torch.arange(w.prompts).repeat_interleave(w.group_size)
    ids, pm = ids[rows], pm[rows]
    _, diff = decode_static(model, ids, pm, w.max_new_tokens, 0, check=True)
    print(f"max |logit diff| vs the HF forward over {w.max_new_tokens} steps: {diff:.2e}")
    for n in (32, 128):
        t_hf, t_st = [], []
        for r in range(12):
            a = time.perf_counter()
            hf.generate(model, tok, ex, group_size=w.group_size, max_new_tokens=n, generator_seed=r)
            b = time.perf_counter()
            decode_static(model, ids, pm, n, r)
            c = time.perf_counter()
            if r >= 2:
                t_hf.append(b - a)
                t_st.append(c - b)
        print(
            f"L={n}, {threads} threads: polgrad hf.generate {statistics.median(t_hf) * 1e3:.1f} ms, "
            f"static prototype {statistics.median(t_st) * 1e3:.1f} ms, "
            f"ratio {statistics.median([x / y for x, y in zip(t_hf, t_st, strict=True)]):.2f}x"
        )


if __name__ == "__main__":
    main()
