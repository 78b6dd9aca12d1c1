"""Real architectures from torchvision, timm and transformers, built from configs in
code with seeded random weights (nothing is downloaded), and the small batches they
run on. A test that uses one is skipped only where its library is not installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def images(batch: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of images and their class labels (10 classes)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=generator)
    return x, torch.randint(0, 10, (batch,), generator=generator)


def tokens(labels: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2x8 batch of token ids (vocabulary 100) and its labels: one of ``labels``
    classes per sequence, or (``None``) the sequence itself, which a causal LM shifts
    into next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 8), generator=generator)
    if labels is None:
        return ids, ids.clone()
    return ids, torch.randint(0, labels, (2,), generator=generator)


# Each builder keeps the layers that draw random numbers in train mode (dropout,
# stochastic depth) at their default probabilities.


def resnet18() -> nn.Module:
    pytest.importorskip("torchvision")
    from torchvision.models import resnet18

    return resnet18(num_classes=10)


def mobilenet_v3_small() -> nn.Module:
    pytest.importorskip("torchvision")
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=10)


def torchvision_vit() -> nn.Module:
    pytest.importorskip("torchvision")
    from torchvision.models import VisionTransformer

    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    # torchvision zero-initialises the classification head, which would make every
    # output and every gradient but the head's 0: nothing to compare.
    head = model.heads.head
    assert isinstance(head, nn.Linear)
    nn.init.normal_(head.weight, std=0.1)
    return model


def swin_t() -> nn.Module:
    pytest.importorskip("torchvision")
    from torchvision.models import swin_t

    # At 64x64 the first stage's 16x16 map is larger than the 7x7 window, so the
    # shifted-window attention and its mask are exercised.
    return swin_t(num_classes=10)


def convnext_atto() -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


def timm_vit_tiny() -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10
    )


# The transformers models keep their default attention (sdpa), the one users run: it
# captures and matches eager as well as attn_implementation="eager" does, dropout
# included, so the plain implementation would only test a path nobody uses.


def gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    dropout = 0.1
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=100,
        n_positions=32,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        resid_pdrop=dropout,
        # The defaults name token 50256 of GPT-2's real vocabulary.
        bos_token_id=0,
        eos_token_id=0,
        # With a cache the output holds a DynamicCache, which is not a pytree an
        # artifact can return; the computation is the same without it.
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def bert(layers: int = 2) -> nn.Module:
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    dropout = 0.1
    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    config.num_labels = 3
    return BertForSequenceClassification(config)
