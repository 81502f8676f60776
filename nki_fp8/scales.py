"""absmax scales at tensor, channel, token and group granularity.

Two conventions exist and are never mixed silently:

- **kernel scale** `s` (a multiplier, what vLLM Neuron keeps on the module):
  `x_fp8 = cast(clamp(x * s, -max, max))`, `x ~= x_fp8 / s`, and `s = max / absmax(x)`.
- **checkpoint scale** `c` (a divisor, what llm-compressor / vLLM store as `k_scale`):
  `x_fp8 = x / c`, `c = absmax(x) / max` — so `s = 1 / c`.

Every function here returns kernel scales unless its name says `checkpoint`.

Non-finite inputs: NaN and +-inf are ignored by `absmax` (sliding-window captures are NaN-padded;
an inf would otherwise make the scale 0 and zero the whole tensor). A slice whose absmax is 0 or
has no finite value gets scale 1.0.

Dims: the defaults read K/V laid out as `[..., seq, head_dim]` (token axis -2, channel axis -1).
Results keep the reduced axes with length 1 so that `x * s` broadcasts; group scales have shape
`[..., seq, n_groups, 1]` and go with `group_size` in `quant.quantize`.
"""
from __future__ import annotations

import numpy as np

from .formats import fp8_clamp_max

GRANULARITIES = ("tensor", "channel", "token", "group")


def _finite_abs(x) -> np.ndarray:
    a = np.abs(np.asarray(x, dtype=np.float32))
    a[~np.isfinite(a)] = 0.0
    return a


def grouped(x: np.ndarray, group_size: int, channel_axis: int = -1) -> np.ndarray:
    """`x: [..., channel]` viewed as `[..., n_groups, group_size]` (channel axis must be last)."""
    x = np.asarray(x)
    if channel_axis not in (-1, x.ndim - 1):
        raise ValueError(f"group scales need the channel axis last; got channel_axis={channel_axis}")
    c = x.shape[-1]
    if group_size <= 0 or c % group_size:
        raise ValueError(f"group_size={group_size} does not divide the channel axis of shape {x.shape}")
    return x.reshape(*x.shape[:-1], c // group_size, group_size)


def absmax(
    x,
    granularity: str = "tensor",
    *,
    token_axis: int = -2,
    channel_axis: int = -1,
    group_size: int | None = None,
) -> np.ndarray:
    """max |x| over finite values, reduced as `granularity` says, keepdims.

    tensor: one value (all axes reduced); channel: reduced over the token axis only, so
    `[kv_head, seq, head_dim]` gives `[kv_head, 1, head_dim]`; token: reduced over the channel
    axis, `[kv_head, seq, 1]`; group: one per token and channel group, `[kv_head, seq, n_groups, 1]`.
    """
    a = _finite_abs(x)
    if granularity == "tensor":
        return a.max(keepdims=True) if a.size else np.zeros((1,) * a.ndim, np.float32)
    if granularity == "channel":
        return a.max(axis=token_axis, keepdims=True)
    if granularity == "token":
        return a.max(axis=channel_axis, keepdims=True)
    if granularity == "group":
        if group_size is None:
            raise ValueError("granularity='group' needs group_size")
        return grouped(a, group_size, channel_axis).max(axis=-1, keepdims=True)
    raise ValueError(f"unknown granularity {granularity!r}; valid: {list(GRANULARITIES)}")


def kernel_scale_from_absmax(amax, platform: str | None = None) -> np.ndarray:
    """Kernel scale `max / absmax` in float32; 1.0 where absmax is 0 (nothing to scale)."""
    amax = np.asarray(amax, dtype=np.float32)
    m = np.float32(fp8_clamp_max(platform))
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, m / np.where(amax > 0, amax, 1), np.float32(1.0))
    return s.astype(np.float32)


def checkpoint_scale_from_absmax(amax, platform: str | None = None) -> np.ndarray:
    """Checkpoint (llm-compressor) scale `absmax / max` in float32; 1.0 where absmax is 0."""
    amax = np.asarray(amax, dtype=np.float32)
    m = np.float32(fp8_clamp_max(platform))
    return np.where(amax > 0, amax / m, np.float32(1.0)).astype(np.float32)


def absmax_scale(
    x,
    granularity: str = "tensor",
    *,
    platform: str | None = None,
    token_axis: int = -2,
    channel_axis: int = -1,
    group_size: int | None = None,
) -> np.ndarray:
    """Kernel scale `max / absmax(x)` at `granularity` (see `absmax`), float32, keepdims."""
    amax = absmax(x, granularity, token_axis=token_axis, channel_axis=channel_axis, group_size=group_size)
    return kernel_scale_from_absmax(amax, platform)
