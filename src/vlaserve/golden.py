"""Compare a Policy with reference-produced golden cases (the `pi05_golden` and `pi0_golden` formats).

Every case holds inputs and the values the reference computed from them, stage by stage. This
module recomputes each stage with our code and reports max|Δ| per tensor; tests assert on it and
`python -m vlaserve.golden GOLDEN_DIR` prints the table. The two formats share their names; a stage
only one family has (Pi0.5's state bins, Pi0's state token) is compared where the case records it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from .model.flow import euler_times, sinusoidal_time_embedding
from .model.rtc import rtc_guidance_weight
from .processing.prepare import model_images
from .runtime.transfer import to_device

# Bugs move these values by 1e-3 or more (golden README §3); independent float32
# implementations agree to ~1e-6. 1e-5 sits between the two with margin on both sides.
FLOAT_TOLERANCE = 1e-5
FLOAT32_AGREEMENT = 1e-6


@dataclass
class GoldenCase:
    name: str
    meta: dict
    tensors: dict[str, np.ndarray]

    @staticmethod
    def load(case_dir: Path) -> "GoldenCase":
        return GoldenCase(case_dir.name, json.loads((case_dir / "case.json").read_text()),
                          load_file(str(case_dir / "tensors.safetensors")))

    def observations(self) -> list[dict]:
        """The reference was fed float32 CHW `uint8 / 255.0`; rebuild exactly that."""
        t, m = self.tensors, self.meta
        obs = []
        for b in range(m["batch_size"]):
            images = {cam: t[f"input.image_uint8.{cam}"][b].astype(np.float32) / np.float32(255.0)
                      for cam in m["cameras_present"][b]}
            obs.append({"images": images, "state": t["input.state"][b], "task": m["tasks"][b]})
        return obs

    def rtcs(self) -> list[dict] | None:
        r = self.meta.get("rtc")
        if not r:
            return None
        left = self.tensors["input.rtc_prev_chunk_left_over"]
        return [{"prev_chunk": left[b], "inference_delay": r["inference_delay"],
                 "execution_horizon": r["execution_horizon"], "max_guidance_weight": r["max_guidance_weight"],
                 "schedule": r["prefix_attention_schedule"].lower()} for b in range(self.meta["batch_size"])]


def compare_case(policy, case: GoldenCase) -> tuple[dict[str, bool], dict[str, float]]:
    """-> (exact checks: name -> equal, float checks: name -> max|Δ|)."""
    t, m = case.tensors, case.meta
    exact: dict[str, bool] = {}
    deltas: dict[str, float] = {}

    def delta(name: str, ours, expected) -> None:
        ours = ours.detach().cpu().float().numpy() if isinstance(ours, torch.Tensor) else np.asarray(ours)
        if ours.shape != expected.shape:
            deltas[name] = float("inf")
        else:
            deltas[name] = float(np.abs(ours.astype(np.float64) - expected.astype(np.float64)).max())

    def equal(name: str, ours, expected) -> None:
        ours = ours.detach().cpu().numpy() if isinstance(ours, torch.Tensor) else np.asarray(ours)
        exact[name] = ours.shape == expected.shape and bool((ours == expected).all())

    obs = case.observations()
    rtcs = case.rtcs() or [None] * len(obs)
    requests = [policy.request(o, rtc=r) for o, r in zip(obs, rtcs)]
    prepared = [policy.prepare(r) for r in requests]
    exact["prompts"] = [p.prompt for p in prepared] == m["prompts"]
    exact["truncated"] = [p.truncated for p in prepared] == m["truncated"]
    if "expected.state_bins" in t:
        equal("state_bins", np.stack([p.state_bins for p in prepared]), t["expected.state_bins"])
    equal("tokens", torch.stack([p.tokens for p in prepared]), t["expected.tokens"])
    equal("token_mask", torch.stack([p.token_mask for p in prepared]), t["expected.token_mask"])
    delta("state_normalized", np.stack([p.normalized_state for p in prepared]), t["expected.state_normalized"])
    for cam in m["cameras_config_order"]:
        slot = [p.slot_cameras.index(cam) for p in prepared]
        delta(f"image.{cam}", torch.stack([model_images(p)[s] for p, s in zip(prepared, slot)]),
              t[f"expected.image.{cam}"])
        equal(f"image_mask.{cam}", torch.stack([p.image_mask[s] for p, s in zip(prepared, slot)]),
              t[f"expected.image_mask.{cam}"])
    exact["slot_order"] = all(
        [p.slot_cameras[s["slot"]] for s in m["model_image_order"]] == [s["camera"] for s in m["model_image_order"]]
        for p in prepared)

    model, device = policy.runtime.model, policy.runtime.device
    horizon = t["input.noise"].shape[1]
    with torch.no_grad():
        inputs, _, rtc = policy.preprocessor.collate(requests)
        inputs = to_device(inputs, device)
        embs, pad_mask = model.embed_prefix(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)
        delta("prefix_embs", embs, t["expected.prefix_embs"])
        equal("prefix_pad_mask", pad_mask, t["expected.prefix_pad_mask"])
        equal("prefix_position_ids", pad_mask.long().cumsum(1) - 1, t["expected.prefix_position_ids"])
        ctx = model.compute_prefix(embs, pad_mask)
        for i, (k, v) in enumerate(ctx.kv):
            delta(f"prefix_kv.{i}.key", k, t[f"expected.prefix_kv.{i}.key"])
            delta(f"prefix_kv.{i}.value", v, t[f"expected.prefix_kv.{i}.value"])
        if inputs.state is None:
            _, positions = model.action_attention(ctx, horizon)
            equal("suffix_position_ids", positions, t["expected.suffix_position_ids"])
        else:
            ctx = _compare_state_token(model, ctx, inputs.state, horizon, t, delta, equal)
        noise = torch.from_numpy(t["input.noise"]).to(device)
        batch = noise.shape[0]
        one = torch.ones(batch, dtype=torch.float32, device=device)
        delta("v_t1", model.velocity(noise, model.time_condition(one), ctx), t["expected.v_t1"])

        steps = m["num_steps"]
        times = euler_times(steps)
        delta("trace.timesteps", np.asarray(times, dtype=np.float32), t["expected.trace.timesteps"])
        width = model.expert.dims.width
        emb = [sinusoidal_time_embedding(torch.full((batch,), s, dtype=torch.float32), width,
                                         model.config.time_min_period, model.config.time_max_period) for s in times]
        delta("trace.time_emb", torch.stack(emb), t["expected.trace.time_emb"])
        if rtc is not None:
            rtc = rtc.to(device)
        trace: dict = {}
        actions_model = model.denoise(ctx, noise, steps, rtc, trace=trace)
        for name in ("x_t", "v_t", "adarms_cond", "v_guided"):
            if f"expected.trace.{name}" in t:
                delta(f"trace.{name}", torch.stack(trace[name]), t[f"expected.trace.{name}"])
        if "expected.trace.action_time_emb" in t:  # Pi0's action tokens: actions and time fused by an MLP
            fused = [model.embed_actions(x, e) for x, e in zip(trace["x_t"], trace["time_emb"])]
            delta("trace.action_time_emb", torch.stack(fused), t["expected.trace.action_time_emb"])
        if rtc is not None:
            delta("rtc.prefix_weights", rtc.weights[0], t["expected.rtc.prefix_weights"])
            w = torch.stack([rtc_guidance_weight(s, rtc.max_weight)[0] for s in times])
            delta("rtc.guidance_weight", w, t["expected.rtc.guidance_weight"])
        delta("actions_model", actions_model, t["expected.actions_model"])

    # The public API end to end, as a user calls it.
    results = policy.infer_batch(obs, noise=list(t["input.noise"]), num_steps=steps, rtcs=case.rtcs())
    delta("api.actions_model", np.stack([r.model_actions for r in results]), t["expected.actions_model"])
    delta("api.actions_normalized", np.stack([r.model_actions[:, : policy.config.action_dim] for r in results]),
          t["expected.actions_normalized"])
    delta("api.actions", np.stack([r.actions for r in results]), t["expected.actions"])
    if len(obs) == 1:  # the single-observation call too
        one = policy.infer(obs[0], noise=t["input.noise"][0], num_steps=steps, rtc=rtcs[0])
        delta("api.infer.actions", one.actions[None], t["expected.actions"])
    return exact, deltas


def _compare_state_token(model, prefix, state, horizon: int, t: dict, delta, equal):
    """Pi0's state token: the reference runs one suffix of 1 + H tokens each step; we run the state
    token once (`with_state`) and the action tokens each step. Rebuild the reference's suffix mask and
    positions from our two passes and compare them, and the state's values. -> the context with the
    state token's K/V."""
    batch = state.shape[0]
    delta("state_model", state, t["expected.state_model"])
    delta("state_emb", model.embed_state(state), t["expected.state_emb"])
    state_bias, state_pos = model.state_attention(prefix)
    ctx = model.with_state(prefix, state)
    action_bias, action_pos = model.action_attention(ctx, horizon)
    state_row = torch.cat([state_bias == 0, torch.zeros(batch, 1, horizon, dtype=torch.bool, device=state.device)],
                          dim=2)
    equal("suffix_att_2d_mask", torch.cat([state_row, action_bias == 0], dim=1), t["expected.suffix_att_2d_mask"])
    equal("suffix_position_ids", torch.cat([state_pos, action_pos], dim=1), t["expected.suffix_position_ids"])
    return ctx


def tolerance(case: GoldenCase, name: str) -> float:
    """FLOAT_TOLERANCE, except for RTC's guided velocity v_used = v - g * (prev - (x - t * v)) * w
    (t, w <= 1, g <= the case's max guidance weight): its float32 error is up to (1 + g)|dv| + g|dx|,
    i.e. (1 + 2 g_max) times the ~1e-6 at which float32 implementations agree: 2.1e-5 at g_max = 10,
    where the velocity itself agrees to ~1e-6 (measured on the golden cases: 7.6e-6 for Pi0.5, 1.14e-5
    for Pi0). Twice that bound, 4.2e-5, stays under the 1e-4 the golden READMEs cap tolerances at (section
    8) and 13x under the smallest bug they list (5.6e-4)."""
    if name == "trace.v_guided":
        return max(FLOAT_TOLERANCE, 2 * (1 + 2 * case.meta["rtc"]["max_guidance_weight"]) * FLOAT32_AGREEMENT)
    return FLOAT_TOLERANCE


def beyond_tolerance(case: GoldenCase, deltas: dict[str, float]) -> dict[str, float]:
    """The float checks of compare_case that are further from the reference than their tolerance."""
    return {name: d for name, d in deltas.items() if not d <= tolerance(case, name)}


def case_dirs(golden_dir: Path) -> list[Path]:
    return sorted(p for p in (golden_dir / "cases").iterdir() if (p / "case.json").exists())


def main(argv: list[str] | None = None) -> int:
    from .policy import Policy

    argv = sys.argv[1:] if argv is None else argv
    golden = Path(argv[0] if argv else "../shared/pi05_golden")
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)
    failed = False
    for case_dir in case_dirs(golden):
        case = GoldenCase.load(case_dir)
        exact, deltas = compare_case(policy, case)
        bad = [k for k, ok in exact.items() if not ok]
        print(f"## {case_dir.name}: exact checks {'all equal' if not bad else 'DIFFER: ' + ', '.join(bad)}")
        for name, d in deltas.items():
            print(f"  {name:28s} {d:.3g} (tolerance {tolerance(case, name):g})")
        failed |= bool(bad) or bool(beyond_tolerance(case, deltas))
    print("every case within tolerance" if not failed else "SOME CASES DIFFER")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
