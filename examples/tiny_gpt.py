"""A tiny GPT (our own, no dependencies beyond torch): profiles in about a second on a CPU.

Copy this file as a template for your own workload. `slackswap profile examples/tiny_gpt.py`
calls `workload()`; override any argument with `--arg name=value`, e.g.
`--arg n_layer=4 --arg seq=256`. It returns `(model, inputs)`: the model takes token ids and
targets and returns the scalar cross-entropy loss, so no `loss_fn` is needed.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.p_attn = dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.p_attn if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.dropout(self.proj(y))
        x = x + self.dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))
        return x


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, n_layer: int, d_model: int, n_head: int,
                 dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def workload(n_layer=2, d_model=64, n_head=4, seq=32, batch=2, vocab=128, dropout=0.1, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab, seq, n_layer, d_model, n_head, dropout)
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return model, (idx, targets)
