"""The zoo's models (benchmarks/zoo.py): timm, Hugging Face transformers, diffusers and
torchvision, each built small from its library's own constructors (no weights, no hub), in
training mode with dropout (and drop-path where the model has it) on.

`entries(library)` lists (library, name) pairs; `build(library, name)` returns (model, inputs,
loss_fn) as `plan_model` takes them. Building imports the library, so listing stays cheap for
the parent process. A model whose tiny build or eager step fails is `BuildError`: the zoo
records it as skipped (the library's own failure, not slackswap's), with the message.
"""
from __future__ import annotations

import functools

LIBRARIES = ("timm", "transformers", "diffusers", "torchvision")
SEED = 0


class BuildError(Exception):
    """The library could not build or run the model eagerly at the zoo's tiny size."""


def entries(library: str) -> list[str]:
    return {"timm": timm_names, "transformers": hf_names, "diffusers": lambda: list(DIFFUSERS),
            "torchvision": lambda: list(TORCHVISION)}[library]()


def build(library: str, name: str):
    import torch
    torch.manual_seed(SEED)
    builder = {"timm": timm_build, "transformers": hf_build, "diffusers": diffusers_build,
               "torchvision": torchvision_build}[library]
    try:
        model, inputs, loss_fn = builder(name)
    except BuildError:
        raise
    except Exception as exc:          # the library's own build failing at this size
        raise BuildError(f"build: {type(exc).__name__}: {exc}") from exc
    model.train()
    _eager_step(model, inputs, loss_fn)
    return model, inputs, loss_fn


def _eager_step(model, inputs, loss_fn) -> None:
    """One eager training step on a copy: a model the library cannot train at this size is
    BuildError, not a finding about slackswap."""
    import copy

    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    twin = copy.deepcopy(model)
    try:
        a, kw = split_inputs(inputs)
        loss_from_output(twin(*a, **kw), inputs, loss_fn).backward()
    except Exception as exc:
        raise BuildError(f"eager training step: {type(exc).__name__}: {exc}") from exc


def classify_loss(out, inputs):
    """Cross-entropy of the logits against labels made here (0, 1, 2, ... per row), so the
    closure holds no tensor of its own."""
    import torch
    import torch.nn.functional as F
    logits = out if isinstance(out, torch.Tensor) else (
        out.logits if hasattr(out, "logits") else out[0])
    if logits.dim() > 2:                  # a dense head: pool what is left
        logits = logits.flatten(2).mean(-1)
    target = torch.arange(logits.shape[0], device=logits.device) % logits.shape[-1]
    return F.cross_entropy(logits.float(), target)


def square_loss(out, inputs):
    """Mean square of the first tensor output (diffusers models return `.sample`)."""
    import torch
    t = out if isinstance(out, torch.Tensor) else (
        out.sample if hasattr(out, "sample") else out[0])
    return t.float().pow(2).mean()


# -- timm ---------------------------------------------------------------------------------------

# Named in the bug report (in-place activations, MLP-Mixer): always in the zoo.
TIMM_EXTRA = ("mobilenetv3_small_100", "resnext26ts", "maxvit_rmlp_pico_rw_256",
              "maxvit_nano_rw_256", "coatnet_nano_rw_224", "mobilevit_xxs", "mobilevitv2_050",
              "tf_efficientnetv2_b0", "mixer_s32_224", "mixer_s16_224")
# families whose every model is large at any input, or needs inputs other than an image
TIMM_SKIP_FAMILIES = {"naflexvit", "gemma4_vit", "qwen3_vit", "deepseek_vit", "mobilenetv5",
                      "hieradet_sam2", "vision_transformer_sam"}
# the family's pick where the smallest-by-name is not small; keyword arguments for some
TIMM_PICK = {"senet": "legacy_seresnet18", "resnetv2": "resnetv2_18",
             "convmixer": "convmixer_768_32", "tresnet": "tresnet_m"}
TIMM_KW = {"beit_base_patch16_224": {"depth": 2}}
SMALL = ("atto", "femto", "pico", "nano", "xxs", "tiny", "xs", "mini", "_t", "small", "_s",
         "050", "_b0", "_0", "18", "21", "26", "b0", "a0", "s12")


def _size_rank(name: str) -> tuple:
    for i, tag in enumerate(SMALL):
        if tag in name:
            return (i, len(name), name)
    return (len(SMALL), len(name), name)


def timm_names() -> list[str]:
    """One model per timm family (the smallest by name), plus TIMM_EXTRA."""
    from timm.models._registry import _module_to_models
    picks = []
    for family in sorted(_module_to_models):
        if family in TIMM_SKIP_FAMILIES:
            continue
        names = sorted(n for n in _module_to_models[family] if "384" not in n
                       and "448" not in n and "512" not in n and "clip" not in n)
        if family in TIMM_PICK:
            picks.append(TIMM_PICK[family])
        elif names:
            picks.append(min(names, key=_size_rank))
    return picks + [n for n in TIMM_EXTRA if n not in picks]


def timm_build(name: str):
    """At side 64 where the model takes `img_size` (or runs at 64 as it is), else at its
    default input size; drop-path 0.1 where it has it."""
    import timm
    import torch
    kw = dict(pretrained=False, num_classes=8, drop_rate=0.1, **TIMM_KW.get(name, {}))
    tries, err = [], None
    for extra in ({"drop_path_rate": 0.1, "img_size": 64}, {"drop_path_rate": 0.1}, {}):
        try:
            model = timm.create_model(name, **kw, **extra)
        except TypeError as exc:
            err = exc
            continue
        sides = [64] if "img_size" in extra else [64, *timm_default_size(model)]
        tries.append((extra, sides))
        if "img_size" not in extra:
            break
    for extra, sides in tries:
        torch.manual_seed(SEED)
        model = timm.create_model(name, **kw, **extra)
        try:
            side = _probe_size(model, sides)
        except BuildError as exc:
            err = exc
            continue
        torch.manual_seed(SEED)
        model = timm.create_model(name, **kw, **extra)
        return model, (torch.randn(2, 3, side, side),), classify_loss
    raise BuildError(str(err))


def timm_default_size(model) -> list[int]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    size = cfg.get("input_size") or (3, 224, 224)
    return [size[-1]]


def _probe_size(model, sizes) -> int:
    """The first square input side the model runs on (eval mode, no grad: nothing changes)."""
    import torch
    model.eval()
    err = None
    for s in dict.fromkeys(sizes):
        try:
            with torch.no_grad():
                model(torch.randn(1, 3, s, s))
            return s
        except Exception as exc:
            err = exc
    raise BuildError(f"eager forward fails at sides {list(dict.fromkeys(sizes))}: "
                     f"{type(err).__name__}: {err}")


# -- torchvision --------------------------------------------------------------------------------

TORCHVISION = {   # name: (constructor kwargs beyond num_classes, input side)
    "alexnet": ({"dropout": 0.1}, 64), "convnext_tiny": ({"stochastic_depth_prob": 0.1}, 32),
    "densenet121": ({"drop_rate": 0.1}, 32), "efficientnet_b0": ({"dropout": 0.1}, 32),
    "efficientnet_v2_s": ({"dropout": 0.1}, 32),
    "googlenet": ({"aux_logits": False, "init_weights": True, "dropout": 0.1}, 32),
    "inception_v3": ({"aux_logits": False, "init_weights": True, "dropout": 0.1}, 75),
    "maxvit_t": ({}, 224),     # drop-path 0.2, the builder's own
    "mnasnet0_5": ({"dropout": 0.1}, 32), "mobilenet_v2": ({"dropout": 0.1}, 32),
    "mobilenet_v3_small": ({"dropout": 0.1}, 32), "regnet_x_400mf": ({}, 32),
    "regnet_y_400mf": ({}, 32), "resnet18": ({}, 32), "resnext50_32x4d": ({}, 32),
    "shufflenet_v2_x0_5": ({}, 32), "squeezenet1_1": ({"dropout": 0.1}, 64),
    "swin_t": ({"dropout": 0.1}, 64),       # drop-path 0.2, the builder's own
    "swin_v2_t": ({"dropout": 0.1}, 64),
    "vgg11_bn": ({"dropout": 0.1}, 32), "wide_resnet50_2": ({}, 32),
    "vit_b_16": ({"image_size": 32, "dropout": 0.1, "attention_dropout": 0.1}, 32),
}


def torchvision_build(name: str):
    import torch
    import torchvision
    kw, side = TORCHVISION[name]
    model = torchvision.models.get_model(name, weights=None, num_classes=8, **kw)
    return model, (torch.randn(2, 3, side, side),), classify_loss


# -- diffusers ----------------------------------------------------------------------------------

def _unet2d():
    import torch
    from diffusers import UNet2DModel
    m = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                    block_out_channels=(16, 32), norm_num_groups=8, dropout=0.1,
                    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                    up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8)
    return m, {"sample": torch.randn(2, 3, 16, 16), "timestep": torch.tensor([3, 7])}


def _unet2d_condition():
    import torch
    from diffusers import UNet2DConditionModel
    m = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                             block_out_channels=(16, 32), norm_num_groups=8,
                             cross_attention_dim=16, attention_head_dim=4, dropout=0.1,
                             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return m, {"sample": torch.randn(2, 4, 16, 16), "timestep": torch.tensor([3, 7]),
               "encoder_hidden_states": torch.randn(2, 5, 16)}


def _dit():
    import torch
    from diffusers import DiTTransformer2DModel
    m = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                              num_layers=2, sample_size=8, patch_size=2, dropout=0.1,
                              num_embeds_ada_norm=10)
    return m, {"hidden_states": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([3, 7]),
               "class_labels": torch.tensor([1, 2])}


def _pixart():
    import torch
    from diffusers import PixArtTransformer2DModel
    m = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                 cross_attention_dim=16, caption_channels=12, dropout=0.1)
    return m, {"hidden_states": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([3, 7]),
               "encoder_hidden_states": torch.randn(2, 5, 12),
               "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def _sd3():
    import torch
    from diffusers import SD3Transformer2DModel
    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                              attention_head_dim=8, num_attention_heads=2,
                              joint_attention_dim=12, caption_projection_dim=16,
                              pooled_projection_dim=10, out_channels=4, pos_embed_max_size=16)
    return m, {"hidden_states": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([3, 7]),
               "encoder_hidden_states": torch.randn(2, 5, 12),
               "pooled_projections": torch.randn(2, 10)}


def _flux():
    import torch
    from diffusers import FluxTransformer2DModel
    m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1,
                               num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                               joint_attention_dim=12, pooled_projection_dim=10,
                               axes_dims_rope=(2, 2, 4))
    return m, {"hidden_states": torch.randn(2, 16, 8), "timestep": torch.tensor([0.3, 0.7]),
               "encoder_hidden_states": torch.randn(2, 5, 12),
               "pooled_projections": torch.randn(2, 10), "txt_ids": torch.zeros(5, 3),
               "img_ids": torch.zeros(16, 3)}


def _vae():
    import torch
    from diffusers import AutoencoderKL
    m = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                      down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                      norm_num_groups=8, sample_size=16)
    return m, {"sample": torch.randn(2, 3, 16, 16)}


def _unet1d():
    import torch
    from diffusers import UNet1DModel
    m = UNet1DModel(in_channels=14, out_channels=14, block_out_channels=(8, 8, 16, 16),
                    down_block_types=("DownResnetBlock1D",) * 4,
                    up_block_types=("UpResnetBlock1D",) * 3, mid_block_type="MidResTemporalBlock1D",
                    out_block_type="OutConv1DBlock", time_embedding_type="positional",
                    use_timestep_embedding=True, flip_sin_to_cos=False, freq_shift=1.0,
                    act_fn="swish", extra_in_channels=0)
    return m, {"sample": torch.randn(2, 14, 16), "timestep": torch.tensor([3, 7])}


DIFFUSERS = {"UNet2DModel": _unet2d, "UNet2DConditionModel": _unet2d_condition,
             "DiTTransformer2DModel": _dit, "PixArtTransformer2DModel": _pixart,
             "SD3Transformer2DModel": _sd3, "FluxTransformer2DModel": _flux,
             "AutoencoderKL": _vae, "UNet1DModel": _unet1d}


def diffusers_build(name: str):
    model, inputs = DIFFUSERS[name]()
    return model, inputs, square_loss


# -- transformers -------------------------------------------------------------------------------

HF_TASKS = {   # AutoModel mapping; an architecture in several is taken at the first
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio-cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
}
VOCAB = 256
TINY = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "dim", "model_dim",
                     "word_embed_proj_dim", "embedding_size", "projection_dim"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
                     "decoder_layers", "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads"), 2),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), 1),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
                     "d_ff", "n_inner", "ffn_hidden_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("d_kv", "head_dim", "v_head_dim", "kv_channels"), 16),
    "rotary_dim": 8,
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
                    4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk"), 2),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "vocab_size": VOCAB, "max_position_embeddings": 128, "n_positions": 128,
    "image_size": 32, "use_cache": False, "num_labels": 2,
}


@functools.lru_cache(None)
def _hf_table() -> dict[str, tuple[str, str]]:
    """"task/model_type" -> (task, class name) over the HF_TASKS mappings."""
    from transformers.models.auto import modeling_auto
    table, seen = {}, set()
    for task, mapping in HF_TASKS.items():    # each architecture once, at its first task
        for model_type, cls in getattr(modeling_auto, mapping).items():
            if model_type in seen:
                continue
            seen.add(model_type)
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            table[f"{task}/{model_type}"] = (task, cls)
    return table


def hf_names() -> list[str]:
    return sorted(_hf_table())


def _tiny_overrides(cfg) -> dict:
    """Constructor kwargs that shrink `cfg` and turn its dropouts on."""
    from transformers import PretrainedConfig
    have = cfg.to_dict()
    out = {k: v for k, v in TINY.items() if k in have and not isinstance(have[k], (list, dict))}
    layers = have.get("num_hidden_layers")
    for k, v in have.items():
        low = k.lower()
        if isinstance(v, list) and layers and len(v) == layers and out.get(
                "num_hidden_layers"):     # per-layer lists (layer_types, ...): the first layers
            out[k] = v[:out["num_hidden_layers"]]
        elif (("dropout" in low or "drop_path" in low or "drop_prob" in low or "drop_rate" in low)
                and "layerdrop" not in low and isinstance(v, float)):
            out[k] = 0.1
        elif (k.endswith("_token_id") and isinstance(v, int) and "vocab_size" in out
              and v >= VOCAB):
            out[k] = VOCAB - 1
        sub = getattr(cfg, k, None)
        if isinstance(sub, PretrainedConfig):
            out[k] = {**sub.to_dict(), **_tiny_overrides(sub)}
    if "kv_lora_rank" in have and "num_key_value_heads" in out:
        # multi-head latent attention (DeepSeek-V2 and kin) expands its latent to every head:
        # its key/value heads are the attention heads (as in every released config); one KV
        # head makes SDPA's repeat_kv double the heads and fail wherever a mask is passed
        out["num_key_value_heads"] = out.get("num_attention_heads", have["num_attention_heads"])
    if "qk_rope_head_dim" in out and have.get("head_dim") == have.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]     # the rotary width, where the config ties them
    return out


def hf_build(name: str):
    import transformers
    from transformers import CONFIG_MAPPING
    task, cls_name = _hf_table()[name]
    model_type = name.split("/", 1)[1]
    cfg_cls = CONFIG_MAPPING[model_type]
    cfg = cfg_cls(**_tiny_overrides(cfg_cls()))
    if task == "seq2seq" and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = getattr(cfg, "pad_token_id", None) or 0
    model = getattr(transformers, cls_name)(cfg)
    return model, _hf_inputs(task, model, cfg), None


def _hf_inputs(task: str, model, cfg) -> dict:
    import torch
    g = torch.Generator().manual_seed(1)
    if task in ("causal-lm", "masked-lm", "seq2seq"):
        vocab = getattr(cfg, "vocab_size", None) or getattr(
            getattr(cfg, "text_config", None), "vocab_size", VOCAB)
        ids = torch.randint(3, min(vocab, VOCAB), (2, 8), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    labels = torch.tensor([0, 1])
    main = model.main_input_name
    if task == "image-cls":
        side = getattr(cfg, "image_size", 32)
        side = side if isinstance(side, int) else side[0]
        ch = getattr(cfg, "num_channels", 3)
        return {main: torch.randn(2, ch, side, side, generator=g), "labels": labels}
    if "AST" in type(cfg).__name__:
        x = {main: torch.randn(2, cfg.max_length, cfg.num_mel_bins, generator=g)}
    elif main == "input_features":
        bins = getattr(cfg, "num_mel_bins", None) or getattr(cfg, "feature_size", 80)
        frames = 2 * getattr(cfg, "max_source_positions", 50)
        shape = (2, bins, frames) if "whisper" in type(cfg).__name__.lower() else (2, 64, bins)
        x = {main: torch.randn(*shape, generator=g)}
    else:
        x = {main: torch.randn(2, 8000, generator=g)}
    if task == "ctc":
        return {**x, "labels": torch.randint(1, 8, (2, 4), generator=g)}
    return {**x, "labels": labels}

