"""What sending camera frames as JPEG (or PNG) instead of raw pixels saves per observation, on a
link of limited bandwidth (simulated: the CPU costs are measured here, the transfer is computed).

    python bench/bench_encoded.py [--cameras 3] [--rates 10,50,100,1000] [--image FILE] [--smoke] [--out DIR]

For each frame size (224x224, 480x640) and encoding (raw uint8; JPEG at quality 90 and 95; PNG at zlib level 1), a
robot's observation of `--cameras` frames costs: encoding on the client (Pillow), the msgpack body's
transfer at each rate (bytes x 8 / rate: no latency, no protocol overhead, so the difference between
encodings is what it is on any link), and on the server the header check and decode (vlaserve's
own function, as a request takes it; raw frames cost neither). Times are medians over `--reps`
calls on this CPU, one thread. Frames are a synthetic scene (shaded background, objects, sensor noise)
unless `--image` gives a photo; JPEG sizes depend on the content.

Prints a table; writes bench_encoded.json and .png to --out (default bench/results/); --smoke runs 3
repetitions and finishes in seconds.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, parser, pyplot, save_json, save_png  # noqa: E402
from vlaserve.processing.encoded import decode_image  # noqa: E402
from vlaserve.types import EncodedImage  # noqa: E402

SIZES = ((224, 224), (480, 640))
ENCODINGS = {"raw": None, "jpeg_q90": ("JPEG", {"quality": 90}), "jpeg_q95": ("JPEG", {"quality": 95}),
             "png": ("PNG", {"compress_level": 1})}  # zlib level 1: a robot would not spend 40 ms a frame on level 6


def scene(height: int, width: int, seed: int) -> np.ndarray:
    """A camera-like frame: a lit table (gradients), a few flat-coloured objects, sensor noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([90 + 80 * y / height, 70 + 60 * x / width, 60 + 40 * (x + y) / (height + width)], axis=-1)
    for _ in range(6):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(0.05, 0.2) * min(height, width)
        inside = (y - cy) ** 2 + (x - cx) ** 2 < r ** 2
        image[inside] = rng.uniform(0, 255, 3) * (0.7 + 0.3 * (y[inside, None] - cy + r) / (2 * r))
    image += rng.normal(0, 3, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def photo(path: Path, height: int, width: int) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB").resize((width, height), Image.BILINEAR))


def median_ms(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def encode(frame: np.ndarray, fmt: str, options: dict) -> bytes:
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format=fmt, **options)
    return out.getvalue()


def body_bytes(frames: list) -> int:
    """The msgpack body a robot sends: the frames (openpi-client's ndarray encoding for raw), state, task."""
    def wire(frame):
        if isinstance(frame, bytes):
            return frame
        return {b"__ndarray__": True, b"data": frame.tobytes(), b"dtype": frame.dtype.str, b"shape": list(frame.shape)}
    images = {f"camera_{i}": wire(f) for i, f in enumerate(frames)}
    body = {"input": {"task": "pick up the red block",
                      "observation": {"images": images, "state": {b"__ndarray__": True, b"data": bytes(56),
                                                                  b"dtype": "<f4", b"shape": [14]}}}}
    return len(msgpack.packb(body))


def measure(size: tuple[int, int], cameras: int, rates: list[float], reps: int, image: Path | None) -> dict:
    frames = [photo(image, *size) if image else scene(*size, seed) for seed in range(cameras)]
    out = {}
    for name, spec in ENCODINGS.items():
        if spec is None:
            payloads, encode_ms, server_ms = frames, 0.0, 0.0
        else:
            fmt, options = spec
            payloads = [encode(f, fmt, options) for f in frames]
            encode_ms = sum(median_ms(lambda f=f: encode(f, fmt, options), reps) for f in frames)
            # What the server does with each, in Policy.prepare: check the header, decode.
            server_ms = sum(median_ms(lambda p=p: decode_image(EncodedImage(p), "images.x"), reps) for p in payloads)
        size_bytes = body_bytes(payloads)
        transfer = {f"{rate:g}": size_bytes * 8 / (rate * 1e6) * 1e3 for rate in rates}
        out[name] = {
            "frame_bytes": [len(p) if isinstance(p, bytes) else p.nbytes for p in payloads],
            "body_bytes": size_bytes, "client_encode_ms": encode_ms, "server_decode_ms": server_ms,
            "transfer_ms": transfer,
            "total_ms": {rate: encode_ms + t + server_ms for rate, t in transfer.items()},
        }
    for name in ENCODINGS:
        out[name]["saved_ms"] = {r: out["raw"]["total_ms"][r] - out[name]["total_ms"][r] for r in out[name]["total_ms"]}
    return out


def print_table(results: dict) -> None:
    rates = results["rates_mbit_s"]
    for size, rows in results["sizes"].items():
        print(f"\n{size} x {results['cameras']} cameras  (ms per observation; transfer + total at each Mbit/s)")
        print(f"{'encoding':10} {'kB/frame':>9} {'body kB':>8} {'encode':>7} {'decode':>7} "
              + " ".join(f"{f'@{r:g}':>8}" for r in rates) + "   saved vs raw")
        for name, row in rows.items():
            kb = statistics.mean(row["frame_bytes"]) / 1e3
            totals = " ".join(f"{row['total_ms'][f'{r:g}']:8.2f}" for r in rates)
            saved = " ".join(f"{row['saved_ms'][f'{r:g}']:+.1f}" for r in rates)
            print(f"{name:10} {kb:9.1f} {row['body_bytes'] / 1e3:8.1f} {row['client_encode_ms']:7.2f} "
                  f"{row['server_decode_ms']:7.2f} {totals}   {saved}")


def plot(results: dict):
    plt = pyplot()
    rates = results["rates_mbit_s"]
    fig, axes = plt.subplots(1, len(results["sizes"]), figsize=(6 * len(results["sizes"]), 4.2), squeeze=False)
    for ax, (size, rows) in zip(axes[0], results["sizes"].items()):
        for name, row in rows.items():
            ax.plot(rates, [row["total_ms"][f"{r:g}"] for r in rates], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="link (Mbit/s)", ylabel="ms per observation (encode + transfer + decode)",
               title=f"{results['cameras']} cameras at {size}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--cameras", type=int, default=3)
    ap.add_argument("--rates", default="10,50,100,1000", help="link rates in Mbit/s, comma-separated")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per measurement (median)")
    ap.add_argument("--image", type=Path, help="a photo to use as every camera's frame (resized)")
    args = ap.parse_args()
    reps = 3 if args.smoke else args.reps
    rates = [float(r) for r in args.rates.split(",")]
    results = {"cameras": args.cameras, "rates_mbit_s": rates, "reps": reps,
               "content": str(args.image) if args.image else "synthetic scene", "pillow": Image.__version__,
               "sizes": {f"{h}x{w}": measure((h, w), args.cameras, rates, reps, args.image) for h, w in SIZES}}
    print_table(results)
    log(f"wrote {save_json(results, args.out, 'bench_encoded')} and {save_png(plot(results), args.out, 'bench_encoded')}")


if __name__ == "__main__":
    main()
