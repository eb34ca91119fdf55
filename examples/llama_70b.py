"""A Llama-70B-style decoder (about 69B parameters) from Hugging Face's LlamaConfig: no weights.

Defaults: 80 layers, hidden 8192, 64 heads with 8 key/value heads (grouped-query attention),
intermediate 28672, vocab 32000, seq 4096, batch 1, bf16, attention through
`scaled_dot_product_attention`. Nothing is allocated with `--device fake`: it profiles on a
laptop. See llama_7b.py for why attention is registered as "sdpa_causal".
"""
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    LlamaConfig,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "llama-70b"

AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)


def workload(n_layer=80, hidden=8192, n_head=64, n_kv_head=8, intermediate=28672, vocab=32000,
             seq=4096, batch=1, dtype="bfloat16", seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                         num_key_value_heads=n_kv_head, intermediate_size=intermediate,
                         vocab_size=vocab, max_position_embeddings=seq,
                         attn_implementation="sdpa_causal", use_cache=False)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    input_ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids}
