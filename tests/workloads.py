"""The small real models the torch tests share (tiny GPT, Hugging Face GPT-2/BERT/Llama from
config classes, a BatchNorm CNN, an MLP), their fake-tensor profiles (made once per session),
and plan helpers. The `files` fixture (conftest.py) writes the sources to a temporary folder."""
from pathlib import Path

from slackswap_cli import op_cost
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan
from slackswap_cli.run.emit import apply_plan
from slackswap_cli.schema import Decision, Plan, Predicted
from slackswap_cli.simulate import budget_floor_bytes
from slackswap_cli.trace import profile_workload

HW = PRESETS["a100-pcie4"]
ROOT = Path(__file__).resolve().parents[1]

HF_GPT2 = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=seq,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    ids = torch.randint(0, 128, (batch, seq))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
'''
HF_BERT = '''
import torch
from transformers import BertConfig, BertForMaskedLM
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, vocab_size=128, max_position_embeddings=seq,
                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    ids = torch.randint(0, 128, (batch, seq))
    return BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}
'''
HF_LLAMA = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                      max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, use_cache=False)
    ids = torch.randint(0, 128, (batch, seq))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
'''
# grouped-query attention as current LLMs have it: 4 key/value heads for 8 heads (repeat_kv:
# unsqueeze, expand, clone, _unsafe_view), for Llama, Mistral (sliding window) and Qwen2 (whose
# q/k/v projections have biases)
HF_GQA = '''
import torch
from transformers import CONFIG, MODEL
def workload(batch=2, seq=16):
    torch.manual_seed(0)
    cfg = CONFIG(num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=128, vocab_size=128,
                 max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
                 pad_token_id=0, use_cache=False EXTRA)
    ids = torch.randint(0, 128, (batch, seq))
    return MODEL(cfg), {"input_ids": ids, "labels": ids}
'''
GQA = {"llama_gqa": ("LlamaConfig", "LlamaForCausalLM", ""),
       "mistral_gqa": ("MistralConfig", "MistralForCausalLM", ", sliding_window=8"),
       "qwen2_gqa": ("Qwen2Config", "Qwen2ForCausalLM", "")}
# ViT's loss sets config.problem_type on its first call: dynamo's guard on it fails at the
# second step, so the whole model recompiles once
HF_VIT = '''
import torch
from transformers import ViTConfig, ViTForImageClassification
def workload(batch=2):
    torch.manual_seed(0)
    cfg = ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                    intermediate_size=64, image_size=16, patch_size=4, num_labels=3,
                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, 16, 16),
                                            "labels": torch.tensor([0, 2])}
'''
CNN = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 10))
    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)
def workload(batch=4):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,)))
'''
MLP = '''
import torch, torch.nn as nn, torch.nn.functional as F
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
    def forward(self, x):
        return self.fc2(F.ACT(self.fc1(x))).pow(2).mean()
def workload():
    torch.manual_seed(0)
    return MLP(), (torch.randn(4, 16),)
'''
# Llama as its config comes (use_cache on): the first update of the KV cache copies the key
# and value states (`torch.cat([empty, key_states])`), a copy inductor drops
HF_LLAMA_CACHE = HF_GQA.replace("CONFIG", "LlamaConfig").replace("MODEL", "LlamaForCausalLM") \
    .replace("use_cache=False EXTRA", "use_cache=True")
SOURCES = {"gpt2": HF_GPT2, "llama_cache": HF_LLAMA_CACHE, "bert": HF_BERT, "llama": HF_LLAMA, "vit": HF_VIT, "cnn": CNN,
           "mlp": MLP.replace("ACT", "gelu"),
           **{name: HF_GQA.replace("CONFIG", c).replace("MODEL", m).replace(" EXTRA", x)
              for name, (c, m, x) in GQA.items()}}
_PROFILES: dict = {}


def profiled(files, name, device="fake"):
    """The profile of workload `name` (made once per session, device and cost model: a test
    that prices ops otherwise, helpers.two_us_kernels, gets profiles of its own)."""
    key = (name, device, op_cost.default_cost_model().digest)
    if key not in _PROFILES:
        _PROFILES[key] = profile_workload(str(files[name]), device=device, hardware=HW)
    return _PROFILES[key]


def plan_at(prof, budget_bytes):
    peak = prof.summary["peak_activation_bytes"]
    return make_plan("slackswap", prof, HW, int(budget_bytes), budget_bytes / peak)


def smallest_feasible(prof, hi):
    """Bisect the budget between the simulator's floor and a feasible budget `hi`."""
    lo = budget_floor_bytes(prof)
    best = plan_at(prof, hi)
    assert best.feasible
    for _ in range(6):
        mid = (lo + hi) // 2
        p = plan_at(prof, mid)
        if p.feasible:
            best, hi = p, mid
        else:
            lo = mid
    return best


def hand_plan(prof, actions: dict[str, str]) -> Plan:
    """A plan deciding by tensor name (everything else kept), no schedule, zero predictions."""
    ids = {t.name: t.id for t in prof.tensors}
    decisions = tuple(Decision(t.id, actions.get(t.name, "keep")) for t in prof.saved_activations)
    assert set(actions) <= {prof.tensors[d.tensor].name for d in decisions}, ids
    return Plan(profile_fingerprint=prof.fingerprint, planner="hand", hardware=HW.to_dict(),
                budget_bytes=0, budget_fraction=None, feasible=True, decisions=decisions,
                schedule=(), predicted=Predicted(0, 0, 0, 0, 0, 0, 0, 0, 0))


def write_patched(tmp_path, plan, prof, name="patched.py", **kw):
    path = tmp_path / name
    path.write_text(apply_plan(plan, prof, **kw))
    return path




def train_on_random_tokens(work, model, forward=None, steps: int = 3) -> list:
    """`steps` AdamW steps (lr 1e-2) of `model` on random token ids (0..127) shaped like the
    workload's inputs, drawn from the caller's seed (in the distributed tests: each rank its
    own data); `forward` runs the step's forward (a DDP wrapper), `model` by default. The
    detached losses."""
    import torch

    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    forward = forward or model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        inputs = work.inputs
        if isinstance(inputs, dict):
            ids = torch.randint(0, 128, inputs["input_ids"].shape)
            inputs = {**inputs, "input_ids": ids, "labels": ids}
        else:
            inputs = tuple(torch.randint(0, 128, x.shape) for x in inputs)
        a, kw = split_inputs(inputs)
        loss = loss_from_output(forward(*a, **kw), inputs, work.loss_fn)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def adamw_steps(model, work, steps: int = 3, lr: float = 1e-2):
    """`steps` AdamW steps of `model` (the workload's model, or what wraps or compiles it) on
    the workload's own inputs, from seed 1: the losses and the parameters and buffers after."""
    import torch

    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    opt = torch.optim.AdamW(work.model.parameters(), lr=lr)
    losses = []
    torch.manual_seed(1)
    for _ in range(steps):
        a, kw = split_inputs(work.inputs)
        loss = loss_from_output(model(*a, **kw), work.inputs, work.loss_fn)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [t.detach().clone() for t in [*work.model.parameters(), *work.model.buffers()]]


def token_dataset(ids, n: int = 6):
    """A Hugging Face Trainer dataset of `n` items cycling through the rows of `ids`, each its
    own labels."""
    import torch

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i % len(ids)], "labels": ids[i % len(ids)]}
    return Data()

