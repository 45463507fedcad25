"""Offline image-quality metrics: Frechet distance and KID in the feature space of a Fashion-MNIST classifier
(``FD-FMNISTNet``, ``KID-FMNISTNet``) or of ImageNet EfficientNet-Lite0 (``FD-EffNetLite0``, ``KID-EffNetLite0``).

These are *not* Inception FID/KID: values are comparable only within one feature space and at equal sample counts.
"""

from .fd_kid import REFERENCES, compute_fd_kid, fd_kid_from_features, load_reference_images
from .features import (
    FEATURE_SPACES,
    EfficientNetLite0Features,
    FeatureExtractor,
    FMNISTFeatures,
    get_feature_extractor,
)
from .fmnist_net import FMNISTNet, load_fmnist_net
from .frechet import frechet_distance, gaussian_stats
from .kid import kernel_distance, mmd2_unbiased, polynomial_kernel

__all__ = [
    "FEATURE_SPACES",
    "REFERENCES",
    "EfficientNetLite0Features",
    "FMNISTFeatures",
    "FMNISTNet",
    "FeatureExtractor",
    "compute_fd_kid",
    "fd_kid_from_features",
    "frechet_distance",
    "gaussian_stats",
    "get_feature_extractor",
    "kernel_distance",
    "load_fmnist_net",
    "load_reference_images",
    "mmd2_unbiased",
    "polynomial_kernel",
]
