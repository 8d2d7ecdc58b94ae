"""RoPE support detection and re-rotation of cached keys.

A RoPE key cached at position ``q`` is ``R(q) k``. Rotations compose, ``R(p) = R(p - q) R(q)``, so moving it to
position ``p`` only needs a rotation by the delta, computed with the model's *own* rotary embedding (so
``linear`` and ``llama3`` scaling are honoured exactly). This holds for rope types whose cos/sin are pure
rotations (attention_scaling == 1); YaRN-style magnitude scaling and dynamic NTK (whose frequencies depend
on the sequence length) do not compose, so those models fall back to prefix-only reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REROTATABLE = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeSupport:
    rerotatable: bool
    rope_type: str
    reason: str = ""


def rope_support(config, rotary_emb) -> RopeSupport:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type") or getattr(rotary_emb, "rope_type", None) or "default"
    if rotary_emb is None:
        return RopeSupport(False, "none", f"model type {config.model_type!r} has no rotary embedding "
                                           "(absolute or ALiBi positions)")
    if rope_type not in REROTATABLE:
        return RopeSupport(False, rope_type, f"rope type {rope_type!r} cannot be re-rotated by a delta "
                                             f"(supported: {', '.join(REROTATABLE)})")
    if float(getattr(rotary_emb, "attention_scaling", 1.0)) != 1.0:
        return RopeSupport(False, rope_type, "the rotary embedding scales cos/sin, so rotations do not compose")
    return RopeSupport(True, rope_type)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF convention: the two halves of the rotary dims are paired (not interleaved).
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def delta_cos_sin(rotary_emb, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of rotation by ``deltas`` (n,) positions, from the model's rotary module, in fp32: (n, R)."""
    dummy = torch.empty(1, dtype=torch.float32, device=deltas.device)
    cos, sin = rotary_emb(dummy, position_ids=deltas.to(torch.long).view(1, -1))  # (1, n, R)
    return cos[0].float(), sin[0].float()


def rerotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate keys ``k`` (..., n, D) by per-token angles ``cos``/``sin`` (n, R), R <= D (partial rotary).

    The math runs in fp32 and the result is cast back, so bf16 caches do not lose precision twice.
    """
    rot = cos.shape[-1]
    kf = k.float()
    k_rot, k_pass = kf[..., :rot], kf[..., rot:]  # (..., n, R), (..., n, D - R)
    out = k_rot * cos + rotate_half(k_rot) * sin
    if k_pass.shape[-1]:
        out = torch.cat((out, k_pass), dim=-1)
    return out.to(k.dtype)
