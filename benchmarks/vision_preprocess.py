"""What an image costs a controller's CPU: loading + decoding a PNG, and Qwen2-VL's image processor, per size.

For each side (square images), a deterministic synthetic picture (smooth colour fields, a few flat
shapes and mild noise: it compresses like a rendered figure or a photo, not like white noise) is
written once as a PNG. Then each of `--processes` fresh processes, one after another, times
`--repeats` times, round-robin over the sizes so that slow drift of the machine touches every size
alike (each image's buffers are freed outside the timed calls),

* **decode**: `PIL.Image.open(path).convert("RGB")` (the file is in the page cache after the first
  read, so this is what a controller pays to load and decode an image it has locally);
* **preprocess**: the project's image path, `VisionProcessor.image_inputs` (Qwen2-VL's image
  processor: resize to multiples of 28 px within its pixel limits, rescale, normalise, patchify, as
  float32 `ImageInputs`), with the processor built as the tiny model folder builds its own
  (`Qwen2VLImageProcessorPil`) but at the real model's sizes: patch 14, merge 2, temporal patch 2,
  min_pixels 56 x 56, max_pixels 12,845,056 (Qwen2-VL's preprocessor_config.json; for sides up to
  1001 px the recipes' cap 28 x 28 x 1280 gives the same work).

Each call is timed by the thread's CPU time (`time.thread_time`) and by the wall clock. The CPU time
is what the simulator needs (CPU seconds of one worker) and is what is fitted: on a shared machine
the wall clock also counts the time other processes hold the core (the load average before and
after is recorded). Per size, the median over processes of each process's median (one process
repeats itself to a few per cent, but processes differ by up to a quarter at some sizes, with where
their buffers land in memory); then `seconds = a + b x megapixels` is fitted on `--fit-sides`
(`gcore_rl.costmodel.vision.fit_seconds_per_megapixel`, least squares on relative residuals) and the
relative error is reported on the other sides (held out). One thread (`torch.set_num_threads(1)`;
numpy and PIL work single-threaded here): the figures are per CPU worker. Writes a JSON with the
measurements, the fitted constants, the machine, the date and the command; `gcore_rl.costmodel.vision.
ImageSettings` carries the constants as its defaults.

    .venv/bin/python benchmarks/vision_preprocess.py --processes 7 --out bench-results/vision_preprocess.json  # ~1 min
    .venv/bin/python benchmarks/vision_preprocess.py --processes 7 --fit-sides 64 128 256 512 \
        --out bench-results/vision_preprocess_fit_small.json      # the same, fitted on the small sizes only
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import PIL
import torch
from long_tail import machine
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from gcore_rl.costmodel.vision import fit_seconds_per_megapixel
from gcore_rl.models.vision import VisionProcessor

SIDES = (64, 128, 256, 384, 512, 768, 1024)
FIT_SIDES = (64, 256, 512, 1024)  # the ends and two between; 128, 384 and 768 px are held out
QWEN2_VL_MAX_PIXELS = 12845056
# the keys VisionProcessor reads from a model's config.json (token ids do not matter for pixels)
CONFIG = {"image_token_id": 0, "vision_start_token_id": 1, "vision_end_token_id": 2,
          "vision_config": {"spatial_merge_size": 2}}


def synthetic_image(side: int, seed: int) -> Image.Image:
    """A square RGB picture: smooth colour gradients, a few flat rectangles and discs, and noise of +-4 levels."""
    rng = np.random.default_rng([seed, side])
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    channels = [127 + 100 * np.sin(2 * np.pi * (f1 * x + f2 * y) + phase)
                for f1, f2, phase in rng.uniform([0.3, 0.3, 0.0], [2.0, 2.0, 6.28], size=(3, 3))]
    image = np.stack(channels, axis=-1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.05, 0.2)
        colour = rng.uniform(0, 255, size=3)
        mask = (x - cx) ** 2 + (y - cy) ** 2 < r * r if rng.random() < 0.5 else (abs(x - cx) < r) & (abs(y - cy) < r / 2)
        image[mask] = colour
    image += rng.integers(-4, 5, size=image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def build_processor(max_pixels: int) -> VisionProcessor:
    """The project's image path with Qwen2-VL's real processor sizes."""
    image_processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                               min_pixels=56 * 56, max_pixels=max_pixels)
    return VisionProcessor(tokenizer=None, image_processor=image_processor, config=CONFIG)


def decode(path: Path) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


def write_images(sides, work: Path) -> dict[int, Path]:
    paths = {}
    for side in sides:
        paths[side] = work / f"image_{side}.png"
        synthetic_image(side, seed=0).save(paths[side], format="PNG")
    return paths


def measure(paths: dict[int, Path], repeats: int, max_pixels: int) -> list[dict]:
    """Median seconds of decode and preprocess per side in this process (round-robin over the sides, after
    one warm-up each), as the thread's CPU time (`cpu`) and as wall-clock time (`wall`)."""
    torch.set_num_threads(1)
    processor = build_processor(max_pixels)
    sides = sorted(paths)
    timings = {side: {f"{part}_{clock}": [] for part in ("decode", "preprocess") for clock in ("cpu", "wall")}
               for side in sides}
    grids = {}
    for repeat in range(repeats + 1):
        for side in sides:
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            image = decode(paths[side])
            cpu1, wall1 = time.thread_time(), time.perf_counter()
            inputs = processor.image_inputs([image])
            cpu2, wall2 = time.thread_time(), time.perf_counter()
            if repeat == 0:  # warm-up: first open, lazy imports, allocator
                grids[side] = [int(v) for v in inputs.grid_thw[0]]
            else:
                for name, value in (("decode_cpu", cpu1 - cpu0), ("decode_wall", wall1 - wall0),
                                    ("preprocess_cpu", cpu2 - cpu1), ("preprocess_wall", wall2 - wall1)):
                    timings[side][name].append(value)
            # freed here, untimed: rebinding the names inside the next timed call would charge the next
            # (smaller) image with releasing this one's buffers (25 MB of pixel values at 1024 px)
            del image, inputs
    rows = []
    for side in sides:
        t, h, w = grids[side]
        row = {"side": side, "megapixels": side * side / 1e6, "png_bytes": paths[side].stat().st_size,
               "grid_thw": [t, h, w], "patches": t * h * w, "tokens": t * h * w // 4}
        for part, values in timings[side].items():
            row[f"{part}_s_median"] = statistics.median(values)
            row[f"{part}_s_p10"] = float(np.percentile(values, 10))
            row[f"{part}_s_p90"] = float(np.percentile(values, 90))
        rows.append(row)
    return rows


def across_processes(runs: list[list[dict]]) -> list[dict]:
    """Per side, the median over processes of each process's medians, with the lowest and highest of them.

    One process's medians repeat to within a few per cent, but two processes differ by up to a
    quarter at the largest sizes (where the buffers live in memory differs), so the constants come
    from several fresh processes."""
    rows = []
    for per_side in zip(*runs, strict=True):
        row = {k: v for k, v in per_side[0].items() if not k.endswith(("_median", "_p10", "_p90"))}
        for key in per_side[0]:
            if key.endswith("_median"):
                values = [r[key] for r in per_side]
                row[key] = statistics.median(values)
                row[key.replace("_median", "_process_min")] = min(values)
                row[key.replace("_median", "_process_max")] = max(values)
        rows.append(row)
    return rows


def fit(rows: list[dict], part: str, fit_sides) -> dict:
    """`seconds = a + b x megapixels` (CPU seconds) on the fit sides; relative error on every side, held-out ones marked."""
    used = [r for r in rows if r["side"] in fit_sides]
    line = fit_seconds_per_megapixel([r["megapixels"] for r in used], [r[f"{part}_cpu_s_median"] for r in used])
    points = []
    for r in rows:
        measured = r[f"{part}_cpu_s_median"]
        predicted = float(line.predict(r["megapixels"]))
        points.append({"side": r["side"], "held_out": r["side"] not in fit_sides, "measured_s": measured,
                       "predicted_s": predicted, "relative_error": (predicted - measured) / measured})
    held = [abs(p["relative_error"]) for p in points if p["held_out"]]
    return {"seconds_per_image": line.intercept, "seconds_per_megapixel": line.slope, "fit_sides": list(fit_sides),
            "points": points, "held_out_max_abs_relative_error": max(held) if held else None,
            "held_out_mean_abs_relative_error": statistics.mean(held) if held else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=list(SIDES), help="image sides in pixels")
    parser.add_argument("--fit-sides", type=int, nargs="+", default=list(FIT_SIDES),
                        help="sides the line is fitted on; the others are held out")
    parser.add_argument("--repeats", type=int, default=25, help="timed repeats per side and process (after one warm-up)")
    parser.add_argument("--processes", type=int, default=5, help="fresh processes measuring one after another")
    parser.add_argument("--max-pixels", type=int, default=QWEN2_VL_MAX_PIXELS, help="the processor's max_pixels")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the PNG files go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not set(args.fit_sides) <= set(args.sides) or len(set(args.fit_sides)) < 2:
        parser.error("--fit-sides must name at least two of --sides")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = write_images(sorted(args.sides), work)
        # one fresh process per run (max_tasks_per_child=1), one run at a time
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                 max_tasks_per_child=1) as pool:
            runs = [pool.submit(measure, paths, args.repeats, args.max_pixels).result() for _ in range(args.processes)]
    rows = across_processes(runs)
    result = {
        "benchmark": "vision_preprocess",
        "command": " ".join([".venv/bin/python", "benchmarks/vision_preprocess.py", *map(shlex.quote, sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": {**machine(), "numpy": np.__version__, "pillow": PIL.__version__},
        "settings": {"repeats": args.repeats, "processes": args.processes, "threads_per_process": 1, "max_pixels": args.max_pixels, "min_pixels": 56 * 56, "patch_size": 14,
                     "merge_size": 2, "temporal_patch_size": 2, "format": "PNG (Pillow default compression)"},
        "clock": "medians of the thread's CPU time (time.thread_time) are fitted, wall-clock medians beside them",
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "sizes": rows,
        "per_process": runs,
        "fit": {part: fit(rows, part, sorted(set(args.fit_sides))) for part in ("decode", "preprocess")},
    }
    print(f"load average before {load_before[0]:.2f}, after {result['load_after'][0]:.2f} (1 min); milliseconds of "
          f"the thread's CPU time: median over {args.processes} processes of each one's median of {args.repeats} "
          "[lowest - highest process]")
    print(f"{'side':>5} {'MP':>6} {'PNG KiB':>8} {'tokens':>6} {'decode ms':>24} {'preprocess ms':>24}")
    for r in rows:
        print(f"{r['side']:>5} {r['megapixels']:>6.3f} {r['png_bytes'] / 1024:>8.1f} {r['tokens']:>6} "
              + " ".join(f"{1e3 * r[f'{p}_cpu_s_median']:>7.3f} [{1e3 * r[f'{p}_cpu_s_process_min']:>6.3f} - "
                         f"{1e3 * r[f'{p}_cpu_s_process_max']:>6.3f}]" for p in ("decode", "preprocess")))
    for part, f in result["fit"].items():
        print(f"{part}: {f['seconds_per_image'] * 1e3:.4f} ms per image + {f['seconds_per_megapixel'] * 1e3:.3f} ms per "
              f"megapixel (fit on {f['fit_sides']}); held-out relative error: "
              + (", ".join(f"{p['side']} px {100 * p['relative_error']:+.1f}%" for p in f["points"] if p["held_out"])
                 or "none (every side was fitted)"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
