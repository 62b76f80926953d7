"""Random LoRA and IP-Adapter weights added to tiny models, as diffusers' and peft's loaders would add real ones."""

from __future__ import annotations

from typing import Any

import torch


# NOTE: one group of target modules per adapter (names missing from a model, or naming other than Linear and Conv
# layers there, are dropped), so adapters touch different layers, Linear and Conv alike, including per-row [B, D]
# inputs (time embeddings) and video patch embeddings.
_LORA_TARGET_GROUPS = (
    ("to_q", "to_k", "to_v", "to_out.0"),
    ("proj_mlp", "proj_out", "ff.net.2", "linear_1", "conv1", "conv2", "time_emb_proj", "to_qkv_mlp_proj",
     "feed_forward.w2", "t_embedder.mlp.2", "all_final_layer.2-1.adaLN_modulation.1", "siglip_embedder.1"),
    ("add_q_proj", "add_k_proj", "to_add_out", "norm1.linear", "x_embedder", "context_embedder", "proj_in",
     "conv_in", "ff.net.0.proj", "to_q", "all_x_embedder.2-1", "cap_embedder.1",
     "layers.0.adaLN_modulation.0", "noise_refiner.0.adaLN_modulation.0", "feed_forward.w1", "patch_embedding",
     "x_embedder.proj"),
)
_LORA_LAYER_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def add_random_lora_adapters(model: torch.nn.Module, names: tuple[str, ...] = ("a", "b", "c"), rank: int = 4,
                             seed: int = 0) -> tuple[str, ...]:
    """Add non-zero random peft LoRA adapters (`init_lora_weights=False`) to a diffusers model, as diffusers does.

    Adapter i targets its own group of modules, has lora_alpha = rank * (i + 1) / 2 and every third one uses
    rsLoRA, so the per-layer scales differ. Leaves the last one active (as `add_adapter` does).

    >>> add_random_lora_adapters(pipe.transformer)
    ('a', 'b', 'c')
    """
    from peft import LoraConfig

    modules = dict(model.named_modules())

    def targetable(target: str) -> bool:  # NOTE: as peft matches names: the module itself or a suffix
        found = [module for m, module in modules.items() if m == target or m.endswith("." + target)]
        return bool(found) and all(isinstance(module, _LORA_LAYER_TYPES) for module in found)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, name in enumerate(names):
            group = _LORA_TARGET_GROUPS[i % len(_LORA_TARGET_GROUPS)]
            targets = [t for t in group if targetable(t)]
            config = LoraConfig(r=rank, lora_alpha=rank * (i + 1) / 2, target_modules=targets,
                                init_lora_weights=False, use_rslora=i % 3 == 2)
            model.add_adapter(config, adapter_name=name)
    return names


def add_random_ip_adapter(pipe: Any, image_embed_dim: int = 16, tokens: int = 4, seed: int = 0,
                          faceid: bool = False) -> None:
    """Load a random IP-Adapter (as `load_ip_adapter` would) and a tiny CLIP image encoder into SD, SDXL or Flux.

    The adapter's key/value projections match each cross-attention layer (Flux: each double-stream block); its
    `ImageProjection` maps the image encoder's `image_embed_dim`-wide embedding to `tokens` tokens. Scale 1.0, as
    after `load_ip_adapter`. `faceid=True` (UNets): an IP-Adapter FaceID projection
    (`IPAdapterFaceIDImageProjection`, face embeddings of `image_embed_dim`) and no image encoder: requests pass
    `ip_adapter_image_embeds` of shape [2, 1, 1, image_embed_dim] under CFG.

    >>> add_random_ip_adapter(pipe); pipe(prompt, ip_adapter_image=image)
    """
    from diffusers.models.embeddings import ImageProjection
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    flux = hasattr(pipe, "transformer")  # else a UNet pipeline
    model = pipe.transformer if flux else pipe.unet
    cross_dim = model.config.joint_attention_dim if flux else model.config.cross_attention_dim
    modules = dict(model.named_modules())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = {}
        if flux:  # one IP projection pair (with biases) per double-stream block, numbered from 0
            for key_id in range(len(model.transformer_blocks)):
                for projection in ("to_k_ip", "to_v_ip"):
                    attention[f"{key_id}.{projection}.weight"] = torch.randn(model.inner_dim, cross_dim) * 0.3
                    attention[f"{key_id}.{projection}.bias"] = torch.randn(model.inner_dim) * 0.1
        else:  # one pair per cross-attention layer, numbered 1, 3, 5, ...
            key_id = 1
            for name in model.attn_processors:
                if name.endswith("attn1.processor"):
                    continue
                to_k = modules[name[: -len(".processor")]].to_k
                for projection in ("to_k_ip", "to_v_ip"):
                    attention[f"{key_id}.{projection}.weight"] = torch.randn(to_k.out_features, to_k.in_features) * 0.3
                key_id += 2
        if faceid:
            from diffusers.models.embeddings import IPAdapterFaceIDImageProjection

            sd = IPAdapterFaceIDImageProjection(cross_attention_dim=cross_dim, image_embed_dim=image_embed_dim,
                                                mult=2, num_tokens=tokens).state_dict()
            projection = {"proj.0.weight": sd["ff.net.0.proj.weight"], "proj.0.bias": sd["ff.net.0.proj.bias"],
                          "proj.2.weight": sd["ff.net.2.weight"], "proj.2.bias": sd["ff.net.2.bias"],
                          "norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"]}
        else:
            sd = ImageProjection(cross_attention_dim=cross_dim, image_embed_dim=image_embed_dim,
                                 num_image_text_embeds=tokens).state_dict()
            projection = {"proj.weight": sd["image_embeds.weight"], "proj.bias": sd["image_embeds.bias"],
                          "norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"]}
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, projection_dim=image_embed_dim, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, image_size=32, patch_size=8,
        )).eval()
    model._load_ip_adapter_weights([{"image_proj": projection, "ip_adapter": attention}])
    if faceid:  # NOTE: FaceID takes face embeddings (e.g. insightface's), never images
        return
    processor = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    pipe.register_modules(image_encoder=encoder, feature_extractor=processor)


def add_random_sd3_ip_adapter(pipe: Any, tokens: int = 4, seed: int = 0) -> None:
    """Load a random SD3 IP-Adapter (as `load_ip_adapter` would) and a tiny SigLIP image encoder into SD3.

    The resampler (`IPAdapterTimeImageProjection`, 4 blocks of one 64-wide head, as the loader infers them) maps
    the encoder's penultimate hidden states to `tokens` image tokens; each block gets an
    `SD3IPAdapterJointAttnProcessor2_0`. Scale 0.5, as after `load_ip_adapter`.

    >>> add_random_sd3_ip_adapter(pipe); pipe(prompt, ip_adapter_image=image)
    """
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    model = pipe.transformer
    inner = model.config.attention_head_dim * model.config.num_attention_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8,
        )).eval()
        projection = IPAdapterTimeImageProjection(embed_dim=32, output_dim=inner, hidden_dim=64, heads=1,
                                                  num_queries=tokens, timestep_in_dim=32)
        attention = {}
        for index in range(len(model.attn_processors)):
            processor = SD3IPAdapterJointAttnProcessor2_0(hidden_size=inner, ip_hidden_states_dim=inner,
                                                          head_dim=model.config.attention_head_dim,
                                                          timesteps_emb_dim=64)
            for name, value in processor.state_dict().items():  # NOTE: non-trivial norms, a visible image branch
                attention[f"{index}.{name}"] = value + 0.3 * torch.randn_like(value)
    model._load_ip_adapter_weights({"image_proj": projection.state_dict(), "ip_adapter": attention})
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    pipe.register_modules(image_encoder=encoder, feature_extractor=processor)
