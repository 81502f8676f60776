"""absmax scales at every granularity against explicit loops."""
import numpy as np
import pytest

from nki_fp8.quant import quantize
from nki_fp8.scales import absmax, absmax_scale, checkpoint_scale_from_absmax, kernel_scale_from_absmax


@pytest.fixture
def kv():
    """kv: [kv_head=3, seq=5, head_dim=8] with a NaN (sliding-window pad) and an inf."""
    x = np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32) * 3
    x[0, 0, 0] = np.nan
    x[2, 4, 7] = -np.inf
    return x


def _loop_absmax(vals):
    m = 0.0
    for v in vals:
        if np.isfinite(v):
            m = max(m, abs(float(v)))
    return m


def test_absmax_per_tensor_channel_token_group_match_loops(kv):
    h, s, d = kv.shape
    assert absmax(kv, "tensor").shape == (1, 1, 1)
    assert absmax(kv, "tensor").item() == _loop_absmax(kv.ravel())
    ch = absmax(kv, "channel")
    tok = absmax(kv, "token")
    grp = absmax(kv, "group", group_size=4)
    assert ch.shape == (h, 1, d) and tok.shape == (h, s, 1) and grp.shape == (h, s, 2, 1)
    for i in range(h):
        for c in range(d):
            assert ch[i, 0, c] == _loop_absmax(kv[i, :, c])
        for t in range(s):
            assert tok[i, t, 0] == _loop_absmax(kv[i, t, :])
            for g in range(2):
                assert grp[i, t, g, 0] == _loop_absmax(kv[i, t, 4 * g : 4 * g + 4])


def test_group_size_must_divide_head_dim(kv):
    with pytest.raises(ValueError, match="group_size=3"):
        absmax(kv, "group", group_size=3)
    with pytest.raises(ValueError, match="unknown granularity"):
        absmax(kv, "row")


@pytest.mark.parametrize("platform,m", [("trn2", 240.0), ("trn3", 448.0)])
@pytest.mark.parametrize("gran", ["tensor", "channel", "token", "group"])
def test_absmax_scale_maps_each_slice_max_exactly_onto_the_fp8_max(kv, platform, m, gran):
    kw = {"group_size": 4} if gran == "group" else {}
    s = absmax_scale(kv, gran, platform=platform, **kw)
    q = quantize(kv, s, platform=platform, **kw).astype(np.float32)
    finite = np.isfinite(kv)
    assert np.nanmax(np.abs(q[finite])) == m
    assert np.abs(q[finite]).max() <= m  # nothing but the inf saturates
    assert q[2, 4, 7] == -m  # the -inf saturates to -max


def test_zero_or_nonfinite_slices_get_scale_one():
    x = np.array([[0.0, 0.0], [np.nan, np.inf]], np.float32)
    assert absmax_scale(x, "token").ravel().tolist() == [1.0, 1.0]
    assert checkpoint_scale_from_absmax(np.float32(0)).item() == 1.0


def test_kernel_and_checkpoint_scales_are_reciprocal_conventions():
    amax = np.array([2.4, 480.0], np.float32)
    k = kernel_scale_from_absmax(amax, "trn2")
    c = checkpoint_scale_from_absmax(amax, "trn2")
    np.testing.assert_allclose(k, [100.0, 0.5], rtol=1e-7)
    np.testing.assert_allclose(c, [0.01, 2.0], rtol=1e-7)
    np.testing.assert_allclose(k * c, 1.0, rtol=1e-6)
