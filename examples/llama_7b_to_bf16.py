"""Llama 7B as people usually write it: the default `LlamaConfig()`, built, then `.to(bfloat16)`.

`LlamaForCausalLM(LlamaConfig()).to(torch.bfloat16)` is 6.7B parameters (32 layers, hidden
4096, vocab 32000). With `--device fake` it is built from fake tensors (nothing allocated), and
the `.to(torch.bfloat16)` converts those. Unlike `llama_7b.py` it keeps every transformers
default, so attention gets the (batch, 1, seq, seq) mask a tracer cannot prove unnecessary.
Make it tiny with `--arg n_layer=2 --arg hidden=64 --arg n_head=4 --arg intermediate=172
--arg seq=32 --arg vocab=128`.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

NAME = "llama-7b-to-bf16"


def workload(seq=2048, batch=1, n_layer=None, hidden=None, n_head=None, intermediate=None,
             vocab=None, seed=0):
    torch.manual_seed(seed)
    overrides = {"num_hidden_layers": n_layer, "hidden_size": hidden,
                 "num_attention_heads": n_head, "num_key_value_heads": n_head,
                 "intermediate_size": intermediate, "vocab_size": vocab}
    config = LlamaConfig(**{k: v for k, v in overrides.items() if v is not None})
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids}
