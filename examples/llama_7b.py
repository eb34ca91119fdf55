"""A Llama-7B-style decoder (6.7B parameters) from Hugging Face's LlamaConfig: no weights.

Defaults: 32 layers, hidden 4096, 32 heads, intermediate 11008, vocab 32000, seq 4096, batch 2,
bf16, attention through `scaled_dot_product_attention` (Llama has no dropout). Nothing is
allocated with `--device fake`. Make it tiny with `--arg n_layer=2 --arg hidden=64
--arg n_head=4 --arg intermediate=172 --arg seq=32 --arg vocab=128`.
"""
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    LlamaConfig,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "llama-7b"


# Without an attention mask, eager transformers checks at run time that the batch holds no
# padding and no packed sequences, passes no mask and lets SDPA run causal flash attention.
# Under a tracer it cannot look at the data, so it builds a (batch, 1, seq, seq) mask that
# every layer converts and saves for backward: memory a real training step never spends.
# "sdpa_causal" is SDPA with that promise made up front (this batch has no padding).
AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)


def workload(n_layer=32, hidden=4096, n_head=32, intermediate=11008, vocab=32000, seq=4096,
             batch=2, dtype="bfloat16", seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                         num_key_value_heads=n_head, intermediate_size=intermediate,
                         vocab_size=vocab, max_position_embeddings=seq,
                         attn_implementation="sdpa_causal", use_cache=False)
    # built directly in its dtype, so the rotary `inv_freq` buffer stays fp32 as Hugging Face
    # means it to (`.to(dtype)` would convert it too; see llama_7b_to_bf16.py)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    input_ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids}
