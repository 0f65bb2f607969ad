"""Compare our Pi0 with reference-produced golden cases (the `pi0_golden` format).

golden.py does this for Pi0.5 through a Policy; Pi0 is not wired into Policy yet, so this module
assembles the Pi0 pieces itself (tiny golden checkpoints always carry architecture.json) and reports
max|Δ| per tensor, stage by stage. `python -m vlaserve.pi0_golden GOLDEN_DIR` prints the table.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .config import _model_from_architecture
from .errors import CheckpointError
from .golden import FLOAT_TOLERANCE, GoldenCase, case_dirs
from .model.pi0 import Pi0Model
from .model.pi0_keys import PI0_LAYOUT, load_checkpoint
from .model.pi05 import RTCGuidance, euler_times, rtc_guidance_weight, rtc_prefix_weights
from .processing.images import empty_image, prepare_image
from .processing.normalize import Normalization
from .processing.pi0 import build_pi0_prompt, load_lerobot_mean_std
from .processing.prompt import PromptTokenizer


@dataclass
class Pi0Parts:
    """A Pi0 checkpoint's model and processing, as phase 2's Policy will hold them."""

    model: Pi0Model
    tokenizer: PromptTokenizer
    normalization: Normalization
    policy: dict  # architecture.json's "policy" section: cameras, dims, token length, resolution

    @staticmethod
    def load(checkpoint_dir: Path) -> "Pi0Parts":
        checkpoint_dir = Path(checkpoint_dir)
        arch = json.loads((checkpoint_dir / "architecture.json").read_text())
        p = arch["policy"]
        if p.get("type") != "pi0":
            raise CheckpointError(f"{checkpoint_dir}/architecture.json describes a {p.get('type')!r} policy, not pi0")
        config = _model_from_architecture(arch, p["chunk_size"], p["max_action_dim"])
        with torch.device("meta"):
            model = Pi0Model(config, max_state_dim=p["max_state_dim"])
        load_checkpoint(PI0_LAYOUT, model, checkpoint_dir)
        return Pi0Parts(model.eval(), PromptTokenizer.from_path(checkpoint_dir / "tokenizer"),
                        load_lerobot_mean_std(checkpoint_dir), p)

    def prepare(self, obs: dict) -> dict:
        """One observation -> slot-ordered images (present cameras in config order, then the absent
        ones, as the reference), prompt, tokens and the normalized state."""
        cameras, res = self.policy["cameras"], self.policy["image_resolution"][0]
        present = [c for c in cameras if c in obs["images"]]
        slots = present + [c for c in cameras if c not in present]
        images = [prepare_image(obs["images"][c], res, f"images.{c}") for c in present]
        prompt = build_pi0_prompt(obs["task"])
        tokens = self.tokenizer(prompt, self.policy["tokenizer_max_length"])
        return {"images": torch.stack(images + [empty_image(res)] * (len(slots) - len(present))),
                "image_mask": torch.tensor([c in present for c in slots]), "slots": slots, "prompt": prompt,
                "tokens": tokens, "state": self.normalization.state.normalize(obs["state"])}

    def rtc(self, rtcs: list[dict] | None, batch: int) -> RTCGuidance | None:
        if rtcs is None:
            return None
        h, a = self.model.config.chunk_size, self.model.config.max_action_dim
        prev, weights = torch.zeros(batch, h, a), torch.zeros(batch, h)
        for i, r in enumerate(rtcs):
            chunk = torch.from_numpy(r["prev_chunk"])
            prev[i, : chunk.shape[0], : chunk.shape[1]] = chunk  # zero-padded, as the reference
            weights[i] = rtc_prefix_weights(r["inference_delay"], min(r["execution_horizon"], chunk.shape[0]), h,
                                            r["schedule"])
        return RTCGuidance(prev, weights, torch.tensor([float(r["max_guidance_weight"]) for r in rtcs]))


def compare_case(parts: Pi0Parts, case: GoldenCase) -> tuple[dict[str, bool], dict[str, float]]:
    """-> (exact checks: name -> equal, float checks: name -> max|Δ|)."""
    t, m = case.tensors, case.meta
    exact: dict[str, bool] = {}
    deltas: dict[str, float] = {}

    def as_numpy(x) -> np.ndarray:
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    def delta(name: str, ours, expected) -> None:
        ours = as_numpy(ours)
        deltas[name] = (float(np.abs(ours.astype(np.float64) - expected.astype(np.float64)).max())
                        if ours.shape == expected.shape else float("inf"))

    def equal(name: str, ours, expected) -> None:
        ours = as_numpy(ours)
        exact[name] = ours.shape == expected.shape and bool((ours == expected).all())

    prepared = [parts.prepare(o) for o in case.observations()]
    exact["prompts"] = [p["prompt"] for p in prepared] == m["prompts"]
    exact["truncated"] = [p["tokens"].truncated for p in prepared] == m["truncated"]
    equal("tokens", np.stack([p["tokens"].ids for p in prepared]), t["expected.tokens"])
    equal("token_mask", np.stack([p["tokens"].mask for p in prepared]), t["expected.token_mask"])
    exact["slot_order"] = all([p["slots"][s["slot"]] for s in m["model_image_order"]]
                              == [s["camera"] for s in m["model_image_order"]] for p in prepared)
    for cam in m["cameras_config_order"]:
        slot = [p["slots"].index(cam) for p in prepared]
        delta(f"image.{cam}", torch.stack([p["images"][s] for p, s in zip(prepared, slot)]), t[f"expected.image.{cam}"])
        equal(f"image_mask.{cam}", torch.stack([p["image_mask"][s] for p, s in zip(prepared, slot)]),
              t[f"expected.image_mask.{cam}"])
    state = torch.from_numpy(np.stack([p["state"] for p in prepared]))
    delta("state_normalized", state, t["expected.state_normalized"])

    model = parts.model
    images = torch.stack([p["images"] for p in prepared])
    image_masks = torch.stack([p["image_mask"] for p in prepared])
    tokens = torch.from_numpy(np.stack([p["tokens"].ids for p in prepared]))
    token_mask = torch.from_numpy(np.stack([p["tokens"].mask for p in prepared]))
    noise = torch.from_numpy(t["input.noise"])
    batch, horizon = noise.shape[:2]
    with torch.no_grad():
        delta("state_model", F.pad(state, (0, model.max_state_dim - state.shape[1])), t["expected.state_model"])
        embs, pad_mask = model.embed_prefix(images, image_masks, tokens, token_mask)
        delta("prefix_embs", embs, t["expected.prefix_embs"])
        equal("prefix_pad_mask", pad_mask, t["expected.prefix_pad_mask"])
        equal("prefix_position_ids", pad_mask.long().cumsum(1) - 1, t["expected.prefix_position_ids"])
        prefix = model.compute_prefix(embs, pad_mask)
        for i, (k, v) in enumerate(prefix.kv):
            delta(f"prefix_kv.{i}.key", k, t[f"expected.prefix_kv.{i}.key"])
            delta(f"prefix_kv.{i}.value", v, t[f"expected.prefix_kv.{i}.value"])
        delta("state_emb", model.embed_state(state), t["expected.state_emb"])

        # The reference's one suffix of 1 + H tokens, rebuilt from our two passes: the state token's
        # (once per call) and the action tokens' (every step, the state's K/V in their context).
        state_bias, state_pos = model.state_attention(prefix)
        ctx = model.with_state(prefix, state)
        action_bias, action_pos = model.action_attention(ctx, horizon)
        state_row = torch.cat([state_bias == 0, torch.zeros(batch, 1, horizon, dtype=torch.bool)], dim=2)
        equal("suffix_att_2d_mask", torch.cat([state_row, action_bias == 0], dim=1), t["expected.suffix_att_2d_mask"])
        equal("suffix_position_ids", torch.cat([state_pos, action_pos], dim=1), t["expected.suffix_position_ids"])

        one = torch.ones(batch, dtype=torch.float32)
        delta("v_t1", model.velocity(noise, model.time_condition(one), ctx), t["expected.v_t1"])
        steps = m["num_steps"]
        times = euler_times(steps)
        delta("trace.timesteps", np.asarray(times, dtype=np.float32), t["expected.trace.timesteps"])
        rtc = parts.rtc(case.rtcs(), batch)
        trace: dict = {}
        actions_model = model.denoise(ctx, noise, steps, rtc, trace=trace)
        for name in ("x_t", "v_t", "time_emb", "v_guided"):
            if f"expected.trace.{name}" in t:
                delta(f"trace.{name}", torch.stack(trace[name]), t[f"expected.trace.{name}"])
        fused = [model.embed_actions(x, e) for x, e in zip(trace["x_t"], trace["time_emb"])]
        delta("trace.action_time_emb", torch.stack(fused), t["expected.trace.action_time_emb"])
        if rtc is not None:
            delta("rtc.prefix_weights", rtc.weights[0], t["expected.rtc.prefix_weights"])
            w = torch.stack([rtc_guidance_weight(s, rtc.max_weight)[0] for s in times])
            delta("rtc.guidance_weight", w, t["expected.rtc.guidance_weight"])
        delta("actions_model", actions_model, t["expected.actions_model"])

        # The whole model call in one, then the post-processing.
        sampled = model.sample(images, image_masks, tokens, token_mask, state, noise, steps, rtc).numpy()
    action_dim = parts.policy["action_dim"]
    delta("sample.actions_model", sampled, t["expected.actions_model"])
    delta("sample.actions_normalized", sampled[..., :action_dim], t["expected.actions_normalized"])
    delta("sample.actions", parts.normalization.action.cut(action_dim).unnormalize(sampled[..., :action_dim]),
          t["expected.actions"])
    return exact, deltas


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    golden = Path(argv[0] if argv else "tests/data/.unpacked/pi0_golden")
    parts = Pi0Parts.load(golden / "checkpoint")
    results = {d.name: compare_case(parts, GoldenCase.load(d)) for d in case_dirs(golden)}
    names = list(results)
    bad = {n: [k for k, ok in exact.items() if not ok] for n, (exact, _) in results.items()}
    print("exact checks (prompts, tokens, masks, positions, slot order): "
          + ("all equal" if not any(bad.values()) else f"DIFFER: {bad}"))
    rows = list(dict.fromkeys(k for _, deltas in results.values() for k in deltas))
    print(f"{'max|Δ|':26s}" + "".join(f"{n[:14]:>15s}" for n in names))
    for row in rows:
        print(f"{row:26s}" + "".join(f"{results[n][1][row]:15.2e}" if row in results[n][1] else f"{'-':>15s}"
                                     for n in names))
    worst = max(d for _, deltas in results.values() for d in deltas.values())
    print(f"worst max|Δ| = {worst:.3g} (tolerance {FLOAT_TOLERANCE:g})")
    return 0 if worst <= FLOAT_TOLERANCE and not any(bad.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
