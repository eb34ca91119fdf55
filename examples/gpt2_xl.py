"""GPT-2 XL (1.5B parameters) from its Hugging Face config: no weights, no network.

Defaults: 48 layers, hidden 1600, 25 heads, seq 1024, batch 16, bf16, attention through
`scaled_dot_product_attention`. Profile it without a GPU with
`slackswap profile examples/gpt2_xl.py --device fake --hardware a100-pcie4`; make it tiny with
`--arg n_layer=2 --arg n_embd=64 --arg n_head=4 --arg seq=32 --arg batch=2`.

Attention dropout defaults to 0: a flash-attention kernel on the GPU regenerates its dropout
mask in backward instead of saving it, which a trace on the CPU cannot express (there,
dropout inside attention falls back to the math kernel and materialises the seq x seq
matrix). Residual and embedding dropout stay at GPT-2's 0.1.

The activation is "gelu_pytorch_tanh": the same tanh-approximated GELU as GPT-2's default
"gelu_new", computed by one fused kernel (`F.gelu(approximate="tanh")`) instead of eight
Python-level ops that each save their output for backward (about 16 extra bytes per token and
hidden unit per layer). Pass `--arg activation=gelu_new` to profile the slow variant.
"""
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    GPT2Config,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "gpt2-xl"


# Without an attention mask, eager transformers checks at run time that the batch holds no
# padding and no packed sequences, passes no mask and lets SDPA run causal flash attention.
# Under a tracer it cannot look at the data, so it builds a (batch, 1, seq, seq) mask that
# every layer converts and saves for backward: memory a real training step never spends.
# "sdpa_causal" is SDPA with that promise made up front (this batch has no padding).
AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)


def workload(n_layer=48, n_embd=1600, n_head=25, seq=1024, batch=16, vocab=50257,
             dtype="bfloat16", activation="gelu_pytorch_tanh", attn_pdrop=0.0, resid_pdrop=0.1,
             embd_pdrop=0.1, seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq,
                        vocab_size=vocab, activation_function=activation, attn_pdrop=attn_pdrop,
                        resid_pdrop=resid_pdrop, embd_pdrop=embd_pdrop,
                        attn_implementation="sdpa_causal", use_cache=False)
    # built directly in its dtype: `.to(dtype)` cannot convert FakeTensor parameters
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    input_ids = torch.randint(0, vocab, (batch, seq))
    # the model shifts labels itself: next-token prediction on the same ids
    return model, {"input_ids": input_ids, "labels": input_ids}
