"""The step NeuSight measured, as a slackswap workload: a Hugging Face model from one of the
configs in benchmarks/data/gpu_truth/model_configs/, fp32, eager attention, trained on
`cross_entropy(logits.view(-1, V), input_ids.view(-1))` (their loss: next-token labels are the
inputs themselves). BERT is `AutoModelForPreTraining`, the GPT-2/GPT-3/OPT configs
`AutoModelForCausalLM`. `n_layer` overrides the config's layer count (the per-op files measure
the one-layer model). Used by benchmarks/gpu_truth_profiles.py.
"""
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForPreTraining

NAME = "gpu-truth"
CONFIGS = Path(__file__).parent / "data" / "gpu_truth" / "model_configs"
_LAYERS = ("num_hidden_layers", "n_layer")


def workload(model="bert_large", seq=512, batch=2, n_layer=None):
    data = json.loads((CONFIGS / f"{model}.json").read_text())
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    if n_layer is not None:
        for key in _LAYERS:
            if hasattr(config, key):
                setattr(config, key, n_layer)
    config._attn_implementation = "eager"
    cls = AutoModelForPreTraining if config.model_type == "bert" else AutoModelForCausalLM
    net = cls.from_config(config, dtype=torch.float32, attn_implementation="eager")
    vocab = config.vocab_size
    input_ids = torch.randint(0, vocab, (batch, seq))

    def loss_fn(output, inputs):
        logits = output[0] if isinstance(output, tuple) else output.logits \
            if hasattr(output, "logits") else output.prediction_logits
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 inputs["input_ids"].view(-1))
    return net, {"input_ids": input_ids}, loss_fn
