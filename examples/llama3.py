"""Llama 3.1 8B / 70B and Llama 2 13B / 70B (Hugging Face's LlamaConfig, no weights), as
torchtitan's benchmarks ran them.

`size="8b"`: 32 layers, hidden 4096, 32 heads with 8 key/value heads, MLP 14336;
`size="70b"`: 80 layers, hidden 8192, 64 heads with 8 key/value heads, MLP 28672; both with
vocab 128256 (the Llama 3 tokenizer) and rope theta 500000 (torchtitan's `llama3` flavors).
`size="llama2-13b"`: 40 layers, hidden 5120, 40 heads (no grouped keys), MLP 13824;
`size="llama2-70b"`: 80 layers, hidden 8192, 64 heads with 8 key/value heads, MLP 28672;
both with vocab 32000 (the Llama 2 tokenizer) and rope theta 10000 (torchtitan's `llama2`
flavors at 1ea476e9f: the MLP width is 2/3 of 4 x hidden, times 1.3 on the 70B, rounded up to
a multiple of 256 and 4096).
`n_layer` overrides the depth (benchmarks/published_runs.py traces two and three layers and
scales by the depth). bf16 parameters, attention through `scaled_dot_product_attention` with
the causal flag (see llama_7b.py for why it is registered as "sdpa_causal"). Nothing is
allocated with `--device fake`.
"""
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    LlamaConfig,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "llama3"
SIZES = {   # layers, hidden, heads, kv heads, MLP, vocab, rope theta
    "8b": (32, 4096, 32, 8, 14336, 128256, 500000.0),
    "70b": (80, 8192, 64, 8, 28672, 128256, 500000.0),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 10000.0),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 10000.0),
}

AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)


def workload(size="8b", n_layer=None, seq=8192, batch=1, vocab=None, dtype="bfloat16", seed=0):
    torch.manual_seed(seed)
    layers, hidden, heads, kv_heads, mlp, size_vocab, theta = SIZES[size]
    vocab = size_vocab if vocab is None else vocab
    config = LlamaConfig(num_hidden_layers=layers if n_layer is None else n_layer,
                         hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=mlp,
                         vocab_size=vocab, max_position_embeddings=seq, rope_theta=theta,
                         attn_implementation="sdpa_causal", use_cache=False)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    input_ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids}
