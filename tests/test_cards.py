"""Model cards: front matter (license, datasets, base model, tags) read back with huggingface_hub's parser, what the
weights are (EMA with its sigma_rel, another EMA, raw, not recorded), and load code that matches the repo's layout."""

import pytest
from diffusers import DDPMPipeline, DDPMScheduler
from huggingface_hub import ModelCard, ModelCardData

from diffusers_scalelong.hub import build_card, model_card
from diffusers_scalelong.hub.cards import DEFAULT_LICENSE, INSTALL
from diffusers_scalelong.models import ScaleLongUNet2DModel
from tests._tiny_models import TINY_UNET


def pipeline() -> DDPMPipeline:
    return DDPMPipeline(unet=ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs"), scheduler=DDPMScheduler())


def parsed(card: ModelCard) -> ModelCard:
    """The card as the Hub reads it: its text parsed again."""
    return ModelCard(str(card))


def test_front_matter_names_license_datasets_base_model_and_tags():
    card = parsed(model_card(pipeline(), "me/x", dataset="fashion_mnist", base_model="google/ddpm-cifar10-32",
                             datasets=["me/extra"], ema_sigma_rel=0.05))  # fmt: skip
    assert card.data.license == DEFAULT_LICENSE == "apache-2.0"
    assert card.data.datasets == ["fashion_mnist", "me/extra"]
    assert card.data.base_model == "google/ddpm-cifar10-32"
    assert card.data.library_name == "diffusers"
    assert {"diffusers-scalelong", "scalelong", "ema", "ScaleLongUNet2DModel", "DDPMPipeline"} <= set(card.data.tags)
    assert parsed(model_card(pipeline(), "me/x", license="cc-by-nc-sa-4.0")).data.license == "cc-by-nc-sa-4.0"


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"ema_sigma_rel": 0.1}, "The weights are a power-function EMA (EDM2, arXiv 2312.02696) of the training "
                                 "weights with relative length sigma_rel = 0.1."),
        ({"ema": True}, "The weights are an exponential moving average (EMA) of the training weights."),
        ({"ema": False}, "The weights are the raw training weights (no EMA)."),
        ({}, "Whether the weights are an EMA of the training weights or the raw weights was not recorded."),
    ],
)  # fmt: skip
def test_card_says_what_the_weights_are(kwargs, text):
    card = str(model_card(pipeline(), "me/x", **kwargs))
    assert f"## Weights\n\n{text}" in card
    assert ("- ema" in card) == bool(kwargs.get("ema_sigma_rel") or kwargs.get("ema"))


def test_contradicting_weights_arguments_are_refused():
    with pytest.raises(ValueError, match="ema=False contradicts ema_sigma_rel=0.1"):
        model_card(pipeline(), "me/x", ema_sigma_rel=0.1, ema=False)


def test_load_code_matches_the_layout():
    hub = str(model_card(pipeline(), "me/x"))
    plain = str(model_card(pipeline(), "me/x", hub_layout=False))
    assert 'DiffusionPipeline.from_pretrained("me/x", trust_remote_code=True)' in hub
    assert "import diffusers_scalelong" in plain and 'DiffusionPipeline.from_pretrained("me/x")\n' in plain
    assert "trust_remote_code" not in plain
    assert all(f"```bash\n{INSTALL}\n```" in card for card in (hub, plain))


def test_every_card_gets_the_package_tag_and_a_license():
    """Cards built by other modules (post-hoc EMA snapshot sets) from their own front matter."""
    card = parsed(build_card(ModelCardData(tags=["post-hoc-ema"], license="mit"), "t", "s", "code"))
    assert card.data.tags == ["diffusers-scalelong", "post-hoc-ema"] and card.data.license == "mit"
    assert parsed(build_card(ModelCardData(), "t", "s", "code")).data.license == DEFAULT_LICENSE
