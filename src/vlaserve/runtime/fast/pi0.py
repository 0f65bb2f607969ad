"""Pi0 on the fast path: FastPi05's prefix, kernels and Euler loop, with Pi0's two differences.

- The expert's plain RMSNorms and plain residuals are an AdaRMS schedule with scale 1 + w, shift 0
  and gate 1 (x·s + 0 and out·1 are exact), so the same Triton expert kernels run them.
- The state token's K/V depend on neither x_t nor t: `state_token` computes them once per call,
  right after the prefix, into the static cache's row after the prefix; the Euler steps then see it
  as one more valid context token, as the eager `Pi0Model.with_state` arranges it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...model.pi0 import Pi0Model
from ...model.flow import PrefixContext, euler_times
from .launch_tables import SM90, LaunchTable
from .model import FastPi05


class PlainSchedule:
    """What the expert steps need per step for Pi0: the time embedding, and the norms as a constant
    AdaRMS modulation (the attribute layout of model.TimeSchedule)."""

    def __init__(self, model: Pi0Model, num_steps: int, device):
        self.times = euler_times(num_steps)
        t = torch.tensor(self.times, dtype=torch.float32, device=device)
        self.time_emb = model.time_condition(t)  # [S, W] fp32
        layers = model.expert.layers
        scale = torch.stack([torch.stack([1.0 + lyr.input_layernorm.weight.float(),
                                          1.0 + lyr.post_attention_layernorm.weight.float()]) for lyr in layers])
        self.scale1p = scale[None].expand(num_steps, *scale.shape).contiguous()  # [S, L, 2, W]
        self.shift = torch.zeros_like(self.scale1p)
        self.gate = torch.ones(self.scale1p.shape, dtype=model.expert.dtype, device=device)
        final = 1.0 + model.expert.norm.weight.float()
        self.final_scale1p = final[None].expand(num_steps, -1).contiguous()
        self.final_shift = torch.zeros_like(self.final_scale1p)


class FastPi0(FastPi05):
    FUSED_ACTION_IO = False  # Pi0 embeds actions through its action-time MLP (velocity below)

    def _new_schedule(self, num_steps: int) -> PlainSchedule:
        return PlainSchedule(self.model, num_steps, self.model.action_in_proj.weight.device)

    def state_token(self, state: torch.Tensor, pad: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
        """Writes the state token's per-layer K/V into cache row P (P = prefix length); returns the
        context pad mask [B, P + 1]."""
        m, plen = self.model, pad.shape[1]
        ctx = PrefixContext(kv=[(k_cache[i, :, :plen][:, None], v_cache[i, :, :plen][:, None])
                                for i in range(k_cache.shape[0])], pad_mask=pad, num_valid=pad.long().sum(1))
        bias, positions = m.state_attention(ctx)
        state_kv: list = []
        m.expert(m.embed_state(state)[:, None], None, ctx.kv, bias, positions, new_kv=state_kv)
        for i, (k, v) in enumerate(state_kv):
            k_cache[i, :, plen] = k[:, 0, 0]
            v_cache[i, :, plen] = v[:, 0, 0]
        return torch.cat([pad, torch.ones_like(pad[:, :1])], dim=1)

    def velocity(self, x, step: int, sched: PlainSchedule, geometry, k_cache, v_cache, plen: int):
        m = self.model
        time_emb = sched.time_emb[step][None].expand(x.shape[0], -1)
        h = m.embed_actions(x, time_emb).to(self.dtype)
        out = self.expert_step(h, step, sched, geometry, k_cache, v_cache, plen)
        return F.linear(out.float(), m.action_out_proj.weight, m.action_out_proj.bias)


def fast_model(model, use_triton: bool = True, layer_stream=None, gemm_library: str = "cublas",
               attention_library: str = "triton", launch_table: LaunchTable = SM90) -> FastPi05:
    """The fast path's math for `model`'s family."""
    cls = FastPi0 if isinstance(model, Pi0Model) else FastPi05
    if cls is FastPi0 and gemm_library == "invariant":
        # Its action-time MLP and state token run the eager model's GEMMs, whose order follows the batch.
        raise ConfigError("batch_invariant serves Pi0 on the eager model only (fast_path=False, or a CPU): "
                          "its fast path's action-time MLP runs torch's GEMMs")
    return cls(model, use_triton=use_triton, layer_stream=layer_stream, gemm_library=gemm_library,
               attention_library=attention_library, launch_table=launch_table)
