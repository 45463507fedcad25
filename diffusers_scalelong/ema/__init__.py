"""ema subpackage."""
