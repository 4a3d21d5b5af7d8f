"""The models of RLHF-PPO, built from a config (no model hub): policy, reference, critic, reward.

    tokenizer            character-level, one token per character of `task.alphabet` + 4 specials
    subword              or a byte-level BPE learnt from the task's demonstrations
                         (train.model_kwargs = {'subword_vocab': 256})
    build_tiny(task)     a fresh Qwen2ForCausalLM (~0.6M parameters, fp32, head_dim 32) + tokenizer
    load_policy(path)    trainable AutoModelForCausalLM, dropout off;  load_reference(path): frozen
    checkpoint_activations  recompute each layer in the backward (train.gradient_checkpointing)
    load_tokenizer(path) left-padding; no pad token -> pads with EOS (warned)
    lora                 LoRA through peft: adapter on the frozen backbone, reference = adapter
                         disabled, a critic on the same backbone, merged export (train.lora_r)
    ScalarHeadModel      AutoModel backbone + Linear(hidden, 1): per-position scalars [B,S]
                         (the critic, see components/value_init.py, and the reward model)
    load_reward_model    frozen ScalarHeadModel; `sequence_scores` reads its score at the EOS token
    cache                the on-disk cache of trained checkpoints and their polgrad.json
    check_inputs         the task's prompts fit the model's positions and survive its tokenizer
    compiled             torch.compile of the forwards and the lean decode step (train.compile)

Training the policy's warm start and the reward model (which needs rollouts and tasks) lives one
layer up, in polgrad.pretrain (`warm_start`, `train_reward_model`).

Modules: tokenizer (token layout, encode_prompts / encode_sequences), subword (the BPE), tiny (the
preset), threads (thread count, seeding), cache (cache dir, keys, entries), loading (policy /
reference), heads (ScalarHeadModel), lora (peft adapters). This package imports only torch,
transformers, safetensors, peft, tokenizers and polgrad's bottom layer; transformers, tokenizers and
peft are imported inside the functions that need them.
"""

from polgrad.models import compiled, lora
from polgrad.models.cache import (
    MODEL_CODE_VERSION,
    POLGRAD_JSON,
    checkpoint_fingerprint,
    default_cache_dir,
    digest,
    read_info,
    write_info,
)
from polgrad.models.heads import HEAD_FILE, ScalarHeadModel, load_reward_model, sequence_scores
from polgrad.models.inputs import check_inputs
from polgrad.models.loading import (
    check_dir,
    checkpoint_activations,
    freeze,
    load_config,
    load_policy,
    load_reference,
)
from polgrad.models.threads import default_num_threads, seeded, torch_threads
from polgrad.models.tiny import ATTN_IMPLEMENTATION, build_tiny, resolved_model_kwargs, tiny_positions
from polgrad.models.tokenizer import (
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    build_tokenizer,
    encode_pairs,
    encode_prompts,
    encode_sequences,
    load_tokenizer,
    position_ids_from_mask,
    prompt_ids,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BOS",
    "EOS",
    "HEAD_FILE",
    "MODEL_CODE_VERSION",
    "PAD",
    "POLGRAD_JSON",
    "SPECIAL_TOKENS",
    "UNK",
    "ScalarHeadModel",
    "build_tiny",
    "build_tokenizer",
    "check_dir",
    "checkpoint_activations",
    "check_inputs",
    "checkpoint_fingerprint",
    "default_cache_dir",
    "default_num_threads",
    "digest",
    "encode_prompts",
    "prompt_ids",
    "encode_pairs",
    "encode_sequences",
    "freeze",
    "load_config",
    "load_policy",
    "load_reference",
    "load_reward_model",
    "load_tokenizer",
    "compiled",
    "lora",
    "position_ids_from_mask",
    "read_info",
    "resolved_model_kwargs",
    "seeded",
    "sequence_scores",
    "tiny_positions",
    "torch_threads",
    "write_info",
]
