"""BERT-Large (340M parameters) masked-language-model training from its Hugging Face config.

Defaults: 24 layers, hidden 1024, 16 heads, intermediate 4096, seq 512, batch 32, bf16,
attention through `scaled_dot_product_attention`; 15% of positions carry a label (the rest are
-100, ignored by the loss). No weights, no network. Make it tiny with
`--arg n_layer=2 --arg hidden=64 --arg n_head=4 --arg seq=32 --arg batch=2`.

Attention dropout defaults to 0 (see gpt2_xl.py: a flash kernel on the GPU saves no mask, a
CPU trace would fall back to the math kernel); hidden dropout stays at BERT's 0.1.
"""
import torch
from transformers import AutoModelForMaskedLM, BertConfig

NAME = "bert-large"


def workload(n_layer=24, hidden=1024, n_head=16, intermediate=None, seq=512, batch=32,
             vocab=30522, dtype="bfloat16", attn_dropout=0.0, hidden_dropout=0.1,
             mask_fraction=0.15, seed=0):
    torch.manual_seed(seed)
    config = BertConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                        intermediate_size=intermediate or 4 * hidden, vocab_size=vocab,
                        max_position_embeddings=max(512, seq),
                        attention_probs_dropout_prob=attn_dropout,
                        hidden_dropout_prob=hidden_dropout, attn_implementation="sdpa")
    # built directly in its dtype: `.to(dtype)` cannot convert FakeTensor parameters
    model = AutoModelForMaskedLM.from_config(config, dtype=getattr(torch, dtype))
    input_ids = torch.randint(0, vocab, (batch, seq))
    masked = torch.rand(batch, seq) < mask_fraction
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    return model, {"input_ids": input_ids, "labels": labels}
