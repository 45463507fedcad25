"""FD and KID: formulas against independent references, and the packaged metric's behaviour on real images."""

import itertools
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch

from diffusers_scalelong import data, metrics
from diffusers_scalelong.metrics import fd_kid, fmnist_net
from diffusers_scalelong.metrics.sanity import gaussian_blur, gaussian_noise

# ---------------------------------------------------------------------------------------------------------------------
# Frechet distance


def test_fd_matches_closed_form_for_diagonal_gaussians_from_samples():
    """For diagonal covariances, d^2 = |mu1 - mu2|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2 exactly."""
    rng = np.random.default_rng(0)
    mu1, mu2 = np.array([0.0, 1.0, -2.0, 0.5]), np.array([1.0, 1.0, 0.0, -0.5])
    var1, var2 = np.array([1.0, 4.0, 0.25, 2.0]), np.array([2.0, 1.0, 0.25, 0.5])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    x = mu1 + rng.standard_normal((400_000, 4)) * np.sqrt(var1)
    y = mu2 + rng.standard_normal((400_000, 4)) * np.sqrt(var2)
    estimate = metrics.frechet_distance(*metrics.gaussian_stats(x), *metrics.gaussian_stats(y))
    # 4e5 samples: mean errors ~sqrt(var / 4e5) ~ 2e-3 times |mu1 - mu2| <= 2 give ~1e-3 relative (5.6e-4 measured)
    assert estimate == pytest.approx(expected, rel=0.01)


def test_fd_matches_scipy_sqrtm_for_general_covariances():
    rng = np.random.default_rng(1)
    for dim, rank in [(3, 3), (16, 16), (16, 5)]:  # full-rank and singular covariances
        a, b = rng.standard_normal((dim, rank)), rng.standard_normal((dim, dim))
        sigma1, sigma2 = a @ a.T, b @ b.T + 0.1 * np.eye(dim)
        mu1, mu2 = rng.standard_normal(dim), rng.standard_normal(dim)
        brute = (
            np.sum((mu1 - mu2) ** 2)
            + np.trace(sigma1)
            + np.trace(sigma2)
            - 2 * np.trace(scipy.linalg.sqrtm(sigma1 @ sigma2)).real
        )
        # float64, another matrix square root; sqrtm of a product with a singular factor is accurate to only
        # ~sqrt(eps) = 1.5e-8 relative (6.7e-10 measured for rank 5)
        assert metrics.frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(brute, rel=1e-6, abs=1e-6)
    assert metrics.frechet_distance(mu1, sigma1, mu1, sigma1) == pytest.approx(0, abs=1e-6)  # the same, traces ~50


def test_fd_rejects_bad_shapes():
    with pytest.raises(ValueError, match="mismatched shapes"):
        metrics.frechet_distance(np.zeros(3), np.eye(3), np.zeros(2), np.eye(2))
    with pytest.raises(ValueError, match="N >= 2"):
        metrics.gaussian_stats(np.zeros((1, 3)))


# ---------------------------------------------------------------------------------------------------------------------
# KID


def brute_force_mmd2(x, y):
    """Unbiased MMD^2 with k(a, b) = (a.b / d + 1)^3, by explicit loops over pairs."""
    d = len(x[0])

    def k(a, b):
        return (sum(p * q for p, q in zip(a, b, strict=True)) / d + 1) ** 3

    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i, j in itertools.permutations(range(m), 2)) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    xy = sum(k(a, b) for a in x for b in y) / (m * n)
    return xx + yy - 2 * xy


def test_mmd2_matches_double_loop():
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((7, 5)), rng.standard_normal((9, 5)) + 0.3
    # float64 sums of <= 81 kernel values in another order: 3e-15 measured
    assert metrics.mmd2_unbiased(x, y) == pytest.approx(brute_force_mmd2(x.tolist(), y.tolist()), rel=1e-10)


def test_kid_subsets_are_seeded_and_unbiased():
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((60, 4)), rng.standard_normal((50, 4))
    # One subset as large as both sets is the full-sample estimate (MMD^2 is invariant to row order).
    full, std = metrics.kernel_distance(x[:50], y, num_subsets=1, subset_size=50)
    assert full == pytest.approx(brute_force_mmd2(x[:50].tolist(), y.tolist()), rel=1e-10) and std == 0  # as above
    assert metrics.kernel_distance(x, y, 20, 30, seed=5) == metrics.kernel_distance(x, y, 20, 30, seed=5)
    assert metrics.kernel_distance(x, y, 20, 30, seed=5) != metrics.kernel_distance(x, y, 20, 30, seed=6)
    # Same distribution: the unbiased estimate scatters around 0; a shifted distribution is clearly positive.
    same = [metrics.kernel_distance(*rng.standard_normal((2, 200, 4)), 10, 100, seed=s)[0] for s in range(20)]
    assert abs(np.mean(same)) < 3 * np.std(same) / np.sqrt(20) + 1e-3  # 3 standard errors; 1e-3 for tiny std
    assert metrics.kernel_distance(x, y + 1.0, 20, 30)[0] > 10 * np.std(same)
    with pytest.raises(ValueError, match="same D"):
        metrics.kernel_distance(x, y[:, :3])


# ---------------------------------------------------------------------------------------------------------------------
# the packaged classifier


def test_classifier_record_and_checksum(tmp_path):
    record = fmnist_net.load_record()
    weights = resources.files("diffusers_scalelong").joinpath("assets", fmnist_net.WEIGHTS_NAME)
    assert record["test_accuracy"] >= 0.90 and len(record["weights_sha256"]) == 64
    assert record["command"].startswith("python training/train_metric_classifier.py")
    payload = bytearray(weights.read_bytes())
    assert len(payload) < 2_000_000
    metrics.load_fmnist_net(weights_path=None)
    corrupt = tmp_path / fmnist_net.WEIGHTS_NAME
    payload[-1] ^= 0xFF
    corrupt.write_bytes(bytes(payload))
    with pytest.raises(ValueError, match="sha256 .* does not match"):
        fmnist_net.load_fmnist_net(corrupt)


def test_classifier_accuracy_on_embedded_test_split():
    """Accuracy on 4,000 random test images (binomial std ~0.4%): at least 90%, and close to the recorded value."""
    images, labels = data.load_fashion_mnist_arrays(split="test", embedded=True)
    index = np.random.default_rng(0).choice(len(images), 4000, replace=False)
    x = torch.from_numpy(images[index]).float().div(127.5).sub(1).unsqueeze(1)
    model = metrics.load_fmnist_net()
    with torch.no_grad():
        predictions = torch.cat([model(x[i : i + 1000]).argmax(1) for i in range(0, len(x), 1000)])
    accuracy = (predictions.numpy() == labels[index]).mean()
    assert accuracy >= 0.90
    # 4000 of the 10000 images behind the record: std sqrt(0.92 0.08 / 4000) sqrt(1 - 0.4) = 3.3e-3, 0.015 is 4.5 std
    assert accuracy == pytest.approx(fmnist_net.load_record()["test_accuracy"], abs=0.015)


# ---------------------------------------------------------------------------------------------------------------------
# the metric on real images


@pytest.fixture(scope="module")
def real_sets():
    """Two disjoint sets of 1,000 real test images (A, B) and the FMNISTNet features of B (the reference)."""
    images = metrics.load_reference_images("fashion-mnist-test", num_images=2000, seed=11)
    return images[:1000], images[1000:], metrics.get_feature_extractor()(images[1000:])


def score(images, reference_features):
    extractor = metrics.get_feature_extractor()
    return metrics.fd_kid_from_features(
        extractor(images), reference_features, extractor.name, kid_subsets=20, kid_subset_size=500
    )


def test_real_vs_real_near_zero_and_monotone_in_noise_and_blur(real_sets):
    a, _, reference = real_sets
    real = score(a, reference)
    noisy = [score(gaussian_noise(a, std), reference) for std in (0.1, 0.2, 0.4)]
    blurred = [score(gaussian_blur(a, sigma), reference) for sigma in (0.5, 1.0, 1.5)]
    for key in ("FD-FMNISTNet", "KID-FMNISTNet"):
        noise_curve = [real[key]] + [s[key] for s in noisy]
        blur_curve = [real[key]] + [s[key] for s in blurred]
        assert noise_curve == sorted(noise_curve), (key, noise_curve)
        assert blur_curve == sorted(blur_curve), (key, blur_curve)
    # With 1,000 images per set, FD carries a small-sample bias (~3 here, ~0.5 at 5,000); KID is unbiased.
    assert real["FD-FMNISTNet"] < 0.1 * min(noisy[1]["FD-FMNISTNet"], blurred[1]["FD-FMNISTNet"]), (real, noisy)
    assert abs(real["KID-FMNISTNet"]) < 0.1 * min(noisy[0]["KID-FMNISTNet"], blurred[0]["KID-FMNISTNet"])
    assert abs(real["KID-FMNISTNet"]) < 3 * real["KID-FMNISTNet-std"]


def test_named_reference_is_deterministic_and_resolution_aware(real_sets):
    a = real_sets[0][:300]
    kwargs = {"num_reference": 1000, "kid_subsets": 10, "kid_subset_size": 300}
    first = metrics.compute_fd_kid(a, **kwargs)
    fd_kid._reference_features.cache_clear()
    second = metrics.compute_fd_kid(a, **kwargs)
    assert first == second
    assert (first["num_generated"], first["num_reference"], first["reference"]) == (300, 1000, "fashion-mnist-test")
    # Real images at 32x32, prepared as ImageTransform prepares training data, against the reference prepared alike,
    # score far better than real images at their native 28x28 with a little noise.
    upsampled = torch.stack([data.ImageTransform()(data.load_default_dataset()[i]["image"]) for i in range(300)])
    at_32 = metrics.compute_fd_kid(upsampled, **kwargs)
    noisy_28 = metrics.compute_fd_kid(gaussian_noise(a, 0.1), **kwargs)
    assert at_32["FD-FMNISTNet"] < 0.5 * noisy_28["FD-FMNISTNet"], (at_32, noisy_28)


def test_tensor_reference_and_bad_inputs(real_sets):
    a, b, _ = real_sets
    extractor = metrics.get_feature_extractor()
    result = metrics.compute_fd_kid(a[:50], reference=b[:50], kid_subsets=5, kid_subset_size=20)
    direct = metrics.fd_kid_from_features(extractor(a[:50]), extractor(b[:50]), "FMNISTNet", 0, 5, 20)
    assert {key: result[key] for key in direct} == direct and result["reference"] == "tensor[50]"
    # three identical channels are read as the greyscale image
    rgb = metrics.compute_fd_kid(a[:50].expand(-1, 3, -1, -1), reference=b[:50], kid_subsets=5, kid_subset_size=20)
    # the float32 mean of three equal values is the value up to an ulp (3x rounds): 4e-8 relative measured
    assert {key: rgb[key] for key in direct} == pytest.approx(direct, rel=1e-5)
    with pytest.raises(ValueError, match="C = 1 or 3"):
        metrics.compute_fd_kid(torch.full((4, 2, 28, 28), -1.0))
    with pytest.raises(ValueError, match="reference must be one of"):
        metrics.compute_fd_kid(torch.full((4, 1, 28, 28), -1.0), reference="cifar10")
    with pytest.raises(ValueError, match="feature_space must be one of"):
        metrics.compute_fd_kid(torch.full((4, 1, 28, 28), -1.0), feature_space="inception")


def _installed_train_split():
    return next((p for p in data.FASHION_MNIST_SEARCH_PATHS if Path(p, "train-images-idx3-ubyte.gz").is_file()), None)


@pytest.mark.skipif(_installed_train_split() is None, reason="full Fashion-MNIST IDX files not installed")
def test_real_train_vs_real_test_near_zero(real_sets):
    _, _, reference = real_sets
    train = metrics.load_reference_images("fashion-mnist-train", num_images=1000, seed=0)
    real, noisy = score(train, reference), score(gaussian_noise(train, 0.2), reference)
    assert real["FD-FMNISTNet"] < 0.15 * noisy["FD-FMNISTNet"], (real, noisy)
    assert real["KID-FMNISTNet"] < 0.1 * noisy["KID-FMNISTNet"], (real, noisy)


# ---------------------------------------------------------------------------------------------------------------------
# EfficientNet-Lite0 feature space


def test_efficientnet_features_small(real_sets):
    extractor = metrics.EfficientNetLite0Features(resolution=64)
    a, b, _ = real_sets
    features = extractor(a[:40])
    assert features.shape == (40, 1280) and torch.isfinite(features).all()
    # Each image's features do not depend on the rest of its batch. Compared at the same batch size, so that the
    # same kernels run (conv kernels are chosen per batch shape and differ in the last bits across shapes): exact.
    mixed = extractor(torch.cat([a[:8], b[:32]]))
    torch.testing.assert_close(mixed[:8], features[:8], rtol=0, atol=0)
    real = metrics.frechet_distance(*metrics.gaussian_stats(features), *metrics.gaussian_stats(extractor(b[:40])))
    noisy_features = extractor(gaussian_noise(a[:40], 0.5))
    noisy = metrics.frechet_distance(*metrics.gaussian_stats(noisy_features), *metrics.gaussian_stats(features))
    assert noisy > 2 * real


def test_efficientnet_missing_extra_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite_pytorch", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"diffusers-scalelong\[efficientnet\]"):
        metrics.EfficientNetLite0Features()


@pytest.mark.slow
def test_efficientnet_metric_monotone_in_noise(real_sets):
    a, b, _ = real_sets
    kwargs = {"feature_space": "efficientnet-lite0", "kid_subsets": 20, "kid_subset_size": 250}
    curve = [
        metrics.compute_fd_kid(gaussian_noise(a[:500], std), reference=b[:500], **kwargs)
        for std in (0.0, 0.1, 0.2, 0.4)
    ]
    for key in ("FD-EffNetLite0", "KID-EffNetLite0"):
        values = [c[key] for c in curve]
        # 1280-d features from 500 images: the real-vs-real value carries a large small-sample bias.
        assert values == sorted(values) and values[0] < 0.5 * values[-1], (key, values)


def test_images_outside_the_documented_range_are_refused(real_sets):
    a, b, _ = real_sets
    kwargs = dict(reference=b[:50], kid_subsets=5, kid_subset_size=20)
    pixels = ((a[:50] + 1) * 127.5).round().to(torch.uint8)
    with pytest.raises(ValueError, match=r"float tensor.*torch.uint8.*127.5 - 1"):
        metrics.compute_fd_kid(pixels, **kwargs)
    unit = (a[:50] + 1) / 2  # what EDM2Pipeline(output_type="pt") returns
    with pytest.raises(ValueError, match=r"all in \[0, 1\].*value_range=\(0, 1\)"):
        metrics.compute_fd_kid(unit, **kwargs)
    # the same float operations as images * 2 - 1 on both sides: exact
    assert metrics.compute_fd_kid(
        unit, value_range=(0, 1), reference=(b[:50] + 1) / 2, kid_subsets=5, kid_subset_size=20
    ) == metrics.compute_fd_kid(unit * 2 - 1, **kwargs)
    with pytest.raises(ValueError, match=r"in \[-1.0, 1.0\], got values in \[-1, 3\]"):
        metrics.compute_fd_kid(a[:50] * 2 + 1, **kwargs)
    broken = a[:50].clone()
    broken[3, 0, :2, 0] = float("nan")
    with pytest.raises(ValueError, match="2 non-finite values"):
        metrics.compute_fd_kid(broken, **kwargs)
