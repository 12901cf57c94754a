"""How a pseudo-gradient travels: fp32, bf16, or int8 / int4 with one fp32 scale per block.

[Note: the quantised forms]
A flat fp32 vector is cut into blocks of :data:`BLOCK` elements (the last one padded with
zeros). Each block keeps one fp32 scale, ``max|x| / qmax`` (``qmax`` 127 for int8, 7 for
int4), and its elements as ``round(x / scale)`` clamped to ``[-qmax, qmax]``; so an element
comes back within ``scale / 2`` of what was sent (half a step of its block). int4 values are
stored two to a byte (``q + 8`` in each nibble). The whole message -- values, then scales --
is one ``uint8`` tensor, so one collective moves it.

A sum of quantised numbers has no quantised form with the same scale, so these forms travel
by all-gather: every rank decodes every rank's message and sums them in rank order, in fp32,
which gives the same bits on every rank.
"""

from __future__ import annotations

import torch

__all__ = ["CODECS", "BLOCK", "check_codec", "encode", "decode", "message_bytes"]

#: The pseudo-gradient forms a user may choose.
CODECS = ("fp32", "bf16", "int8", "int4")

#: Elements per quantisation block (one fp32 scale each): 3% of an int8 message, 6% of int4.
BLOCK = 128

_QMAX = {"int8": 127, "int4": 7}


def check_codec(compression: str) -> str:
    """``compression`` itself when it is one of :data:`CODECS`; else ValueError naming them."""
    if compression not in CODECS:
        raise ValueError(f"DiLoCo(compression={compression!r}) is not a pseudo-gradient form; use one of "
                         f"{', '.join(repr(c) for c in CODECS)} (fp32: exact; bf16: half the bytes; int8 / int4: "
                         f"a quarter / an eighth, with one fp32 scale per {BLOCK} elements)")
    return compression


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def message_bytes(numel: int, codec: str) -> int:
    """Bytes of one rank's message for ``numel`` elements in ``codec``."""
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    blocks = _blocks(numel)
    values = blocks * BLOCK if codec == "int8" else blocks * BLOCK // 2
    return values + 4 * blocks


def encode(flat: torch.Tensor, codec: str) -> torch.Tensor:
    """``flat`` (1-D fp32) as the message of ``codec``: fp32 or bf16 values, or uint8 bytes."""
    if codec == "fp32":
        return flat
    if codec == "bf16":
        return flat.to(torch.bfloat16)
    qmax = _QMAX[codec]
    blocks = _blocks(flat.numel())
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    rows = padded.view(blocks, BLOCK)
    scale = rows.abs().amax(dim=1) / qmax
    # An all-zero block keeps scale 0 (it decodes to zeros); divide by 1 there instead of 0.
    q = torch.round(rows / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)).clamp_(-qmax, qmax)
    if codec == "int8":
        values = q.to(torch.int8).view(torch.uint8).reshape(-1)
    else:
        nibbles = (q + 8).to(torch.uint8).reshape(-1)
        values = nibbles[0::2] | (nibbles[1::2] << 4)
    return torch.cat([values, scale.view(torch.uint8)])


def decode(message: torch.Tensor, numel: int, codec: str) -> torch.Tensor:
    """The fp32 vector of ``numel`` elements that ``message`` (from :func:`encode`) carries."""
    if codec in ("fp32", "bf16"):
        return message.to(torch.float32)
    blocks = _blocks(numel)
    nvalues = blocks * BLOCK if codec == "int8" else blocks * BLOCK // 2
    values, scale = message[:nvalues], message[nvalues:].view(torch.float32)
    if codec == "int8":
        q = values.view(torch.int8).to(torch.float32)
    else:
        q = torch.stack([values & 0x0F, values >> 4], dim=1).reshape(-1).to(torch.float32) - 8
    return (q.view(blocks, BLOCK) * scale.unsqueeze(1)).reshape(-1)[:numel]
