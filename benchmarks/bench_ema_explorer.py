#!/usr/bin/env python
"""How live the post-hoc EMA explorer feels: slider release to new grid, with its breakdown.

Serves ``scalelong-ema-explorer SOURCE`` on 127.0.0.1 and drives it with headless Chromium: each round clicks the
sigma_rel slider at a new place (a release) and times until the page shows the new grid. The engine's own timings
(reconstruct: the weighted sum over the snapshots in memory plus loading it into the network; sample: the fixed-seed
grid) come from the page's status line; encode is the PNG encoding of the shown grid, timed here the way Gradio does
it (PIL, PNG). Writes a screenshot of the page and prints a Markdown table.

    python benchmarks/bench_ema_explorer.py /tmp/demo_run --sweep /tmp/demo_run/sweep/sweep.jsonl \\
        --screenshot benchmarks/results/ema_explorer.png
"""

import argparse
import io
import os
import platform
import re
import shutil
import socket
import statistics
import time

import torch
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from diffusers_scalelong.ema.explorer import launch
from diffusers_scalelong.ema.explorer.app import display_pixels


def _wait(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:  # the element is being re-rendered
            value = None
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError("the page did not update")


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="training output folder, snapshot folder or Hub repo id")
    parser.add_argument("--sweep", default=None, help="a sweep.jsonl to show beside")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the goal: 2 cores)")
    parser.add_argument("--num_images", type=int, default=16)
    parser.add_argument("--num_inference_steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="slider releases timed")
    parser.add_argument("--screenshot", default=None, help="PNG of the page after the last round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = launch(
        args.source, port=port, block=False, sweep=args.sweep, num_images=args.num_images,
        num_inference_steps=args.num_inference_steps,
    )  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1300"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    rows = []
    try:
        driver.get(f"http://127.0.0.1:{port}/")
        status = lambda: driver.find_element(By.ID, "status").text  # noqa: E731
        image = lambda: driver.find_element(By.CSS_SELECTOR, "#grid img").get_attribute("src")  # noqa: E731
        _wait(lambda: "sigma_rel =" in status() and image())
        track = driver.find_element(By.CSS_SELECTOR, "#sigma_rel input[type=range]")
        width = track.size["width"]
        for round_ in range(args.rounds):
            before = image()
            fraction = 0.15 + 0.7 * ((round_ * 0.37) % 1.0)  # a new place each round
            started = time.perf_counter()
            ActionChains(driver).move_to_element_with_offset(track, int((fraction - 0.5) * width), 0).click().perform()
            _wait(lambda before=before: image() != before)
            latency = time.perf_counter() - started
            text = status()
            seconds = dict(re.findall(r"(reconstruct|sample) ([\d.]+) s", text))
            sigma = re.search(r"sigma_rel = ([\d.]+)", text).group(1)
            # the target is cached: only the sampling is redone here, to get the pixels the page showed
            cpu_started = time.process_time()
            grid = app.page.explorer.sample(float(sigma), app.page.source.times[-1], args.num_inference_steps)
            cpu = time.process_time() - cpu_started  # CPU seconds of all threads: the work, whatever the load
            encode_started = time.perf_counter()
            Image.fromarray(display_pixels(grid.pixels)).save(io.BytesIO(), format="png")
            encode = time.perf_counter() - encode_started
            rows.append((sigma, float(seconds["reconstruct"]), float(seconds["sample"]), cpu, encode, latency))
        _wait(lambda: driver.find_element(By.CSS_SELECTOR, "#profile img, #profile svg, #profile canvas"), 30)
        time.sleep(1.0)  # let the plots finish drawing
        if args.screenshot:
            driver.save_screenshot(args.screenshot)
    finally:
        driver.quit()
        app.close()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {_cpu_model()}, {os.cpu_count()} logical CPUs, torch threads {args.threads}, load average {load:.1f}"
    )
    print(f"source: {args.source}; {args.num_images} images, {args.num_inference_steps} Heun steps\n")
    print(
        "| sigma_rel | reconstruct (s) | sample (s) | sample, CPU time of all threads (s) | encode PNG (s) "
        "| slider release to new grid (s) |"
    )
    print("|---|---|---|---|---|---|")
    for sigma, reconstruct, sample, cpu, encode, latency in rows:
        print(f"| {sigma} | {reconstruct:.3f} | {sample:.3f} | {cpu:.2f} | {encode:.4f} | {latency:.2f} |")
    medians = [statistics.median(column) for column in list(zip(*rows, strict=True))[1:]]
    print("| **median** | " + " | ".join(f"**{m:.3f}**" for m in medians) + " |")


if __name__ == "__main__":
    main()
