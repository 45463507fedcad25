"""Magnitude-preserving layers: each checked against its equation or a brute-force computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from diffusers_scalelong.layers import (
    Block,
    MPConv,
    MPFourier,
    cached_weight_normalization,
    mp_cat,
    mp_silu,
    mp_sum,
    normalize,
    pixel_norm,
    resample,
)


def rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


def test_normalize_gives_unit_rms_slices_like_a_per_row_loop():
    w = torch.randn(6, 5, 3, 3) * torch.arange(1, 7).reshape(6, 1, 1, 1)
    out = normalize(w)
    for row_in, row_out in zip(w, out, strict=True):
        expected = row_in / (1e-4 + row_in.norm() / math.sqrt(row_in.numel()))
        # float32 defaults (rtol 1.3e-6): the same equation, but the norm of a batched reduction times
        # 1/sqrt(n) against a per-row norm divided by sqrt(n) - a few ulps apart (2 ulps measured).
        torch.testing.assert_close(row_out, expected)
        # eps lowers the RMS by eps / rms(row): 1.1e-4 for the smallest row here (RMS 0.88); 1e-3 holds down to 0.1.
        assert rms(row_out) == pytest.approx(1.0, abs=1e-3)


def test_pixel_norm_is_unit_rms_over_channels_at_every_pixel():
    x = torch.randn(2, 8, 4, 5) * 3 + 1
    per_pixel_rms = pixel_norm(x).pow(2).mean(dim=1).sqrt()
    # eps lowers each RMS by eps / rms(pixel): 6.6e-5 at the smallest pixel RMS here (1.5); 1e-3 holds down to 0.1.
    torch.testing.assert_close(per_pixel_rms, torch.ones_like(per_pixel_rms), atol=1e-3, rtol=0)


def test_mp_silu_has_unit_rms_for_standard_normal_input():
    # RMS of 1e6 samples: std 1.5e-3 (12 seeds), plus the bias of rounding 0.5955 to 0.596 (8e-4): about 6 std.
    assert rms(mp_silu(torch.randn(1_000_000))) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("t", [0.0, 0.3, 0.5, 0.8])
def test_mp_sum_preserves_unit_rms_and_weights_the_second_argument(t):
    a, b = torch.randn(2, 400_000)
    out = mp_sum(a, b, t)
    assert rms(out) == pytest.approx(1.0, abs=0.01)  # RMS of 4e5 samples: std 8e-4 (12 seeds), 12 std
    # t weights b: the correlation of the output with b is t / sqrt((1-t)^2 + t^2).
    corr_b = (out * b).mean().item()
    # mean of 4e5 products: std 1.3e-3 (12 seeds, t = 0.5), about 7 std
    assert corr_b == pytest.approx(t / math.sqrt((1 - t) ** 2 + t**2), abs=0.01)


@pytest.mark.parametrize("t", [0.3, 0.5, 0.7])
def test_mp_cat_preserves_unit_rms_and_splits_energy_by_balance(t):
    a = torch.randn(64, 32, 16, 16)
    b = torch.randn(64, 96, 16, 16)
    out = mp_cat(a, b, t=t)
    assert out.shape == (64, 128, 16, 16)
    assert rms(out) == pytest.approx(1.0, abs=0.01)  # RMS of 2.1e6 samples: std 9e-4 (5 seeds), 11 std
    energy_a = out[:, :32].pow(2).sum().item()
    energy_b = out[:, 32:].pow(2).sum().item()
    # ratio of two sums of 5.2e5 and 1.6e6 squares: relative std 3.1e-3 (5 seeds), about 6 std
    assert energy_b / energy_a == pytest.approx(t**2 / (1 - t) ** 2, rel=0.02)


def test_mp_cat_skip_scale_shrinks_the_share_of_b_and_keeps_unit_rms():
    a, b = torch.randn(32, 24, 8, 8), torch.randn(32, 40, 8, 8)
    t, kappa = 0.4, 0.3
    out = mp_cat(a, b, t=t, b_scale=kappa)
    assert rms(out) == pytest.approx(1.0, abs=0.01)  # RMS of 1.3e5 samples: std 2.4e-3 (12 seeds), 4 std
    # Direct: weights (1 - t) and kappa t per channel-normalised part, jointly rescaled to unit magnitude.
    joint = math.sqrt(64 / ((1 - t) ** 2 + (kappa * t) ** 2))
    expected = torch.cat([joint * (1 - t) / math.sqrt(24) * a, joint * kappa * t / math.sqrt(40) * b], dim=1)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # one float32 product per element on both sides
    assert torch.equal(mp_cat(a, b, t=t, b_scale=1.0), mp_cat(a, b, t=t))
    # A per-sample, per-channel gate: a constant gate equals the scalar; a random gate keeps unit RMS per sample.
    # float32 defaults: the tensor gate computes C in float32 instead of Python's float64 (a few ulps, 9.5e-7 here).
    torch.testing.assert_close(mp_cat(a, b, t=t, b_scale=torch.full((32, 40, 1, 1), kappa)), out)
    gate = torch.rand(32, 40, 1, 1)
    gated = mp_cat(a, b, t=t, b_scale=gate)
    per_sample = gated.square().mean(dim=(1, 2, 3)).sqrt()
    # largest of 32 per-sample RMS (4096 values each, unequally weighted by the gate): 0.037 +- 0.005 (12 seeds)
    torch.testing.assert_close(per_sample, torch.ones(32), atol=0.06, rtol=0)
    # both sides are a few float32 products and quotients, each exact to 2^-24 relative: 2.8e-7 measured
    torch.testing.assert_close(gated[:, 24:] / b, (gated[:, 24:25] / b[:, :1]) * gate / gate[:, :1], rtol=2e-6, atol=0)


def test_mp_fourier_features_have_unit_rms_and_are_fixed_buffers():
    fourier = MPFourier(2048)
    assert [name for name, _ in fourier.named_buffers()] == ["freqs", "phases"]
    assert list(fourier.parameters()) == []
    x = torch.linspace(-3, 3, 64)
    y = fourier(x)
    assert y.shape == (64, 2048)
    assert rms(y) == pytest.approx(1.0, abs=0.01)  # RMS over 2048 random frequencies: std 1.1e-3 (12 seeds), 9 std
    expected = math.sqrt(2) * torch.cos(x[:, None] * fourier.freqs + fourier.phases)
    torch.testing.assert_close(y, expected, atol=0, rtol=0)  # the same float32 operations


@pytest.mark.parametrize("kernel", [(), (3, 3), (1, 1)])
def test_mp_conv_preserves_unit_rms_whatever_the_weight_scale(kernel):
    layer = MPConv(256, 128, kernel=kernel).eval()
    with torch.no_grad():
        layer.weight.mul_(7.0)
        x = torch.randn(64, 256) if not kernel else torch.randn(16, 256, 12, 12)
        out = layer(x)
        interior = out if not kernel else out[:, :, 1:-1, 1:-1]  # zero padding lowers the border's magnitude
        # sample RMS; worst for the linear layer (64 inputs shared by 128 outputs): std 0.010 (6 seeds), 3 std
        assert rms(interior) == pytest.approx(1.0, abs=0.03)
        # the gain rounds each float32 weight (2^-24 relative); the RMS moves by 6e-8 at most here
        assert rms(layer(x, gain=2.5)) == pytest.approx(2.5 * rms(out), rel=1e-6)


def test_mp_conv_matches_plain_conv_with_fan_in_scaled_unit_weight():
    layer = MPConv(4, 6, kernel=(3, 3)).eval()
    x = torch.randn(2, 4, 5, 5)
    w = layer.weight.detach()
    rows = w.flatten(1)
    unit = (rows / (1e-4 + rows.norm(dim=1, keepdim=True) / math.sqrt(rows.shape[1]))).reshape(w.shape)
    expected = F.conv2d(x, unit * 0.5 / math.sqrt(4 * 9), padding=1)
    # float32 defaults: the weight is scaled in another order (x / (d * scale) * gain); 2.4e-7 measured
    torch.testing.assert_close(layer(x, gain=0.5), expected)


def test_forced_weight_normalization_in_training_mode_only():
    layer = MPConv(8, 5, kernel=(3, 3))
    with torch.no_grad():
        layer.weight.mul_(3.0)
    stored = layer.weight.detach().clone()
    layer.eval()
    layer(torch.randn(1, 8, 4, 4))
    assert torch.equal(layer.weight, stored), "eval mode must leave the stored weight untouched"

    layer.train()
    layer(torch.randn(1, 8, 4, 4))
    row_rms = layer.weight.detach().flatten(1).pow(2).mean(dim=1).sqrt()
    torch.testing.assert_close(row_rms, torch.ones(5), atol=1e-6, rtol=0)  # float32 mean of 72 squares: ~1e-7
    # float32 defaults: vector_norm / sqrt(n) against pow(2).mean().sqrt() (4.8e-7 measured, values up to 3)
    torch.testing.assert_close(
        layer.weight.detach(), stored / stored.flatten(1).pow(2).mean(1).sqrt()[:, None, None, None]
    )
    # The projection is idempotent (up to float rounding), so recomputing a forward keeps the weight.
    projected = layer.weight.detach().clone()
    layer(torch.randn(1, 8, 4, 4))
    # dividing once more by an RMS of 1 +- 1 ulp moves each value by at most 2 ulps (2.4e-7 relative)
    torch.testing.assert_close(layer.weight.detach(), projected, atol=0, rtol=1e-6)


def test_cached_weight_normalization_is_scoped_exact_and_follows_in_place_updates():
    layer = MPConv(6, 4, kernel=(3, 3)).eval()
    x = torch.randn(2, 6, 5, 5)
    with torch.no_grad():
        expected = layer(x, gain=0.7)
        assert layer._cached_weight is None
        with cached_weight_normalization(layer):
            torch.testing.assert_close(layer(x, gain=0.7), expected, atol=0, rtol=0)
            cached = layer._cached_weight
            assert cached is not None
            layer(x)
            assert layer._cached_weight is cached  # reused
            layer.weight.mul_(-1.0)  # an in-place update bumps the version counter: recomputed
            torch.testing.assert_close(layer(x, gain=0.7), -expected, atol=0, rtol=0)  # negation is exact
            assert layer._cached_weight is not cached
        assert layer._cached_weight is None and not layer.weight_cache_enabled
    with cached_weight_normalization(layer), torch.enable_grad():
        layer(x).sum().backward()  # autograd: no cache, gradients flow
        assert layer._cached_weight is None and layer.weight.grad is not None


def test_two_training_forwards_before_one_backward():
    layer = MPConv(6, 3, kernel=(3, 3))
    x = torch.randn(2, 6, 5, 5)
    (layer(x).sum() + layer(x).sum()).backward()
    twice = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).sum().backward()
    # float32 defaults: each training forward re-projects the weight (idempotent up to 1 ulp); 2.4e-7 measured
    torch.testing.assert_close(twice, 2 * layer.weight.grad)


def test_mp_conv_gradient_is_orthogonal_to_the_unit_weight_rows():
    layer = MPConv(16, 4)
    layer(torch.randn(8, 16)).square().sum().backward()
    grad, weight = layer.weight.grad, layer.weight.detach()
    cosine = (grad * weight).sum(dim=1) / (grad.norm(dim=1) * weight.norm(dim=1))
    # Exactly 0 but for normalize's eps: the part along w is eps / rms(w) = 1e-4 times the gradient's (rms(w) = 1
    # after the forced projection), so cosine = 1e-4 cot(angle(grad, w)): 9.6e-5 here, 1e-3 allows angles > 6 deg.
    assert cosine.abs().max().item() < 1e-3


def test_resample_is_box_filter_down_and_nearest_up():
    x = torch.randn(2, 3, 6, 8)
    down = resample(x, "down")
    expected_down = x.reshape(2, 3, 3, 2, 4, 2).mean(dim=(3, 5))
    torch.testing.assert_close(down, expected_down)  # float32 defaults: 4-term mean summed in another order
    up = resample(x, "up")
    assert torch.equal(up, x.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3))
    assert resample(x, "keep") is x
    with pytest.raises(ValueError, match="resample mode"):
        resample(x, "sideways")


def _brute_force_cosine_attention(block: Block, x: torch.Tensor) -> torch.Tensor:
    """Loop over samples and heads; to_qkv channel index = (head * d + channel) * 3 + {0: q, 1: k, 2: v}."""
    n, c, h, w = x.shape
    heads, d = block.num_heads, c // block.num_heads
    qkv = block.to_qkv(x).reshape(n, c * 3, h * w)
    out = torch.zeros(n, c, h * w)
    for i in range(n):
        for head in range(heads):
            rows = [(head * d + ch) * 3 for ch in range(d)]
            q, k, v = (qkv[i, [r + j for r in rows]] for j in range(3))
            q, k, v = (m / (m.pow(2).mean(dim=0, keepdim=True).sqrt() + 1e-4) for m in (q, k, v))
            weights = torch.softmax(q.T @ k / math.sqrt(d), dim=1)  # [queries, keys]
            out[i, head * d : (head + 1) * d] = v @ weights.T
    return block.to_out(out.reshape(n, c, h, w))


def test_block_attention_matches_brute_force_per_head_cosine_attention():
    block = Block(16, 16, emb_channels=8, attention=True, channels_per_head=4).eval()
    x = torch.randn(2, 16, 3, 4)
    # values up to 1.5; five float32 stages (qkv conv, normalize, softmax, weighted sum, output conv) in another
    # order: 1.8e-7 measured, 2e-6 is about 16 ulps at 1.0
    torch.testing.assert_close(block.attention(x), _brute_force_cosine_attention(block, x), atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    ("flavor", "mode", "in_ch", "out_ch", "shape"),
    [("enc", "keep", 32, 64, (16, 16)), ("enc", "down", 32, 32, (8, 8)), ("dec", "up", 64, 32, (32, 32))],
)
def test_block_shapes_and_unit_magnitude_at_init(flavor, mode, in_ch, out_ch, shape):
    emb = torch.randn(16, 16)
    x = torch.randn(16, in_ch, 16, 16)
    block = Block(in_ch, out_ch, emb_channels=16, flavor=flavor, resample_mode=mode)
    with torch.no_grad():
        out = block(x, emb)
    assert out.shape == (16, out_ch, *shape)
    assert rms(out) == pytest.approx(1.0, abs=0.05)  # random init, 16 samples: 0.988 +- 0.012 (6 seeds x 3 cases)

    # Softmax attention averages nearly uncorrelated values at init, so its branch is well below unit RMS and
    # mp_sum(x, attn, 0.3) lands near 0.7 / sqrt(0.58) = 0.92 - the paper accepts this.
    block = Block(
        in_ch, out_ch, emb_channels=16, flavor=flavor, resample_mode=mode, attention=True, channels_per_head=16
    )
    with torch.no_grad():
        assert 0.85 < rms(block(x, emb)) < 1.0


def test_block_embedding_gain_starts_at_zero_and_then_modulates():
    block = Block(8, 8, emb_channels=4).eval()
    x = torch.randn(2, 8, 4, 4)
    with torch.no_grad():
        assert torch.equal(block(x, torch.randn(2, 4)), block(x, torch.randn(2, 4)))  # a zero gain zeroes emb
        block.emb_gain.fill_(1.0)
        assert not torch.allclose(block(x, torch.randn(2, 4)), block(x, torch.randn(2, 4)))


def test_block_dropout_only_in_training_and_activation_clipping():
    block = Block(8, 8, emb_channels=4, flavor="dec", dropout=0.5, clip_act=2.0)
    x = torch.randn(2, 8, 4, 4) * 100
    emb = torch.randn(2, 4)
    with torch.no_grad():
        assert block(x, emb).abs().max().item() == 2.0
        torch.manual_seed(1)
        train_a = block(x / 100, emb)
        torch.manual_seed(2)
        train_b = block(x / 100, emb)
        assert not torch.equal(train_a, train_b)
        block.eval()
        assert torch.equal(block(x / 100, emb), block(x / 100, emb))


def test_block_rejects_bad_options():
    with pytest.raises(ValueError, match="flavor"):
        Block(8, 8, 4, flavor="middle")
    with pytest.raises(ValueError, match="channels_per_head"):
        Block(8, 12, 4, attention=True, channels_per_head=8)
