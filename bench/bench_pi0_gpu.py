"""Pi0 on the GPU: the fast path against our eager model and LeRobot 0.6.1's PI0Policy, one run.

Full-size Pi0 with random weights (bf16 + the fp32 set), 3 cameras 224x224, prompts of 48 tokens (20
valid) -> 816 prefix tokens + the state token, chunk 50x32, 10 steps; batch 1, 2, 4, 8. Checks first
(max|Δ| against float32 on the same weights, for ours and LeRobot's bf16), then CUDA-event times.
Writes bench_pi0_gpu.json and .png.

    python bench/bench_pi0_gpu.py [--lerobot] [--batches 1,2,4,8] [--out DIR]
"""

from __future__ import annotations

import copy
import time

import torch

from common import (CAMERA_NAMES, HORIZON, STEPS, golden_checkpoint, lerobot_policy, log, maxdiff, parser,
                    per_item_max, pyplot, random_prefix_inputs, sample, save_json, save_png, time_ms)
from vlaserve.checkpoint.weights import PI0_LAYOUT
from vlaserve.config import ModelConfig, PolicyConfig
from vlaserve.family import load_policy_config
from vlaserve.model.pi0 import Pi0Model
from vlaserve.runtime.runner import EagerRunner
from vlaserve.types import ModelInputs

TOKENS, VALID_TOKENS, STATE = 48, 20, 32


def random_pi0(config: ModelConfig, dtype: torch.dtype, device: str) -> Pi0Model:
    """A random Pi0 built on `device`: weights in `dtype` but for Pi0's fp32 set."""
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        model = Pi0Model(config, max_state_dim=STATE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02, generator=gen)
            if name.startswith("vision.") and name.endswith("layernorm.weight"):
                p.add_(1.0)
            if not PI0_LAYOUT.fp32.search(name):
                p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def make_inputs(b: int, vocab: int, seed: int, device: str):
    g = torch.Generator(device=device).manual_seed(seed)
    images, masks, tokens, token_mask = random_prefix_inputs(g, b, vocab, len(CAMERA_NAMES), TOKENS, VALID_TOKENS)
    state = torch.zeros(b, STATE, device=device)
    state[:, :14] = torch.rand(b, 14, device=device, generator=g) * 2 - 1
    noise = torch.randn(b, HORIZON, 32, device=device, generator=g)
    return ModelInputs(images, masks, tokens, token_mask, state), noise


def eager(model, x, noise):
    with torch.no_grad():
        return model.sample(x.images, x.image_masks, x.tokens, x.token_mask, x.state, noise, STEPS)


def build_lerobot(model: Pi0Model, dtype: str, device: str):
    """LeRobot 0.6.1's PI0Policy holding exactly our weights."""
    from lerobot.policies.pi0.configuration_pi0 import PI0Config
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy

    return lerobot_policy(PI0Policy, PI0Config, {PI0_LAYOUT.to_lerobot(n): p for n, p in model.named_parameters()},
                          dtype, ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in",
                                  "action_time_mlp_out"), device)


def lerobot_sample(policy, x, noise):
    with torch.no_grad():
        return policy.model.sample_actions([x.images[:, i] for i in range(len(CAMERA_NAMES))],
                                           [x.image_masks[:, i] for i in range(len(CAMERA_NAMES))],
                                           x.tokens, x.token_mask, x.state, noise=noise)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--lerobot", action="store_true", help="also run LeRobot 0.6.1 (needs its wheels)")
    ap.add_argument("--batches", default=None, help="batch sizes (default: 1,2,4,8; --smoke: 1)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    timing = {"warmup": 1, "iters": 2} if args.smoke else {"warmup": 3, "iters": 20}
    eager_timing = timing if args.smoke else {"warmup": 2, "iters": 5}
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [int(b) for b in (args.batches or ("1" if args.smoke else "1,2,4,8")).split(",")]
    started = time.time()
    model_config = load_policy_config(golden_checkpoint("pi0")).model if args.smoke else ModelConfig.full_size()
    model = random_pi0(model_config, torch.bfloat16, device)
    model32 = copy.deepcopy(model).float()
    config = PolicyConfig(model.config, CAMERA_NAMES, 14, 14, max_token_len=TOKENS)
    if device == "cuda":
        from vlaserve.runtime.graphs import FastRunner

        served = {"fast": FastRunner(model, config)}
    else:  # --smoke: the eager runner stands in for the CUDA fast path
        served = {"eager_runner": EagerRunner(model, torch.device(device))}
    (name, runner), = served.items()
    vocab = model.config.vlm.vocab_size
    results: dict = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "smoke": args.smoke, "served_variant": name, "workload": {
                         "cameras": len(CAMERA_NAMES), "tokens": TOKENS, "valid_tokens": VALID_TOKENS,
                         "horizon": HORIZON, "steps": STEPS}, "timings": {}, "accuracy": {}}
    lerobot = None
    if args.lerobot:
        try:
            lerobot = (build_lerobot(model, "bfloat16", device), build_lerobot(model32, "float32", device))
        except Exception as e:  # noqa: BLE001 - the rest of the run stays useful
            results["lerobot_error"] = f"{type(e).__name__}: {e}"
            log("lerobot:", results["lerobot_error"])
    for b in batches:
        x, noise = make_inputs(b, vocab, seed=b, device=device)
        ref32 = eager(model32, x, noise)
        ours = sample(runner, x, noise)[0]
        acc = {f"{name}_vs_fp32": maxdiff(ours, ref32), f"{name}_vs_fp32_mean_item_max": per_item_max(ours, ref32),
               "eager_bf16_vs_fp32": maxdiff(eager(model, x, noise), ref32),
               f"{name}_repeat_bit_identical": bool(torch.equal(ours, sample(runner, x, noise)[0]))}
        t = {name: time_ms(lambda: sample(runner, x, noise), device, **timing),
             "eager_bf16": time_ms(lambda: eager(model, x, noise), device, **eager_timing)}
        if lerobot is not None:
            l16, l32 = lerobot_sample(lerobot[0], x, noise), lerobot_sample(lerobot[1], x, noise)
            acc.update({"lerobot_bf16_vs_fp32": maxdiff(l16, l32), "ours_fp32_vs_lerobot_fp32": maxdiff(ref32, l32),
                        "lerobot_bf16_vs_fp32_mean_item_max": per_item_max(l16, l32)})
            t["lerobot_bf16"] = time_ms(lambda: lerobot_sample(lerobot[0], x, noise), device, **eager_timing)
        results["timings"][b], results["accuracy"][b] = t, acc
        log(f"b={b}:", {k: round(v["p50_ms"], 2) for k, v in t.items()}, acc)
    results["elapsed_s"] = time.time() - started
    save_json(results, args.out, "bench_pi0_gpu")
    plot(results, args.out)


def plot(results: dict, out) -> None:
    plt = pyplot()
    batches = sorted(results["timings"], key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in results["timings"][batches[0]]:
        ax.plot(batches, [results["timings"][b][variant]["p50_ms"] for b in batches], marker="o", label=variant)
    ax.set(yscale="log", xlabel="batch size", ylabel="time per call, p50 (ms)", title=f"Pi0 on {results['gpu']}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save_png(fig, out, "bench_pi0_gpu")


if __name__ == "__main__":
    main()
