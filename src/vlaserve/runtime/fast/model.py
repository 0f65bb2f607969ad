"""Pi05Model's function over static buffers, with fewer, larger kernels (the fast path's math).

- Q/K/V and gate/up projections through the fused weights (weights.py).
- The time condition and every AdaRMS modulation precomputed per step (they depend only on t).
- The prefix writes its K/V once into a static cache whose tail holds the action tokens' K/V,
  so an Euler step never concatenates.
Every method is CUDA-graph safe (graphs.py captures them), except the prefix when a layer stream
(the offload profile) brings its weights in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...model.gemma import MASK_VALUE, apply_rope, rms_normalize, rope_cos_sin
from ...model.flow import euler_times
from ...model.pi05 import Pi05Model
from ...model.rtc import RTCGuidance, guidance_table
from . import kernels
from .backends import attention_backend, gemm_backend
from .buffers import HostMirror, block_layout, typed_view
from .launch_tables import SM90, LaunchTable
from .targets import device_target
from .weights import FusedWeights, weight_of


class TimeSchedule:
    """Everything that depends only on t, for every step of an n-step schedule (fp32)."""

    def __init__(self, model: Pi05Model, num_steps: int, device):
        self.times = euler_times(num_steps)
        t = torch.tensor(self.times, dtype=torch.float32, device=device)
        cond = model.time_condition(t)  # [S, W]
        mods = []
        for lyr in model.expert.layers:
            mods.append(torch.stack([torch.stack(lyr.input_layernorm.modulation(cond)),
                                     torch.stack(lyr.post_attention_layernorm.modulation(cond))]))
        # [L, 2 norms, 3 (scale, shift, gate), S, 1, W] -> [S, L, 2, 3, W]
        m = torch.stack(mods)[..., 0, :].permute(3, 0, 1, 2, 4)
        self.scale1p = (1 + m[:, :, :, 0]).contiguous()  # [S, L, 2, W]
        self.shift = m[:, :, :, 1].contiguous()
        self.gate = m[:, :, :, 2].to(model.expert.dtype).contiguous()
        final = torch.stack(model.expert.norm.modulation(cond))[..., 0, :]  # [3, S, W]
        self.final_scale1p = (1 + final[0]).contiguous()
        self.final_shift = final[1].contiguous()


class FastPi05:
    """Pi05Model's function over static buffers; every method is CUDA-graph safe, except the prefix
    when `layer_stream` (the offload profile's LayerOffload) streams its layers in.

    What varies is chosen once, here: the Triton kernels or the stock ones per stack (SigLIP and the
    prefix, the expert), the GEMM and attention backends (backends.py), and the launch table the
    kernels take their configurations from (launch_tables.py)."""

    # Pi0.5's action projections are plain fp32 linears: one kernel runs them with the Euler update.
    FUSED_ACTION_IO = True

    def __init__(self, model: Pi05Model, use_triton: bool = True, layer_stream=None, gemm_library: str = "cublas",
                 attention_library: str = "triton", launch_table: LaunchTable = SM90):
        """gemm_library: "cublas", or "quack" for the prefix's and SigLIP's GEMMs where cute.FROM_ROWS
        says it is faster (an fp8 model takes its own GEMM); attention_library: "triton", or "fa4" for
        the prefix's attention; launch_table: the GPU's (launch_tables.table_for). Batch-invariant serving
        takes "invariant" for both and the table's batch_invariant_table()."""
        self.model = model
        self.layer_stream = layer_stream
        self.vlm_dims, self.expert_dims = model.vlm.dims, model.expert.dims
        self.dtype = model.vlm.dtype
        self.table = launch_table
        # Triton's fp32 dots round through tf32: float32 (the debugging dtype) stays on stock kernels.
        self.use_triton = use_triton and kernels.available() and self.dtype != torch.float32
        prefix_on_triton = self.use_triton and self.vlm_dims.width & (self.vlm_dims.width - 1) == 0
        expert_on_triton = self.use_triton and kernels.supported(self.expert_dims)
        target = device_target(self.device) if prefix_on_triton else None
        profile = "offload" if layer_stream is not None else "resident"
        self.gemm = gemm_backend(gemm_library, model, target, self.dtype, profile, self.use_triton, self.device,
                                 launch_table)
        self.attention = attention_backend(attention_library, target, self.dtype, profile, launch_table, self.device)
        if self.gemm.whole_model_on_triton and not (prefix_on_triton and expert_on_triton):
            raise ConfigError(f"gemm_library {gemm_library!r} needs every stack on the Triton kernels; this model's "
                              "prefix or expert dimensions run stock kernels")
        self._vision_layers = self._vision_triton if self.use_triton else self._vision_torch
        self._prefix_layers = self._prefix_triton if prefix_on_triton else self._prefix_torch
        self._expert = self._expert_triton if expert_on_triton else self._expert_torch
        self._fused_action_io = self.FUSED_ACTION_IO and expert_on_triton
        self._schedules: dict[int, TimeSchedule] = {}
        self._schedules_lock = threading.Lock()  # the capture thread makes schedules; refresh_weights rewrites them
        if layer_stream is None:
            self.w = FusedWeights.of(model)
        else:
            with layer_stream.slot_views():
                self.w = FusedWeights.of(model, views_only=True)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return self.model.action_in_proj.weight.device

    def schedule(self, num_steps: int) -> TimeSchedule:
        schedule = self._schedules.get(num_steps)  # every call reads it: no lock unless it must be made
        if schedule is None:
            with self._schedules_lock:
                schedule = self._schedules.get(num_steps)
                if schedule is None:
                    schedule = self._schedules[num_steps] = self._new_schedule(num_steps)
        return schedule

    def _new_schedule(self, num_steps: int) -> TimeSchedule:
        return TimeSchedule(self.model, num_steps, self.device)

    def refresh_weights(self) -> None:
        """Computes again, in place, what was derived from the weights (the norms' folded weights, each step
        schedule): for weights written into the parameters after this was built (checkpoint.weights.materialize),
        with graphs already reading these tensors."""
        self.w.refresh()
        with self._schedules_lock, torch.no_grad():
            for num_steps, schedule in self._schedules.items():
                fresh = self._new_schedule(num_steps)
                for name, value in vars(schedule).items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(getattr(fresh, name))

    # ---- prefix ---------------------------------------------------------------------------
    def _enter(self, stack: str, i: int) -> None:
        if self.layer_stream is not None:
            self.layer_stream.enter(stack, i)

    def vision(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> post-layernorm features [N, patches, W] (model dtype)."""
        vis = self.model.vision
        x = (self._patch_embedding(images) + vis.position_embedding.weight).to(self.dtype).contiguous()
        return self._vision_layers(x)

    def _vision_torch(self, x: torch.Tensor) -> torch.Tensor:
        vis = self.model.vision
        d = vis.dims
        n, p, _ = x.shape
        # LayerNorms in fp32 from bf16 parameters (the fp32 set is OpenPI's), as the Triton kernel does.
        for i, (lyr, (qkv_w, qkv_b)) in enumerate(zip(vis.layers, self.w.vision_qkv)):
            self._enter("vision", i)
            y = F.layer_norm(x.float(), (d.width,), lyr.layer_norm1.weight.float(),
                             lyr.layer_norm1.bias.float(), d.layer_norm_eps)
            attn = self._vision_attention(self.gemm.linear(y.to(self.dtype), qkv_w, qkv_b), n, p)
            x = x + lyr.self_attn.out_proj(attn)
            y = F.layer_norm(x.float(), (d.width,), lyr.layer_norm2.weight.float(),
                             lyr.layer_norm2.bias.float(), d.layer_norm_eps)
            x = x + lyr.mlp.fc2(F.gelu(lyr.mlp.fc1(y.to(self.dtype)), approximate="tanh"))
        post = vis.post_layernorm
        return F.layer_norm(x.float(), (d.width,), post.weight.float(), post.bias.float(), d.layer_norm_eps).to(self.dtype)

    def _patch_embedding(self, images: torch.Tensor) -> torch.Tensor:
        """The patch embedding (a stride-p p x p convolution, fp32) as one GEMM over the unfolded
        patches [N, patches, 3 p p]: the same products and sums, and faster than the convolution."""
        conv = self.model.vision.patch_embedding
        n, c, height, width = images.shape
        p = conv.kernel_size[0]
        patches = images.to(conv.weight.dtype).view(n, c, height // p, p, width // p, p)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(n, (height // p) * (width // p), c * p * p)
        return self.gemm.linear(patches, conv.weight.view(conv.weight.shape[0], -1), conv.bias)

    def warm_vision_attention(self, images: int) -> None:
        """SigLIP's attention over `images` images of zeros, outside any capture (FastRunner.capture's
        warm-up: torch's attention is slow the first time it meets a shape inside a capture)."""
        d = self.model.vision.dims
        qkv = torch.zeros(images * d.num_patches, 3 * d.num_heads * d.head_dim, dtype=self.dtype, device=self.device)
        self._vision_attention(qkv, images, d.num_patches)

    def _vision_attention(self, qkv: torch.Tensor, n: int, p: int) -> torch.Tensor:
        d = self.model.vision.dims
        return self.attention.vision(qkv, n, p, d.num_heads, d.head_dim)

    def _vision_triton(self, x: torch.Tensor) -> torch.Tensor:
        n, p, _ = x.shape
        x2d = x.view(n * p, -1)
        vis = self.model.vision
        eps = vis.dims.layer_norm_eps
        norms = [lyr.layer_norm1 for lyr in vis.layers[1:]] + [vis.post_layernorm]
        # What each norm's output feeds: the next layer's q/k/v, and after the last layer the projector.
        consumers = [w for w, _ in self.w.vision_qkv[1:]] + [None]
        ln, qkv_w = vis.layers[0].layer_norm1, self.w.vision_qkv[0][0]
        y = kernels.residual_layer_norm(x2d, ln.weight, ln.bias, eps, quantize=self.gemm.quantizes(qkv_w))
        for i, (lyr, (qkv_w, qkv_b), next_ln, next_w) in enumerate(zip(vis.layers, self.w.vision_qkv, norms,
                                                                        consumers)):
            self._enter("vision", i)
            attn = self._vision_attention(self.gemm.linear(y, qkv_w, qkv_b, "vision_qkv"), n, p)
            ln, out_proj, fc1 = lyr.layer_norm2, lyr.self_attn.out_proj, lyr.mlp.fc1
            fc1_w = weight_of(fc1)
            y = kernels.residual_layer_norm(x2d, ln.weight, ln.bias, eps,
                                            delta=self.gemm.linear(attn, weight_of(out_proj), out_proj.bias, "vision_o"),
                                            quantize=self.gemm.quantizes(fc1_w))
            act = self.gemm.linear_gelu("vision_fc1", y, fc1_w, fc1.bias)
            mlp = self.gemm.linear(act, weight_of(lyr.mlp.fc2), lyr.mlp.fc2.bias)
            y = kernels.residual_layer_norm(x2d, next_ln.weight, next_ln.bias, eps, delta=mlp,
                                            quantize=self.gemm.quantizes(next_w))
        return y.view(n, p, -1)

    def prefix(self, images, image_masks, tokens, token_mask, k_cache, v_cache, vision_slots: int | None = None):
        """Fills k_cache/v_cache[:, :, :P] ([L, B, T, D]) and returns the cache's pad mask [B, P].

        The cache holds each item's valid tokens first, in order: a token's row is its RoPE
        position (the reference counts positions over valid tokens only), and the masked tokens
        follow. So an item's valid keys are a prefix of its rows, which attention kernels that take
        a key length read directly (FlashAttention's seqused_k), and the mask returned is that
        prefix. Attention sums over the same keys as the reference's, in another order.

        vision_slots: only the first slots go through SigLIP; later slots must be masked in every
        item (absent cameras come last in the reference's slot order). Their tokens are zeros: a
        masked key gets weight exp(-2.4e38) = 0 exactly, so skipping them changes no action.
        """
        m = self.model
        b, n = images.shape[:2]
        seen = n if vision_slots is None else vision_slots
        per_image = self.model.vision.dims.num_patches
        img = torch.zeros(b, n * per_image, self.vlm_dims.width, dtype=self.dtype, device=images.device)
        if seen:
            feats = self.vision(images[:, :seen].flatten(0, 1))
            img[:, :seen * per_image] = self.gemm.linear(feats, m.projector.weight,
                                                         m.projector.bias).reshape(b, -1, img.shape[2])
        lang = m.vlm.embed(tokens)
        h = torch.cat([img.to(lang.dtype), lang], dim=1).to(self.dtype)
        pad = torch.cat([image_masks.repeat_interleave(per_image, dim=1), token_mask], dim=1)
        positions = pad.long().cumsum(1) - 1
        valid = pad.sum(1, keepdim=True)
        slots = torch.where(pad, positions, valid + (~pad).long().cumsum(1) - 1)  # masked tokens after the valid
        cache_pad = torch.arange(pad.shape[1], device=pad.device) < valid
        dims = self.vlm_dims
        cos, sin = rope_cos_sin(positions, dims.head_dim, dims.rope_theta, self.dtype)
        self._prefix_layers(h, pad, cache_pad, slots, cos, sin, k_cache, v_cache)
        return cache_pad

    def _prefix_torch(self, h, pad, cache_pad, slots, cos, sin, k_cache, v_cache):
        dims = self.vlm_dims
        b, plen, _ = h.shape
        bias = torch.where(pad[:, None, :] & pad[:, :, None], 0.0, MASK_VALUE).to(self.dtype)[:, None]
        rows = slots[..., None].expand(-1, -1, dims.head_dim)  # token -> cache row
        for i, lw in enumerate(self.w.vlm):
            self._enter("vlm", i)
            x = _rms(h, lw.norm1, dims.rms_norm_eps)
            q, k, v = _split_qkv(self.gemm.linear(x, lw.qkv), dims)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache[i, :, :plen].scatter_(1, rows, k[:, 0])
            v_cache[i, :, :plen].scatter_(1, rows, v[:, 0])
            if i == len(self.w.vlm) - 1:
                break  # the last layer's attention output and MLP feed nothing we use
            attn = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), attn_mask=bias)
            h = h + self.gemm.linear(attn.transpose(1, 2).reshape(b, plen, -1), lw.o)
            x = _rms(h, lw.norm2, dims.rms_norm_eps)
            h = h + self.gemm.linear(_geglu(self.gemm.linear(x, lw.gate_up)), lw.down)

    def _prefix_triton(self, h, pad, cache_pad, slots, cos, sin, k_cache, v_cache):
        # Padding queries attend to the valid keys here (the eager path spreads them uniformly over
        # all keys); either way they only shape padded tokens, which no valid token ever reads.
        dims = self.vlm_dims
        b, plen, width = h.shape
        half = dims.head_dim // 2
        cos_half = cos[:, 0, :, :half].float().reshape(b * plen, half)
        sin_half = sin[:, 0, :, :half].float().reshape(b * plen, half)
        rows = slots.to(torch.int32).reshape(b * plen)
        keys = self.attention.keys(cache_pad)
        eps, layers, table, gemm = dims.rms_norm_eps, self.w.vlm, self.table, self.gemm
        h2d = h.reshape(b * plen, width).contiguous()
        y = kernels.residual_norm(h2d, layers[0].norm1, eps=eps, quantize=gemm.quantizes(layers[0].qkv), table=table)
        q_rows = dims.num_heads * dims.head_dim
        for i, lw in enumerate(layers):
            self._enter("vlm", i)
            kv = (k_cache[i, :, :plen], v_cache[i, :, :plen])
            if i == len(layers) - 1:  # the last layer's queries, attention and MLP feed nothing we use
                kernels.qkv_rope_into_cache(gemm.linear(y, lw.qkv[q_rows:], gemm="prefix_qkv"), cos_half, sin_half,
                                            *kv, 0, plen, slots=rows, table=table)
                break
            q = kernels.qkv_rope_into_cache(gemm.linear(y, lw.qkv, gemm="prefix_qkv"), cos_half, sin_half, *kv,
                                            dims.num_heads, plen, slots=rows, table=table)
            attn = self.attention.prefix(q, *kv, keys, dims.num_heads, plen)
            y = kernels.residual_norm(h2d, lw.norm2, delta=gemm.linear(attn.view(b * plen, -1), lw.o, gemm="prefix_o"),
                                      eps=eps, quantize=gemm.quantizes(lw.gate_up), table=table)
            act = gemm.gate_up_geglu("prefix_gate_up", y, lw.gate_up, lw.down)
            y = kernels.residual_norm(h2d, layers[i + 1].norm1, delta=gemm.linear(act, lw.down), eps=eps,
                                      quantize=gemm.quantizes(layers[i + 1].qkv), table=table)

    # ---- denoising ------------------------------------------------------------------------
    def action_geometry(self, pad: torch.Tensor, horizon: int, cache_len: int):
        """Expert attention bias [B, T] (fp32; T = cache length, its unused tail masked) and the
        RoPE tables of the action tokens ([B, 1, H, D] in the model dtype)."""
        b, plen = pad.shape
        allowed = torch.zeros(b, cache_len, dtype=torch.bool, device=pad.device)
        allowed[:, :plen] = pad
        allowed[:, plen:plen + horizon] = True
        bias = torch.where(allowed, 0.0, MASK_VALUE).to(torch.float32)
        positions = pad.long().sum(1, keepdim=True) + torch.arange(horizon, device=pad.device)
        cos, sin = rope_cos_sin(positions, self.expert_dims.head_dim, self.expert_dims.rope_theta, self.dtype)
        return bias, cos, sin

    def velocity(self, x, step: int, sched: TimeSchedule, geometry, k_cache, v_cache, plen: int):
        m = self.model
        h = F.linear(x, m.action_in_proj.weight, m.action_in_proj.bias).to(self.dtype)
        out = self.expert_step(h, step, sched, geometry, k_cache, v_cache, plen)
        return F.linear(out.float(), m.action_out_proj.weight, m.action_out_proj.bias)

    def expert_step(self, h, step: int, sched, geometry, k_cache, v_cache, plen: int):
        """The expert over the action tokens h [B, H, W] at one step; final-normed hidden state out."""
        return self._expert(h, step, sched, geometry, k_cache, v_cache, plen)

    def _expert_torch(self, h, step, sched, geometry, k_cache, v_cache, plen):
        dims = self.expert_dims
        bias, cos, sin = geometry
        b, horizon, _ = h.shape
        hq, d = dims.num_heads, dims.head_dim
        mask = bias.to(self.dtype)[:, None, None]
        for i, lw in enumerate(self.w.expert):
            x1 = _ada_rms(h, sched.scale1p[step, i, 0], sched.shift[step, i, 0], dims.rms_norm_eps)
            q, k, v = _split_qkv(F.linear(x1, lw.qkv), dims)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache[i, :, plen:plen + horizon] = k[:, 0]
            v_cache[i, :, plen:plen + horizon] = v[:, 0]
            # MQA: the 8 query heads share one K/V head, so fold them into one 8x longer query axis.
            qf = q.reshape(b, 1, hq * horizon, d)
            attn = F.scaled_dot_product_attention(qf, k_cache[i][:, None], v_cache[i][:, None], attn_mask=mask)
            attn = attn.view(b, hq, horizon, d).transpose(1, 2).reshape(b, horizon, hq * d)
            h = h + F.linear(attn, lw.o) * sched.gate[step, i, 0]
            x2 = _ada_rms(h, sched.scale1p[step, i, 1], sched.shift[step, i, 1], dims.rms_norm_eps)
            h = h + F.linear(_geglu(F.linear(x2, lw.gate_up)), lw.down) * sched.gate[step, i, 1]
        return _ada_rms(h, sched.final_scale1p[step], sched.final_shift[step], dims.rms_norm_eps)

    def _expert_triton(self, h, step, sched, geometry, k_cache, v_cache, plen):
        dims = self.expert_dims
        bias, cos, sin = geometry
        b, horizon, width = h.shape
        half = dims.head_dim // 2
        # The kernels take the first half of the (duplicated) RoPE tables, as fp32 [B * H, D / 2].
        cos_half = cos[:, 0, :, :half].float().reshape(b * horizon, half)
        sin_half = sin[:, 0, :, :half].float().reshape(b * horizon, half)
        eps, layers, table = dims.rms_norm_eps, len(self.w.expert), self.table
        h2d = h.reshape(b * horizon, width).contiguous()
        y = kernels.residual_norm(h2d, sched.scale1p[step, 0, 0], sched.shift[step, 0, 0], eps=eps, table=table)
        cublas = {family: kernels.through_cublas(family, b, table) for family in kernels.EXPERT_GEMMS}

        def residual(family, x, w, gate, scale1p, shift):  # h += gate * x @ w^T, then AdaRMS(h)
            if cublas[family]:
                return kernels.residual_norm(h2d, scale1p, shift, delta=F.linear(x, w), gate=gate, eps=eps, table=table)
            return kernels.linear_residual_norm(x, w, h2d, gate, scale1p, shift, eps, table)

        for i, lw in enumerate(self.w.expert):
            tail = (k_cache[i, :, plen:plen + horizon], v_cache[i, :, plen:plen + horizon])
            if cublas["qkv"]:
                q = kernels.qkv_rope_into_cache(F.linear(y, lw.qkv), cos_half, sin_half, *tail, dims.num_heads, horizon,
                                                table=table)
            else:
                q = kernels.qkv_rope_into_cache(y, cos_half, sin_half, *tail, dims.num_heads, horizon, w_qkv=lw.qkv,
                                                table=table)
            attn = kernels.mqa_attention(q, k_cache[i], v_cache[i], bias, dims.num_heads, horizon,
                                         kernels.attention_config(b, table), table)
            y = residual("o", attn.view(b * horizon, -1), lw.o, sched.gate[step, i, 0], sched.scale1p[step, i, 1],
                         sched.shift[step, i, 1])
            if cublas["gate_up"]:
                act = kernels.geglu(F.linear(y, lw.gate_up))
            else:
                act = kernels.geglu_linear(y, lw.gate_up, table)
            if i + 1 < layers:
                scale1p, shift = sched.scale1p[step, i + 1, 0], sched.shift[step, i + 1, 0]
            else:
                scale1p, shift = sched.final_scale1p[step], sched.final_shift[step]
            y = residual("down", act, lw.down, sched.gate[step, i, 1], scale1p, shift)
        return y.view(b, horizon, width)

    def denoise(self, pad, noise, sched: TimeSchedule, k_cache, v_cache, rtc: "StaticRTC | None" = None,
                trace: torch.Tensor | None = None):
        """The Euler loop -> x at t = 0 [B, H, A]. `trace` [B, steps + 1, H, A] (float32), if given, gets x
        before each step and after the last (copies beside the same kernels: the actions do not change)."""
        horizon = noise.shape[1]
        plen = pad.shape[1]
        geometry = self.action_geometry(pad, horizon, k_cache.shape[2])
        dt = -1.0 / len(sched.times)
        if trace is not None:
            trace[:, 0].copy_(noise)
        if self._fused_action_io and noise.shape[0] * horizon <= self.table["action"]["max_rows"]:
            return self._denoise_fused(noise, sched, geometry, k_cache, v_cache, plen, dt, rtc, trace)
        x = noise
        for step, t in enumerate(sched.times):
            v = self.velocity(x, step, sched, geometry, k_cache, v_cache, plen)
            if rtc is not None:
                error = (rtc.prev - (x - t * v)) * rtc.weights[..., None]
                v = v - rtc.guidance[step][:, None, None] * error
            x = x + dt * v
            if trace is not None:
                trace[:, step + 1].copy_(x)
        return x

    def _denoise_fused(self, noise, sched, geometry, k_cache, v_cache, plen: int, dt: float, rtc, trace):
        """The Euler loop with the fp32 action projections, the update and RTC's guidance in one
        kernel between expert passes (kernels.action_step); x alternates between two buffers."""
        m = self.model
        b, horizon, a = noise.shape
        w_in, b_in = m.action_in_proj.weight, m.action_in_proj.bias
        w_out, b_out = m.action_out_proj.weight, m.action_out_proj.bias
        xs = (noise.reshape(b * horizon, a).clone(), torch.empty(b * horizon, a, device=noise.device))
        h = torch.empty(b * horizon, w_in.shape[0], dtype=self.dtype, device=noise.device)
        kernels.action_step(xs[0], h, w_in, b_in, table=self.table)
        steps = len(sched.times)
        for step, t in enumerate(sched.times):
            y = self.expert_step(h.view(b, horizon, -1), step, sched, geometry, k_cache, v_cache, plen)
            guidance = None if rtc is None else (rtc.prev.reshape(-1, a), rtc.weights.reshape(-1), rtc.guidance[step])
            kernels.action_step(xs[step % 2], h if step + 1 < steps else None, w_in, b_in,
                                y=y.reshape(b * horizon, -1), w_out=w_out, b_out=b_out, x_out=xs[(step + 1) % 2],
                                dt=dt, t=t, rtc=guidance, table=self.table)
            if trace is not None:  # before the next step overwrites the other buffer
                trace[:, step + 1].copy_(xs[(step + 1) % 2].view(b, horizon, a))
        return xs[steps % 2].view(b, horizon, a)


def _rms(x: torch.Tensor, weight1p: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_normalize(x, eps) * weight1p).to(x.dtype)


def _ada_rms(x, scale1p, shift, eps: float) -> torch.Tensor:
    return (rms_normalize(x, eps) * scale1p + shift).to(x.dtype)


def _geglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _split_qkv(qkv: torch.Tensor, dims):
    b, s, _ = qkv.shape
    hq, hkv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return (q.view(b, s, hq, d).transpose(1, 2), k.view(b, s, hkv, d).transpose(1, 2),
            v.view(b, s, hkv, d).transpose(1, 2))


@dataclass
class StaticRTC:
    prev: torch.Tensor  # [B, H, A]
    weights: torch.Tensor  # [B, H]
    guidance: torch.Tensor  # [S, B] guidance weight per step and item
    mirror: HostMirror  # the three lie in one block (views of it in `host`), filled from the host in one copy
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @staticmethod
    def allocate(b: int, horizon: int, action_dim: int, steps: int, device) -> "StaticRTC":
        """Each step's guidance row starts on a 16-byte boundary (rows of a multiple of 4 floats): an
        address's 16-byte alignment is part of a Triton kernel's specialization, so the fused action
        step that reads guidance[step] is then the same kernel at every step, and a warm-up of
        startup/capture.py's WARMUP_STEPS steps launches every kernel a call's steps do."""
        row = -(-b // 4) * 4
        shapes = ((b, horizon, action_dim), (b, horizon), (steps, row))
        starts, size = block_layout([(shape, torch.float32) for shape in shapes])
        block = torch.zeros(size, dtype=torch.uint8, device=device)
        mirror = HostMirror(block)

        def views(of: torch.Tensor):
            prev, weights, guidance = (typed_view(of, start, shape, torch.float32) for start, shape in zip(starts, shapes))
            return prev, weights, guidance[:, :b]

        return StaticRTC(*views(block), mirror, views(mirror.block))

    def fill(self, rtc: RTCGuidance, times: list[float]) -> None:
        """This call's guidance (from the host, as the runtime passes it; device tensors come back first):
        written into the host mirror, the per-step weights computed there (`guidance_table`), up in one copy."""
        self.mirror.ready()
        prev, weights, guidance = self.host
        prev.copy_(rtc.prev)
        weights.copy_(rtc.weights)
        guidance.copy_(guidance_table(times, rtc.max_weight))
        self.mirror.upload()
