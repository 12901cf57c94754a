"""Small reference models shared by the examples, the benchmarks and the tests.

They are written here (no torchvision) so that every program in the project trains on a
fresh machine with nothing but torch installed.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ResNet18", "BasicBlock", "ToyModel", "MLP", "TransformerBlock", "TinyTransformer", "GPT", "CausalBlock",
           "LMOutput"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet's basic block)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            # Project the input when the block changes resolution or width.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for small images (CIFAR's 32x32, or the 8x8 digits).

    The stem is a single 3x3 convolution without max-pooling, as is usual for CIFAR: the
    ImageNet stem (7x7 stride 2, then pooling) would shrink an 8x8 image to nothing.

    Args:
        num_classes: outputs of the classifier. Default 10.
        in_channels: input channels (3 for CIFAR, 1 for digits). Default 3.
        width: channels of the first stage; later stages double it. Default 64 (the
            standard 11.2 M-parameter network); smaller widths train faster on a CPU.

    Example:
        >>> ResNet18(num_classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64) -> None:
        super().__init__()
        if width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(
                f"ResNet18 needs positive sizes, got num_classes={num_classes}, in_channels={in_channels}, width={width}"
            )
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        planes, layers, in_planes = [width, 2 * width, 4 * width, 8 * width], [], width
        for i, p in enumerate(planes):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(in_planes, p, stride), BasicBlock(p, p, 1)))
            in_planes = p
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(8 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


class ToyModel(nn.Module):
    """The two-layer ToyModel of PyTorch's DDP tutorial: Linear(10, 10) -> ReLU -> Linear(10, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class MLP(nn.Sequential):
    """Linear layers of the given sizes with ReLU between them.

    Example:
        >>> MLP([1024] * 9)   # the 8x1024 MLP of the DDP benchmark
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output size, got {list(sizes)}")
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A small causal-free transformer language model: embeddings, blocks, a head.

    Args:
        vocab: vocabulary size. Default 256.
        dim: model width. Default 64.
        depth: number of :class:`TransformerBlock`. Default 2.
        heads: attention heads. Default 4.
        max_len: longest sequence. Default 128.

    Example:
        >>> TinyTransformer()(torch.randint(0, 256, (2, 16))).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, vocab: int = 256, dim: int = 64, depth: int = 2, heads: int = 4, max_len: int = 128) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LMOutput(dict):
    """What :class:`GPT` returns: ``.loss`` (None without labels) and ``.logits``, readable as a mapping
    too (``out["loss"]``), as Hugging Face models' outputs are."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class CausalBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A small GPT: token and position embeddings, causal blocks, a head tied to the embedding.

    It computes its own loss, as Hugging Face's causal language models do: ``model(input_ids,
    labels=labels)`` returns an :class:`LMOutput` with ``.loss`` (next-token cross entropy,
    mean over the tokens whose label is not -100) and ``.logits``; the Trainer trains it with
    ``loss_fn=None``.

    Args:
        vocab: vocabulary size. Default 256 (bytes).
        dim: model width. Default 128.
        depth: number of blocks. Default 4.
        heads: attention heads (``dim`` must divide by it). Default 4.
        max_len: longest sequence. Default 256.
        dropout: dropout in the blocks. Default 0.

    Raises:
        ValueError: ``dim`` not divisible by ``heads``; a sequence longer than ``max_len``.

    Example:
        >>> out = GPT(dim=32, depth=1)(torch.randint(0, 256, (2, 16)), labels=torch.randint(0, 256, (2, 16)))
        >>> out.logits.shape, out.loss.shape
        (torch.Size([2, 16, 256]), torch.Size([]))
    """

    def __init__(self, vocab: int = 256, dim: int = 128, depth: int = 4, heads: int = 4, max_len: int = 256,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"GPT(dim={dim}) must be divisible by heads={heads}")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        t = input_ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"a sequence of {t} tokens is longer than GPT(max_len={self.max_len})")
        x = self.drop(self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100)
        return LMOutput(loss=loss, logits=logits)
