"""Loading of ScaleLong models from checkpoints saved without (or with other) LS gates."""


class LongSkipScalingLoaderMixin:
    """``from_pretrained`` that initialises LS gates missing from an older (e.g. vanilla) checkpoint.

    diffusers builds the model without running weight initialisers (and on ``meta`` with the default
    ``low_cpu_mem_usage=True``), then loads the checkpoint; gate parameters absent from it would stay
    uninitialised or on ``meta``. They are re-created here with their normal initialisation, on the device and
    dtype of the model's other parameters. Put this mixin before the diffusers model class in the bases.
    """

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        want_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if any(key.startswith("lsc.") for key in loading_info["missing_keys"]):
            reference = next(p for name, p in model.named_parameters() if not name.startswith("lsc."))
            model.lsc.reset_gates(device=reference.device, dtype=reference.dtype)
        return (model, loading_info) if want_loading_info else model
