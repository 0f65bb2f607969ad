"""CUDA fast path: fused weights, static buffers and CUDA graphs for the whole Pi0.5 call.

The eager model (vlaserve.model) stays the reference that CPU tests exercise; this module
computes the same function with fewer, larger kernels:
- Q/K/V and gate/up projections fused into one GEMM each; Gemma (1 + w) norm weights folded.
- The time condition and every AdaRMS modulation precomputed per step (they depend only on t).
- The prefix writes its K/V once into a static cache whose tail holds the action tokens' K/V,
  so an Euler step never concatenates.
- One graph for the prefix (per batch size) and one for all Euler steps (per batch size, step
  count and RTC on/off), replayed back to back with events between them for stage timings.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.gemma import MASK_VALUE, apply_rope, rms_normalize, rope_cos_sin
from ..model.pi05 import Pi05Model, RTCGuidance, euler_times, rtc_guidance_weight
from . import kernels


def _adjacent_span(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose row slices `parts` already are (back to back in one storage), or None."""
    first = parts[0]
    for a, b in zip(parts, parts[1:]):
        if (b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or b.dtype != a.dtype
                or b.shape[1:] != a.shape[1:] or not (a.is_contiguous() and b.is_contiguous())
                or b.data_ptr() != a.data_ptr() + a.numel() * a.element_size()):
            return None
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _fuse(*linears, bias: bool = False, views_only: bool = False) -> torch.Tensor:
    """The layers' weights (or biases) as one tensor whose slices the layers' parameters are, so the
    fused tensor is the only copy: their span when they already lie back to back (offload slots),
    else a concatenation the parameters are re-pointed into (`views_only` forbids that)."""
    parts = [lin.bias if bias else lin.weight for lin in linears]
    span = _adjacent_span([p.data for p in parts])
    if span is not None:
        return span
    if views_only:
        raise ValueError("fused weights must alias the offload slots, but the parts are not adjacent there")
    fused = torch.cat([p.data for p in parts], dim=0)
    offset = 0
    for p in parts:
        p.data = fused[offset:offset + p.shape[0]]
        offset += p.shape[0]
    return fused


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, W]
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 M, W]
    down: torch.Tensor
    norm1: torch.Tensor | None  # (1 + w), fp32; None for the AdaRMS expert
    norm2: torch.Tensor | None


class FusedWeights:
    @staticmethod
    def of(model: Pi05Model, views_only: bool = False) -> "FusedWeights":
        """One fusion per model: a second engine on the same model shares it instead of copying."""
        if getattr(model, "_fused_weights", None) is None:
            model._fused_weights = FusedWeights(model, views_only)
        return model._fused_weights

    def __init__(self, model: Pi05Model, views_only: bool = False):
        def layer(lyr, ada: bool) -> LayerWeights:
            a, m = lyr.self_attn, lyr.mlp
            return LayerWeights(
                qkv=_fuse(a.q_proj, a.k_proj, a.v_proj, views_only=views_only and not ada), o=a.o_proj.weight,
                gate_up=_fuse(m.gate_proj, m.up_proj, views_only=views_only and not ada),
                down=m.down_proj.weight,
                norm1=None if ada else (1.0 + lyr.input_layernorm.weight.float()),
                norm2=None if ada else (1.0 + lyr.post_attention_layernorm.weight.float()))

        self.vlm = [layer(lyr, ada=False) for lyr in model.vlm.layers]
        self.expert = [layer(lyr, ada=True) for lyr in model.expert.layers]
        self.vision_qkv = []
        for lyr in model.vision.layers:
            a = lyr.self_attn
            self.vision_qkv.append((_fuse(a.q_proj, a.k_proj, a.v_proj, views_only=views_only),
                                    _fuse(a.q_proj, a.k_proj, a.v_proj, bias=True)))


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
    when `layer_stream` (the offload profile's LayerOffload) streams its layers in."""

    def __init__(self, model: Pi05Model, use_triton: bool = True, layer_stream=None):
        self.model = model
        self.layer_stream = layer_stream
        if layer_stream is None:
            self.w = FusedWeights.of(model)
        else:
            with layer_stream.slot_views():
                self.w = FusedWeights.of(model, views_only=True)
        self.vlm_dims, self.expert_dims = model.vlm.dims, model.expert.dims
        self.dtype = model.vlm.dtype
        # Triton's fp32 dots round through tf32: float32 (the debugging dtype) stays on stock kernels.
        self.use_triton = use_triton and kernels.available() and self.dtype != torch.float32
        self._schedules: dict[int, TimeSchedule] = {}

    def schedule(self, num_steps: int) -> TimeSchedule:
        if num_steps not in self._schedules:
            self._schedules[num_steps] = TimeSchedule(self.model, num_steps, self.model.action_in_proj.weight.device)
        return self._schedules[num_steps]

    # ---- prefix ---------------------------------------------------------------------------
    def _enter(self, stack: str, i: int) -> None:
        if self.layer_stream is not None:
            self.layer_stream.enter(stack, i)

    def vision(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> post-layernorm features [N, patches, W] (model dtype)."""
        vis = self.model.vision
        d = vis.dims
        x = vis.patch_embedding(images).flatten(2).transpose(1, 2) + vis.position_embedding.weight
        x = x.to(self.dtype).contiguous()
        n, p, _ = x.shape
        if self.use_triton:
            return self._vision_triton(x.view(n * p, -1), n, p).view(n, p, -1)
        for i, (lyr, (qkv_w, qkv_b)) in enumerate(zip(vis.layers, self.w.vision_qkv)):
            self._enter("vision", i)
            y = F.layer_norm(x.float(), (d.width,), lyr.layer_norm1.weight, lyr.layer_norm1.bias, d.layer_norm_eps)
            attn = self._vision_attention(F.linear(y.to(self.dtype), qkv_w, qkv_b), n, p)
            x = x + lyr.self_attn.out_proj(attn)
            y = F.layer_norm(x.float(), (d.width,), lyr.layer_norm2.weight, lyr.layer_norm2.bias, d.layer_norm_eps)
            x = x + lyr.mlp.fc2(F.gelu(lyr.mlp.fc1(y.to(self.dtype)), approximate="tanh"))
        post = vis.post_layernorm
        return F.layer_norm(x.float(), (d.width,), post.weight, post.bias, d.layer_norm_eps).to(self.dtype)

    def _vision_attention(self, qkv: torch.Tensor, n: int, p: int) -> torch.Tensor:
        d = self.model.vision.dims
        q, k, v = qkv.view(n, p, 3, d.num_heads, d.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, scale=d.head_dim**-0.5)
        return attn.transpose(1, 2).reshape(qkv.shape[:-1] + (d.num_heads * d.head_dim,))

    def _vision_triton(self, x2d: torch.Tensor, n: int, p: int) -> torch.Tensor:
        vis = self.model.vision
        eps = vis.dims.layer_norm_eps
        norms = [lyr.layer_norm1 for lyr in vis.layers[1:]] + [vis.post_layernorm]
        ln = vis.layers[0].layer_norm1
        y = kernels.residual_layer_norm(x2d, ln.weight, ln.bias, eps)
        for i, (lyr, (qkv_w, qkv_b), next_ln) in enumerate(zip(vis.layers, self.w.vision_qkv, norms)):
            self._enter("vision", i)
            attn = self._vision_attention(F.linear(y, qkv_w, qkv_b), n, p)
            ln = lyr.layer_norm2
            y = kernels.residual_layer_norm(x2d, ln.weight, ln.bias, eps, delta=lyr.self_attn.out_proj(attn))
            mlp = lyr.mlp.fc2(F.gelu(lyr.mlp.fc1(y), approximate="tanh"))
            y = kernels.residual_layer_norm(x2d, next_ln.weight, next_ln.bias, eps, delta=mlp)
        return y

    def prefix(self, images, image_masks, tokens, token_mask, k_cache, v_cache, vision_slots: int | None = None):
        """Fills k_cache/v_cache[:, :, :P] ([L, B, T, D]) and returns the prefix pad mask [B, P].

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
            img[:, :seen * per_image] = F.linear(feats, m.projector.weight, m.projector.bias).reshape(b, -1, img.shape[2])
        lang = m.vlm.embed(tokens)
        h = torch.cat([img.to(lang.dtype), lang], dim=1).to(self.dtype)
        pad = torch.cat([image_masks.repeat_interleave(per_image, dim=1), token_mask], dim=1)
        positions = pad.long().cumsum(1) - 1
        dims = self.vlm_dims
        cos, sin = rope_cos_sin(positions, dims.head_dim, dims.rope_theta, self.dtype)
        if self.use_triton and dims.width & (dims.width - 1) == 0:
            self._prefix_triton(h, pad, cos, sin, k_cache, v_cache)
        else:
            self._prefix_torch(h, pad, cos, sin, k_cache, v_cache)
        return pad

    def _prefix_torch(self, h, pad, cos, sin, k_cache, v_cache):
        dims = self.vlm_dims
        b, plen, _ = h.shape
        bias = torch.where(pad[:, None, :] & pad[:, :, None], 0.0, MASK_VALUE).to(self.dtype)[:, None]
        for i, lw in enumerate(self.w.vlm):
            self._enter("vlm", i)
            x = _rms(h, lw.norm1, dims.rms_norm_eps)
            q, k, v = _split_qkv(F.linear(x, lw.qkv), dims)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache[i, :, :plen] = k[:, 0]
            v_cache[i, :, :plen] = v[:, 0]
            if i == len(self.w.vlm) - 1:
                break  # the last layer's attention output and MLP feed nothing we use
            attn = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), attn_mask=bias)
            h = h + F.linear(attn.transpose(1, 2).reshape(b, plen, -1), lw.o)
            x = _rms(h, lw.norm2, dims.rms_norm_eps)
            h = h + F.linear(_geglu(F.linear(x, lw.gate_up)), lw.down)

    def _prefix_triton(self, h, pad, cos, sin, k_cache, v_cache):
        # Padding queries attend to the valid keys here (the eager path spreads them uniformly over
        # all keys); either way they only shape padded tokens, which no valid token ever reads.
        dims = self.vlm_dims
        b, plen, width = h.shape
        half = dims.head_dim // 2
        cos_half = cos[:, 0, :, :half].float().reshape(b * plen, half)
        sin_half = sin[:, 0, :, :half].float().reshape(b * plen, half)
        key_bias = torch.where(pad, 0.0, MASK_VALUE).to(torch.float32)
        eps, layers = dims.rms_norm_eps, self.w.vlm
        h2d = h.reshape(b * plen, width).contiguous()
        y = kernels.residual_norm(h2d, layers[0].norm1, eps=eps)
        for i, lw in enumerate(layers):
            self._enter("vlm", i)
            kv = (k_cache[i, :, :plen], v_cache[i, :, :plen])
            q = kernels.qkv_rope_into_cache(F.linear(y, lw.qkv), cos_half, sin_half, *kv, dims.num_heads, plen)
            if i == len(layers) - 1:
                break  # the last layer's attention output and MLP feed nothing we use
            attn = kernels.mqa_attention(q, *kv, key_bias, dims.num_heads, plen, splits=1)
            y = kernels.residual_norm(h2d, lw.norm2, delta=F.linear(attn.view(b * plen, -1), lw.o), eps=eps)
            down = F.linear(kernels.geglu(F.linear(y, lw.gate_up)), lw.down)
            y = kernels.residual_norm(h2d, layers[i + 1].norm1, delta=down, eps=eps)

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
        m, dims = self.model, self.expert_dims
        b, horizon, _ = x.shape
        h = F.linear(x, m.action_in_proj.weight, m.action_in_proj.bias).to(self.dtype)
        if self.use_triton and kernels.supported(dims):
            out = self._expert_triton(h, step, sched, geometry, k_cache, v_cache, plen)
        else:
            out = self._expert_torch(h, step, sched, geometry, k_cache, v_cache, plen)
        return F.linear(out.float(), m.action_out_proj.weight, m.action_out_proj.bias)

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
        eps, layers = dims.rms_norm_eps, len(self.w.expert)
        h2d = h.reshape(b * horizon, width).contiguous()
        y = kernels.residual_norm(h2d, sched.scale1p[step, 0, 0], sched.shift[step, 0, 0], eps=eps)
        for i, lw in enumerate(self.w.expert):
            tail = (k_cache[i, :, plen:plen + horizon], v_cache[i, :, plen:plen + horizon])
            q = kernels.qkv_rope_into_cache(y, cos_half, sin_half, *tail, dims.num_heads, horizon, w_qkv=lw.qkv)
            attn = kernels.mqa_attention(q, k_cache[i], v_cache[i], bias, dims.num_heads, horizon)
            y = kernels.linear_residual_norm(attn.view(b * horizon, -1), lw.o, h2d, sched.gate[step, i, 0],
                                             sched.scale1p[step, i, 1], sched.shift[step, i, 1], eps)
            act = kernels.geglu_linear(y, lw.gate_up)
            if i + 1 < layers:
                scale1p, shift = sched.scale1p[step, i + 1, 0], sched.shift[step, i + 1, 0]
            else:
                scale1p, shift = sched.final_scale1p[step], sched.final_shift[step]
            y = kernels.linear_residual_norm(act, lw.down, h2d, sched.gate[step, i, 1], scale1p, shift, eps)
        return y.view(b, horizon, width)

    def denoise(self, pad, noise, sched: TimeSchedule, k_cache, v_cache, rtc: "StaticRTC | None" = None):
        horizon = noise.shape[1]
        plen = pad.shape[1]
        geometry = self.action_geometry(pad, horizon, k_cache.shape[2])
        dt = -1.0 / len(sched.times)
        x = noise
        for step, t in enumerate(sched.times):
            v = self.velocity(x, step, sched, geometry, k_cache, v_cache, plen)
            if rtc is not None:
                error = (rtc.prev - (x - t * v)) * rtc.weights[..., None]
                v = v - rtc.guidance[step][:, None, None] * error
            x = x + dt * v
        return x


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

    @staticmethod
    def allocate(b: int, horizon: int, action_dim: int, steps: int, device) -> "StaticRTC":
        return StaticRTC(torch.zeros(b, horizon, action_dim, device=device), torch.zeros(b, horizon, device=device),
                         torch.zeros(steps, b, device=device))

    def fill(self, rtc: RTCGuidance, times: list[float]) -> None:
        self.prev.copy_(rtc.prev)
        self.weights.copy_(rtc.weights)
        self.guidance.copy_(torch.stack([rtc_guidance_weight(t, rtc.max_weight) for t in times]))


class _Graph:
    def __init__(self, fn, pool, stream: torch.cuda.Stream, capture_lock):
        # Warm up on a side stream (allocator + library handles), then capture. One stream per
        # engine: each new stream would get (and keep) its own cuBLAS workspace.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # The warm-up runs above (which compile the Triton kernels: the slow part) may overlap the
        # serving thread's eager calls; the capture itself holds the policy's device lock.
        with capture_lock, torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.output = fn()

    def replay(self):
        self.graph.replay()
        return self.output


class CudaGraphEngine:
    """Runs Policy batches through FastPi05 captured in CUDA graphs.

    Static buffers and graphs exist per (batch size, prompt length); a prompt length other than
    the checkpoint's comes only from opt-in prompt-length buckets. With a `layer_stream` (offload)
    the prefix runs the same kernels outside graphs, as its weights arrive layer by layer.
    """

    def __init__(self, model: Pi05Model, num_cameras: int, token_len: int, horizon: int,
                 use_graphs: bool = True, use_triton: bool = True, max_graph_batch: int | None = None,
                 capture_lock=None, layer_stream=None):
        self.fast = FastPi05(model, use_triton=use_triton, layer_stream=layer_stream)
        self.model = model
        self.device = model.action_in_proj.weight.device
        self.num_cameras, self.token_len, self.horizon = num_cameras, token_len, horizon
        self.use_graphs = use_graphs
        self.max_graph_batch = max_graph_batch  # larger batches run the same kernels without graphs
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._capture_stream = torch.cuda.Stream() if use_graphs else None
        self._capture_lock = capture_lock if capture_lock is not None else threading.RLock()
        self._buffers: dict[tuple, dict] = {}
        self._prefix_graphs: dict[tuple, _Graph] = {}
        self._denoise_graphs: dict[tuple, _Graph] = {}

    def prefix_len(self, token_len: int) -> int:
        return self.num_cameras * self.model.vision.dims.num_patches + token_len

    def buffers(self, b: int, token_len: int) -> dict:
        if (b, token_len) not in self._buffers:
            vis, d = self.model.vision.dims, self.fast.vlm_dims
            dev, res, layers = self.device, vis.image_size, len(self.fast.w.vlm)
            plen = self.prefix_len(token_len)
            total = -(-(plen + self.horizon) // 64) * 64  # attention kernels tile keys by 64
            self._buffers[(b, token_len)] = {
                "images": torch.zeros(b, self.num_cameras, 3, res, res, device=dev),
                "image_masks": torch.ones(b, self.num_cameras, dtype=torch.bool, device=dev),
                "tokens": torch.zeros(b, token_len, dtype=torch.long, device=dev),
                "token_mask": torch.ones(b, token_len, dtype=torch.bool, device=dev),
                "noise": torch.zeros(b, self.horizon, self.model.config.max_action_dim, device=dev),
                "k_cache": torch.zeros(layers, b, total, d.head_dim, dtype=self.fast.dtype, device=dev),
                "v_cache": torch.zeros(layers, b, total, d.head_dim, dtype=self.fast.dtype, device=dev),
                "pad": torch.ones(b, plen, dtype=torch.bool, device=dev),
                "rtc": {},
            }
        return self._buffers[(b, token_len)]

    def _run_prefix(self, buf, vision_slots: int):
        pad = self.fast.prefix(buf["images"], buf["image_masks"], buf["tokens"], buf["token_mask"],
                               buf["k_cache"], buf["v_cache"], vision_slots)
        buf["pad"].copy_(pad)
        return buf["pad"]

    def _run_denoise(self, buf, num_steps: int, rtc: StaticRTC | None):
        sched = self.fast.schedule(num_steps)
        return self.fast.denoise(buf["pad"], buf["noise"], sched, buf["k_cache"], buf["v_cache"], rtc)

    def _restore_prefix(self, buf, entries) -> None:
        plen = buf["pad"].shape[1]
        for i, e in enumerate(entries):
            buf["k_cache"][:, i, :plen] = e.k
            buf["v_cache"][:, i, :plen] = e.v
            buf["pad"][i] = e.pad

    @torch.no_grad()
    def sample(self, inputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None,
               prefix_cache=None, prefix_keys=None):
        b, token_len = inputs.tokens.shape
        buf = self.buffers(b, token_len)
        graphs = self.use_graphs and (self.max_graph_batch is None or b <= self.max_graph_batch)
        entries = [prefix_cache.get(k) for k in prefix_keys] if prefix_cache is not None else None
        hit = entries is not None and all(e is not None for e in entries)
        # Absent cameras sit in the last slots; slots absent from every item skip the vision tower.
        present = inputs.image_masks.any(0).tolist()
        vision_slots = len(present) - present[::-1].index(True) if any(present) else 0
        if not hit:
            buf["images"].copy_(inputs.images)
            buf["image_masks"].copy_(inputs.image_masks)
            buf["tokens"].copy_(inputs.tokens)
            buf["token_mask"].copy_(inputs.token_mask)
        buf["noise"].copy_(noise)
        static_rtc = None
        if rtc is not None:
            if num_steps not in buf["rtc"]:
                buf["rtc"][num_steps] = StaticRTC.allocate(b, self.horizon, noise.shape[2], num_steps, self.device)
            static_rtc = buf["rtc"][num_steps]
            static_rtc.fill(rtc, self.fast.schedule(num_steps).times)
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        started = time.perf_counter()
        start.record()
        if hit:
            self._restore_prefix(buf, entries)
        elif self.fast.layer_stream is not None:
            # The layer slots are shared with the eager model's calls during a background warm-up.
            with self._capture_lock:
                self._run_prefix(buf, vision_slots)
        elif graphs:
            key = (b, token_len, vision_slots)
            if key not in self._prefix_graphs:
                self._prefix_graphs[key] = _Graph(lambda: self._run_prefix(buf, vision_slots), self._pool,
                                                 self._capture_stream, self._capture_lock)
            self._prefix_graphs[key].replay()
        else:
            self._run_prefix(buf, vision_slots)
        mid.record()
        if graphs:
            key = (b, token_len, num_steps, static_rtc is not None)
            if key not in self._denoise_graphs:
                self.fast.schedule(num_steps)
                self._denoise_graphs[key] = _Graph(lambda: self._run_denoise(buf, num_steps, static_rtc), self._pool,
                                                 self._capture_stream, self._capture_lock)
            out = self._denoise_graphs[key].replay()
        else:
            out = self._run_denoise(buf, num_steps, static_rtc)
        end.record()
        if entries is not None and not hit:
            from .prefix_cache import PrefixEntry

            plen = buf["pad"].shape[1]
            for i, (key, e) in enumerate(zip(prefix_keys, entries)):
                if e is None:
                    prefix_cache.put(key, PrefixEntry(buf["k_cache"][:, i, :plen].clone(),
                                                      buf["v_cache"][:, i, :plen].clone(), buf["pad"][i].clone()))
        end.synchronize()
        return out.clone(), {"prefix_ms": start.elapsed_time(mid), "denoise_ms": mid.elapsed_time(end),
                             "host_ms": (time.perf_counter() - started) * 1e3}

    def warmup(self, batch_sizes=(1,), num_steps: int = 10) -> None:
        """Compiles the kernels and captures graphs ahead of the first request."""
        from ..policy import ModelInputs

        for b in batch_sizes:
            buf = self.buffers(b, self.token_len)
            inputs = ModelInputs(buf["images"], buf["image_masks"], buf["tokens"], buf["token_mask"])
            self.sample(inputs, torch.randn_like(buf["noise"]), num_steps, None)
