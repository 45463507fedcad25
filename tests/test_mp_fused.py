"""The fused normalisation (one norm, backward from the saved output) against plain autograd of the same equation."""

import math

import pytest
import torch

from diffusers_scalelong.layers import MPConv, normalize
from diffusers_scalelong.layers.mp import _Normalize


def plain_normalize(x: torch.Tensor, dim: tuple[int, ...], eps: float = 1e-4, scale: float = 1.0) -> torch.Tensor:
    """``x / ((eps + ||x|| sqrt(n_norm / n_x)) * scale)`` written out, differentiated by autograd."""
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
    return x / ((eps + norm * math.sqrt(norm.numel() / x.numel())) * scale).to(x.dtype)


def plain_mp_conv_weight(layer: MPConv, training: bool) -> torch.Tensor:
    """The unfused MPConv weight path: in-place projection onto unit-RMS rows, then the differentiable one."""
    if training:
        with torch.no_grad():
            w = layer.weight.to(torch.float32)
            rms = torch.linalg.vector_norm(w, dim=tuple(range(1, w.ndim)), keepdim=True) / math.sqrt(w[0].numel())
            layer.weight.copy_(w / rms.clamp_min(torch.finfo(torch.float32).tiny))
    w = layer.weight.to(torch.float32, copy=True)
    return plain_normalize(w, tuple(range(1, w.ndim)), scale=math.sqrt(w[0].numel()))


CASES = [  # (shape, dims, scale): a conv weight's rows, pixels (dim 1), attention heads (dim 2 of 5), a linear weight
    ((5, 3, 3, 3), (1, 2, 3), math.sqrt(27)),
    ((2, 4, 3, 5), (1,), 1.0),
    ((2, 2, 3, 3, 4), (2,), 1.0),
    ((6, 7), (1,), math.sqrt(7)),
]


@pytest.mark.parametrize(("shape", "dims", "scale"), CASES)
def test_gradcheck_float64(shape, dims, scale):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: _Normalize.apply(v, dims, 1e-4, scale, None), (x,))


@pytest.mark.parametrize(("shape", "dims", "scale"), CASES)
def test_equals_plain_autograd_float64(shape, dims, scale):
    x = torch.randn(shape, dtype=torch.float64) * 3
    x[0] = 0  # an all-zero slice: output 0, gradient g / eps on both paths
    grad = torch.randn(shape, dtype=torch.float64)
    fused_x, plain_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused, plain = _Normalize.apply(fused_x, dims, 1e-4, scale, None), plain_normalize(plain_x, dims, scale=scale)
    fused.backward(grad)
    plain.backward(grad)
    # float64: the two orders of operations differ by a few ulps.
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-14)
    # float64, the fused backward uses the saved output instead of recomputing: differs by float64 rounding
    torch.testing.assert_close(fused_x.grad, plain_x.grad, rtol=1e-10, atol=1e-12)


def test_normalize_float32_and_bfloat16_match_plain_autograd():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 16, 4, 4).to(dtype)
        grad = torch.randn(3, 16, 4, 4).to(dtype)
        fused_x, plain_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        normalize(fused_x, dim=1).backward(grad)
        plain_normalize(plain_x, (1,)).backward(grad)
        assert fused_x.grad.dtype == dtype
        # Same equation, other rounding order: a few ulps of the dtype (bf16 has 8 mantissa bits).
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(normalize(x, dim=1), plain_normalize(x, (1,)), **tolerance)
        torch.testing.assert_close(fused_x.grad, plain_x.grad, **tolerance)


def test_saves_the_output_not_the_input():
    x = torch.randn(4, 8, 5, 5, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = normalize(x * 1.0, dim=1)
    big = [t for t in saved if t.numel() == x.numel()]
    assert len(big) == 1 and big[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_double_backward_is_refused():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(normalize(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|twice"):
        grad.sum().backward()


@pytest.mark.parametrize("kernel", [(3, 3), ()])
@pytest.mark.parametrize("training", [True, False])
def test_mp_conv_fused_weight_path_equals_the_plain_one(kernel, training):
    torch.manual_seed(1)
    fused = MPConv(6, 5, kernel=kernel).train(training)
    with torch.no_grad():
        fused.weight.mul_(torch.rand(5).reshape(-1, *[1] * (len(kernel) + 1)) * 4)  # rows of different RMS
        fused.weight[2] = 0  # an all-zero row stays zero with a finite gradient
    plain = MPConv(6, 5, kernel=kernel).train(training)
    plain.load_state_dict(fused.state_dict())
    gain = torch.tensor(0.7, requires_grad=True)
    x = torch.randn(2, 6, 4, 4) if kernel else torch.randn(3, 6)
    out_fused = fused(x, gain=gain)
    (grad_gain_fused,) = torch.autograd.grad(out_fused.square().sum(), gain, retain_graph=True)
    out_fused.square().sum().backward()

    w = plain_mp_conv_weight(plain, training) * gain
    out_plain = torch.nn.functional.conv2d(x, w, padding=1) if kernel else x @ w.t()
    (grad_gain_plain,) = torch.autograd.grad(out_plain.square().sum(), gain, retain_graph=True)
    out_plain.square().sum().backward()
    assert torch.equal(fused.weight, plain.weight)  # the stored projection: bit for bit
    # float32: the fused path takes the projected rows' norm as sqrt(fan_in) exactly, the plain one recomputes it.
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-6)
    # float32, one norm instead of two and a different product order: a few float32 ulps over the row sums
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-6)
    # float32 reduction of the same terms in another order: a few ulps of a sum over the whole output
    torch.testing.assert_close(grad_gain_fused, grad_gain_plain, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(fused.weight.grad).all()


def test_mp_conv_bfloat16_weight_renormalises_the_rounded_rows():
    layer = MPConv(8, 4, kernel=(3, 3)).to(torch.bfloat16)
    x = torch.randn(1, 8, 5, 5, dtype=torch.bfloat16)
    layer(x)  # training mode: projected in float32, stored rounded to bfloat16
    assert layer.force_weight_normalization() is None  # rounded rows: the norm is recomputed
    expected = plain_normalize(layer.weight.float(), (1, 2, 3), scale=math.sqrt(72))
    torch.testing.assert_close(layer._unit_weight(), expected, rtol=1e-6, atol=1e-7)  # float32 ulps
