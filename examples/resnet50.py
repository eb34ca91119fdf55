"""ResNet-50 image classification from its Hugging Face config: no weights, no network.

Defaults: ResNet-50 (stages of 3/4/6/3 bottleneck blocks, widths 256-2048), batch 128, 224x224
images, bf16, 1000 classes. Profile it without a GPU with
`slackswap profile examples/resnet50.py --device fake --hardware a100-pcie4`; make it tiny with
`--arg depths=[1,1] --arg widths=[32,64] --arg image=32 --arg batch=2 --arg dtype=float32`.

BatchNorm runs in training mode: its batch statistics are saved for backward and its running
statistics (buffers) are updated, which `slackswap apply` reproduces exactly.
"""
import torch
from transformers import ResNetConfig, ResNetForImageClassification

NAME = "resnet50"


def workload(depths=(3, 4, 6, 3), widths=(256, 512, 1024, 2048), embedding=64, image=224,
             batch=128, classes=1000, dtype="bfloat16", seed=0):
    torch.manual_seed(seed)
    config = ResNetConfig(depths=list(depths), hidden_sizes=list(widths), embedding_size=embedding,
                          layer_type="bottleneck", num_labels=classes)
    # built directly in its dtype: `.to(dtype)` cannot convert FakeTensor parameters
    model = ResNetForImageClassification._from_config(config, dtype=getattr(torch, dtype))
    pixels = torch.randn(batch, 3, image, image, dtype=getattr(torch, dtype))
    labels = torch.randint(0, classes, (batch,))
    return model, {"pixel_values": pixels, "labels": labels}
