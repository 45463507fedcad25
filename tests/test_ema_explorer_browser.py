"""The explorer in a real browser: headless Chromium moves the sigma_rel slider, the page's grid is checked pixel for
pixel against a pipeline reconstructed by ``reconstruct_ema`` and sampled with the same seed."""

import io
import re
import shutil
import socket
import time
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from diffusers_scalelong.ema import reconstruct_ema
from diffusers_scalelong.ema.explorer import launch
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._snapshot_runs import TIMES, TINY_EDM2, write_snapshots

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="Chromium is not installed (apt-get install chromium chromium-driver; .ci/run installs it)",
)
NUM_IMAGES, STEPS = 16, 4
WAIT_S = 30  # page load, gradio's queue and one tiny sampling run; generous for a busy 2-core machine


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:  # the element is being re-rendered by the page
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")


def _expected_grid(folder, sigma_rel: float) -> np.ndarray:
    """The grid computed independently: reconstruct_ema, a fresh pipeline, diffusers' PIL output, numpy tiling."""
    (state,) = reconstruct_ema(folder, [sigma_rel])
    unet = EDM2UNet2DModel(**TINY_EDM2).eval()
    unet.load_state_dict(state)
    pipeline = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(
        batch_size=NUM_IMAGES, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0)
    ).images
    pixels = np.stack([np.asarray(image.convert("L")) for image in images])  # [16, 8, 8]
    return pixels.reshape(4, 4, 8, 8).transpose(0, 2, 1, 3).reshape(32, 32)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_moving_the_slider_shows_the_grid_of_that_ema(tmp_path, browser):
    folder = write_snapshots(tmp_path / "snapshots")
    port = _free_port()
    app = launch(folder, port=port, block=False, num_images=NUM_IMAGES, num_inference_steps=STEPS, seed=0)
    try:
        browser.get(f"http://127.0.0.1:{port}/")
        status = lambda: browser.find_element(By.ID, "status").text  # noqa: E731
        first = _wait(lambda: re.search(r"sigma_rel = ([\d.]+) at time (\d+)", status()), "the first grid")
        assert (float(first.group(1)), int(first.group(2))) == (0.1, TIMES[-1])
        image = lambda: browser.find_element(By.CSS_SELECTOR, "#grid img").get_attribute("src")  # noqa: E731
        first_src = _wait(image, "the first grid image")

        # Click the range at a fifth of its width: the slider moves there and is released.
        track = browser.find_element(By.CSS_SELECTOR, "#sigma_rel input[type=range]")
        ActionChains(browser).move_to_element_with_offset(track, -track.size["width"] * 3 // 10, 0).click().perform()
        chosen = float(browser.find_element(By.CSS_SELECTOR, "#sigma_rel input[type=number]").get_attribute("value"))
        assert abs(chosen - 0.1) > 0.01, "the click did not move the slider"
        _wait(lambda: f"sigma_rel = {chosen:.3f}" in status() and image() != first_src, "the new grid")
        browser.save_screenshot(str(tmp_path / "explorer.png"))

        with urllib.request.urlopen(image()) as response:
            shown = np.asarray(Image.open(io.BytesIO(response.read())).convert("L"))
        expected = _expected_grid(folder, round(chosen, 6))
        scale = shown.shape[0] // expected.shape[0]  # the page enlarges each sample pixel to a square block
        assert shown.shape == (32 * scale, 32 * scale) and scale > 1
        np.testing.assert_array_equal(shown[::scale, ::scale], expected)
        np.testing.assert_array_equal(shown, np.kron(expected, np.ones((scale, scale), dtype=np.uint8)))
        assert (tmp_path / "explorer.png").stat().st_size > 10_000  # a rendered page, not a blank file
    finally:
        app.close()
