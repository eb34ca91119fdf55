"""Small models nobody on the team wrote, for `run_robustness.py` and the alignment tests:
Hugging Face causal LMs, encoders and a vision transformer built from their config classes (no
weights, no hub), torch's own transformer modules, and a model with in-place ops. Each is the
source of a workload file: `workload(batch, seq)` returns (model, inputs)."""
from __future__ import annotations

_CAUSAL = '''
import torch
from transformers import {cfg}, {cls}
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = {cfg}(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                max_position_embeddings=64, use_cache=False{extra})
    ids = torch.randint(1, 128, (batch, seq))
    return {cls}(cfg), {{"input_ids": ids, "labels": ids}}
'''
GPT2 = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                     use_cache=False)
    ids = torch.randint(1, 128, (batch, seq))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
'''
BERT = '''
import torch
from transformers import BertConfig, BertForMaskedLM
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                     intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    ids = torch.randint(1, 128, (batch, seq))
    return BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}
'''
T5 = '''
import torch
from transformers import T5Config, T5ForConditionalGeneration
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4,
                   d_ff=64, vocab_size=128, decoder_start_token_id=0, use_cache=False)
    ids = torch.randint(1, 128, (batch, seq))
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids}
'''
VIT = '''
import torch
from transformers import ViTConfig, ViTForImageClassification
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    side = int(round((seq) ** 0.5)) * 4          # seq patches of 4x4
    cfg = ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                    intermediate_size=64, image_size=side, patch_size=4, num_labels=3)
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, side, side),
                                            "labels": torch.randint(0, 3, (batch,))}
'''
ENCODER = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Net(nn.Module):
    def __init__(s, d=32, vocab=128):
        super().__init__()
        s.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        s.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        s.out = nn.Linear(d, vocab)
    def forward(s, ids):
        return F.cross_entropy(s.out(s.enc(s.emb(ids))).flatten(0, 1), ids.flatten())
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    return Net(), (torch.randint(0, 128, (batch, seq)),)
'''
MHA = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Block(nn.Module):
    def __init__(s, d):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        s.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(s, x, mask):
        h = s.ln1(x)
        x = x + s.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + s.mlp(s.ln2(x))
class Net(nn.Module):
    def __init__(s, d=32, vocab=128):
        super().__init__()
        s.emb = nn.Embedding(vocab, d)
        s.blocks = nn.ModuleList(Block(d) for _ in range(2))
        s.out = nn.Linear(d, vocab)
    def forward(s, ids):
        n = ids.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        x = s.emb(ids)
        for b in s.blocks:
            x = b(x, mask)
        return F.cross_entropy(s.out(x).flatten(0, 1), ids.flatten())
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    return Net(), (torch.randint(0, 128, (batch, seq)),)
'''
INPLACE = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Net(nn.Module):
    def __init__(s, d=32):
        super().__init__()
        s.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        s.ln = nn.LayerNorm(d)
    def forward(s, x):
        h = x
        for i, fc in enumerate(s.fc):
            y = fc(h)
            y.mul_(0.5).add_(h)               # chained in-place ops on a fresh value
            y.relu_()                         # in place, its result saved for backward
            h = s.ln(y) if i % 2 else y
        z = h.sigmoid() * 2
        z[:, 0] = 0.0                          # an in-place index write
        return z.pow(2).mean()
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch * seq, 32),)
'''
# a top-2 mixture of experts, `torch.where` routing: each expert runs on the tokens routed to
# it, so the sizes of what it saves follow the batch (profile with --device cpu: a real trace)
MOE = '''
import torch, torch.nn as nn, torch.nn.functional as F
class MoE(nn.Module):
    def __init__(s, d=32, n=4):
        super().__init__()
        s.gate = nn.Linear(d, n)
        s.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
                                  for _ in range(n))
    def forward(s, x):
        w, top = s.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for i, e in enumerate(s.experts):
            tok, slot = torch.where(top == i)
            out = out.index_add(0, tok, e(x[tok]) * w[tok, slot, None])
        return out
class Net(nn.Module):
    def __init__(s, d=32):
        super().__init__()
        s.inp, s.head = nn.Linear(16, d), nn.Linear(d, 4)
        s.moes = nn.ModuleList(MoE(d) for _ in range(2))
    def forward(s, x):
        h = s.inp(x)
        for m in s.moes:
            h = h + m(F.gelu(h))
        return s.head(h).pow(2).mean()
def workload(batch=2, seq=16, seed=0):
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(seed)            # another seed: another batch, another routing
    return model, (torch.randn(batch * seq, 16) * (1 + seed),)
'''
MODELS = {
    "qwen2": _CAUSAL.format(cfg="Qwen2Config", cls="Qwen2ForCausalLM", extra=""),
    "llama": _CAUSAL.format(cfg="LlamaConfig", cls="LlamaForCausalLM", extra=""),
    "mistral": _CAUSAL.format(cfg="MistralConfig", cls="MistralForCausalLM",
                              extra=", sliding_window=8"),
    "gpt2": GPT2, "bert": BERT, "t5": T5, "vit": VIT,
    "transformer-encoder": ENCODER, "mha": MHA, "inplace": INPLACE,
}
