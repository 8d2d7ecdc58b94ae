"""Typed entry points of the native ops, with the torch reference as fallback.

Dispatch rule: the extension runs when it is loaded and every tensor sits on a device it was built for
(CPU always; CUDA only for a ``KVBOOST_CUDA=1`` build) with a supported dtype; anything else runs
:mod:`kvboost_core.kernels.reference`, which defines the results.

When the install has no extension (an isolated ``pip install`` builds without torch), the first kernel call
builds it once with :mod:`.jit` (cached, shared by later processes); if that cannot work, one warning says
so and the torch reference runs.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

import torch

from kvboost_core import kernels as _k
from kvboost_core.kernels import reference
from kvboost_core.quant import QuantPayload
from kvboost_core.store.base import DensePayload, KVPayload

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_jit_lock = threading.Lock()
_jit_tried = False


def ensure_ext() -> bool:
    """Whether the native kernels are usable, building them once (JIT) when the install skipped them."""
    global _jit_tried
    # _k._ext (not has_ext(), which tests patch to force the fallback): an extension that is loaded must
    # never be JIT-built again; its ops would be registered twice, which aborts the process.
    if _k.has_ext() or _jit_tried or _k._ext is not None:
        return _k.has_ext()
    with _jit_lock:
        if _jit_tried:
            return _k.has_ext()
        from kvboost_core.kernels import jit

        why = jit.why_not()
        if why is None:
            try:
                ext = jit.build()
            except Exception as e:  # noqa: BLE001 - any build failure leaves the torch fallback
                why = f"JIT build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            else:
                _k._ext, _k._load_error = ext, None  # the package-level state every dispatch reads
                _register_fakes()
        if why is not None and why != "disabled by KVBOOST_DISABLE_EXT=1":
            msg = (f"kvboost: native kernels unavailable ({_k.load_error()}; {why}); using the pure-torch "
                   "reference kernels (same results, slower)")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        _jit_tried = True  # set last: concurrent callers wait on the lock until the outcome is known
    return _k.has_ext()


def jit_settled() -> bool:
    """Whether the extension's availability is final: loaded, JIT tried, or a JIT build impossible here."""
    if _k._ext is not None or _jit_tried:
        return True
    from kvboost_core.kernels import jit

    return jit.why_not() is not None


def _ext_device(device: torch.device) -> bool:
    if not ensure_ext():
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _k.has_cuda_ext()


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / FakeTensor tracing can see through the ops."""
    lib = "kvboost::"

    @torch.library.register_fake(lib + "dequant_rerotate_into")
    def _(dst_k, dst_v, k, v, k_scale, k_min, v_scale, v_min, bits, group_size, head_dim, src_start, length,
          dst_start, cos, sin):
        return None  # writes in place into dst_k / dst_v

    @torch.library.register_fake(lib + "quantize_kv")
    def _(k, v, bits, group_size):
        L, H, n, D = k.shape
        dc = D if bits == 8 else (D + 1) // 2
        g = group_size
        return (k.new_empty((L, H, n, dc), dtype=torch.uint8), k.new_empty((L, H, -(-n // g), D), dtype=torch.float16),
                k.new_empty((L, H, -(-n // g), D), dtype=torch.float16),
                v.new_empty((L, H, n, dc), dtype=torch.uint8), v.new_empty((L, H, n, -(-D // g)), dtype=torch.float16),
                v.new_empty((L, H, n, -(-D // g)), dtype=torch.float16))

    @torch.library.register_fake(lib + "decode_attention")
    def _(q, k, v, length, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake(lib + "paged_decode_attention")
    def _(q, k_pool, v_pool, pages, length, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake(lib + "blend_select")
    def _(fresh, cached, k, forced_mask):
        ctx = torch.library.get_ctx()
        return fresh.new_empty((ctx.new_dynamic_size(),), dtype=torch.int64)


if _k.has_ext():
    _register_fakes()


# -- dequantize + re-rotate + place --------------------------------------------------------------------------
def dequant_rerotate_into(dst_k: Sequence[torch.Tensor] | torch.Tensor, dst_v: Sequence[torch.Tensor] | torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, src_start: int, length: int, dst_start: int,
                          cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
                          k_scale: torch.Tensor | None = None, k_min: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, v_min: torch.Tensor | None = None,
                          bits: int = 16, group_size: int = 32, head_dim: int | None = None) -> None:
    """Tokens [src_start, src_start + length) of a payload -> slots [dst_start, dst_start + length) of every
    layer's buffers, keys rotated by ``cos``/``sin`` (length, R) fp32 (None: no rotation).

    ``dst_k``/``dst_v``: a list of per-layer (1, H, T, D) tensors or one stacked (L, 1, H, T, D) tensor.
    ``bits=16``: ``k``/``v`` are dense (L, H, n, D); ``bits=8/4``: uint8 codes plus the scale/min tensors
    (QuantPayload layout), ``head_dim`` required.
    """
    if isinstance(dst_k, torch.Tensor):
        dst_k = list(dst_k.unbind(0))  # views: writes land in the stacked tensor
    if isinstance(dst_v, torch.Tensor):
        dst_v = list(dst_v.unbind(0))
    if head_dim is None:
        if bits != 16:
            raise ValueError("head_dim is required for a quantized payload")
        head_dim = int(k.shape[-1])
    args = (list(dst_k), list(dst_v), k, v, k_scale, k_min, v_scale, v_min, int(bits), int(group_size),
            int(head_dim), int(src_start), int(length), int(dst_start), cos, sin)
    dev = k.device
    ok = (_ext_device(dev) and len(dst_k) > 0 and dst_k[0].dtype in _FLOATS
          and (bits != 16 or (k.dtype in _FLOATS and v.dtype in _FLOATS)))
    if ok:
        torch.ops.kvboost.dequant_rerotate_into(*args)
    else:
        reference.dequant_rerotate_into(*args)


def place_block(payload: KVPayload, src_start: int, length: int, dst_keys: list[torch.Tensor],
                dst_values: list[torch.Tensor], dst_start: int, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> None:
    """One placement of ``assembly.place``: payload tokens [src_start, src_start + length) -> buffer slots
    [dst_start, dst_start + length) of every layer (buffers (1, H, T, D)), keys re-rotated by ``cos``/``sin``
    (length, R) from ``rope.delta_cos_sin`` (pass None for a zero delta). Same values as
    ``to_dense(dst dtype) -> slice -> rerotate -> copy``; no dense copy of the payload is made.
    """
    if length == 0:
        return
    device = dst_keys[0].device
    if isinstance(payload, QuantPayload):
        # Move the small codes, not a dense result (as QuantPayload.to_dense does).
        t = {name: x.to(device) for name, x in payload.tensors().items()}
        dequant_rerotate_into(dst_keys, dst_values, t["k_codes"], t["v_codes"], src_start, length, dst_start,
                              cos, sin, k_scale=t["k_scale"], k_min=t["k_min"], v_scale=t["v_scale"],
                              v_min=t["v_min"], bits=payload.bits, group_size=payload.group_size,
                              head_dim=payload.head_dim)
    elif isinstance(payload, DensePayload):
        end = src_start + length
        k, v = payload.keys, payload.values
        if k.device != device:  # only the used tokens cross the bus
            k, v = k[:, :, src_start:end].to(device), v[:, :, src_start:end].to(device)
            src_start = 0
        dequant_rerotate_into(dst_keys, dst_values, k, v, src_start, length, dst_start, cos, sin)
    else:
        # Unknown payload layout: the generic KVPayload protocol.
        k, v = payload.to_dense(dst_keys[0].dtype, device)
        dequant_rerotate_into(dst_keys, dst_values, k, v, src_start, length, dst_start, cos, sin)
    if cos is not None and cos.device != device:
        raise ValueError(f"cos/sin are on {cos.device}, buffers on {device}")


# -- quantization --------------------------------------------------------------------------------------------
def quantize_kv(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int = 32) -> tuple[torch.Tensor, ...]:
    """(k_codes, k_scale, k_min, v_codes, v_scale, v_min), bit-identical to ``quant.quantize_payload``."""
    if _ext_device(k.device) and k.dtype in _FLOATS and v.dtype in _FLOATS and v.device == k.device:
        return tuple(torch.ops.kvboost.quantize_kv(k, v, int(bits), int(group_size)))
    return reference.quantize_kv(k, v, bits, group_size)


def quantize_payload(dense: DensePayload, bits: int, group_size: int = 32, keys_pre_rope: bool = False
                     ) -> QuantPayload:
    """Drop-in for ``kvboost_core.quant.quantize_payload`` running the native kernel."""
    kc, ks, km, vc, vs, vm = quantize_kv(dense.keys, dense.values, bits, group_size)
    return QuantPayload(bits=bits, group_size=group_size, head_dim=int(dense.keys.shape[3]), k_codes=kc,
                        k_scale=ks, k_min=km, v_codes=vc, v_scale=vs, v_min=vm, keys_pre_rope=keys_pre_rope)


# -- CacheBlend selection ------------------------------------------------------------------------------------
def blend_select(fresh: torch.Tensor, cached: torch.Tensor, ratio_or_k: float | int,
                 forced_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (int64, ascending) into the n tokens of fresh/cached (H, n, D) to keep recomputing.

    ``ratio_or_k``: a float is a fraction of n (rounded up), an int a count. Forced tokens come first and are
    never dropped; the rest are ranked by squared deviation, ties to the lower index (see reference).
    """
    k = reference.select_count(ratio_or_k, int(fresh.shape[1]) if fresh.dim() == 3 else 0)
    if (_ext_device(fresh.device) and fresh.dtype in _FLOATS and cached.dtype in _FLOATS
            and cached.device == fresh.device):
        return torch.ops.kvboost.blend_select(fresh, cached, k, forced_mask)
    return reference.blend_select(fresh, cached, k, forced_mask)


# -- one decode row's attention --------------------------------------------------------------------------------
def decode_kernel(device: torch.device) -> bool:
    """Whether :func:`decode_attention` runs a native kernel for tensors on ``device``: the CPU extension, or on
    CUDA an extension built with its CUDA kernels (``KVBOOST_CUDA=1``)."""
    return device.type in ("cpu", "cuda") and _ext_device(device)


_DECODE_DTYPES = {"cpu": (torch.float32,), "cuda": (torch.float32, torch.float16, torch.bfloat16)}


def _decode_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q/k/v of one dtype that the device's decode kernel takes, on one device, K/V rows contiguous."""
    return (q.dtype == k.dtype == v.dtype and q.dtype in _DECODE_DTYPES.get(q.device.type, ())
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.device == q.device == v.device
            and decode_kernel(q.device))


def decode_attend(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The attention a lean decode step (``kvboost_core.model.lean.lean_decoder(attend=)``) runs on ``device``:
    :func:`decode_attention` where the native kernel runs, else None (the step's own SDPA, bitwise the planned
    forward's). One choice for every decode loop: ``generate``/``stream`` and the batched server."""
    return decode_attention if decode_kernel(device) else None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """q (H, D), k/v (H_kv, T, D) -> (H, D): one decode row per query head over keys [0, length), query head h
    reading KV head h // (H / H_kv). fp32 on the CPU (and fp32/fp16/bf16 on CUDA, see :func:`decode_kernel`) runs
    the native kernel (rows contiguous; a row's result independent of the thread count and of the other rows);
    anything else the SDPA reference."""
    if _decode_native(q, k, v):
        return torch.ops.kvboost.decode_attention(q, k, v, int(length), float(scale))
    return reference.decode_attention(q, k, v, length, scale)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor,
                           length: int, scale: float) -> torch.Tensor:
    """:func:`decode_attention` over a page pool (``kvboost_core.serving.pages``): q (H, D), k_pool/v_pool
    (N, H_kv, P, D), ``pages`` (n,) int64 page ids in position order -> (H, D), key t read from page
    ``pages[t // P]`` at slot ``t % P``; no dense copy of the sequence. Where :func:`decode_attention` runs a
    native kernel this runs its paged form (on the CPU bitwise the dense call on the gathered rows); anything else
    the reference (gather, then SDPA)."""
    if _decode_native(q, k_pool, v_pool) and pages.dtype == torch.long and pages.device == q.device:
        return torch.ops.kvboost.paged_decode_attention(q, k_pool, v_pool, pages, int(length), float(scale))
    return reference.paged_decode_attention(q, k_pool, v_pool, pages, length, scale)
