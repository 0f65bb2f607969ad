"""Policy: observation -> preprocess -> prefix -> denoise -> postprocess, with timings.

This is the only object the server talks to. It owns the model, the tokenizer and the
normalization statistics; the engine (CUDA graphs, caches) plugs in below `_sample`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import PolicyConfig, load_policy_config
from .errors import CheckpointError, InvalidObservation
from .files import check_weight_loader, checkpoint_files, resolve_checkpoint
from .memory import PROFILES, MemoryProfile, check_before_loading, get_profile
from .model.pi05 import Pi05Model, PrefixContext, RTCGuidance, rtc_prefix_weights
from .processing.images import bytes_to_model_range, empty_image, prepare_image
from .processing.layouts import KeyLayout  # [ckpt hook]
from .processing.normalize import Normalization
from .processing.pipeline import ProcessorPipeline  # [ckpt hook]
from .processing.prompt import PromptTokenizer, build_prompt, discretize_state, find_tokenizer
from .weights import build_model, load_weights, parameter_counts

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """'auto': bfloat16 on CUDA; float32 on the CPU, where bf16 matmuls are ~4x slower."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported (choose from auto, {', '.join(sorted(DTYPES))})")
    return dtype


RTC_DEFAULTS = {"inference_delay": 0, "execution_horizon": 10, "max_guidance_weight": 10.0, "schedule": "linear",
                "space": "model"}


@dataclass
class InferenceResult:
    actions: np.ndarray  # float32 [horizon, action_dim], un-normalized
    model_actions: np.ndarray  # float32 [horizon, max_action_dim], model space
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class PreparedObservation:
    """One observation after host preprocessing (what the model sees, plus how it got there)."""

    images: torch.Tensor  # [N, 3, S, S]: float32 in [-1, 1], or uint8 bytes; slots in the reference's order
    image_mask: torch.Tensor  # [N] bool
    slot_cameras: list[str]  # camera of each slot
    tokens: torch.Tensor  # [L] int64
    token_mask: torch.Tensor  # [L] bool
    normalized_state: np.ndarray
    state_bins: np.ndarray
    prompt: str
    truncated: bool
    raw_state: np.ndarray | None = None  # [ckpt hook] what relative actions are offset by


@dataclass
class ModelInputs:
    """A batch, ready for the model: plain tensors with the batch dimension first."""

    images: torch.Tensor  # [B, N, 3, S, S]
    image_masks: torch.Tensor  # [B, N]
    tokens: torch.Tensor  # [B, L]
    token_mask: torch.Tensor  # [B, L]

    def to(self, device) -> "ModelInputs":
        """Moves to `device`; uint8 images (kept as bytes by `prepare`) become [-1, 1] floats there."""
        images = self.images.to(device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = bytes_to_model_range(images)
        return ModelInputs(images, *(t.to(device, non_blocking=True) for t in
                                     (self.image_masks, self.tokens, self.token_mask)))


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device 'cuda' requested but no CUDA device is available (use --device cpu)")
    return device


class StageTimer:
    """Seconds per named stage, each measured from the end of the one before."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.stages: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages[stage], self.last = now - self.last, now

    def total(self) -> float:
        return time.perf_counter() - self.started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Policy:
    def __init__(self, model: Pi05Model, config: PolicyConfig, normalization: Normalization,
                 tokenizer: PromptTokenizer, device: torch.device, dtype: torch.dtype, name: str = "pi05",
                 checkpoint: str = "", is_demo: bool = False, pipeline: ProcessorPipeline | None = None):
        self.model, self.config, self.normalization = model.eval(), config, normalization
        # [ckpt hook] the checkpoint's processor steps and the observation key table
        self.pipeline = pipeline or ProcessorPipeline(normalization)
        self.layout = KeyLayout(config.cameras, rename_map=self.pipeline.rename_map)
        self.tokenizer, self.device, self.dtype = tokenizer, device, dtype
        self.state_norm = normalization.state.cut(config.state_dim)
        self.action_norm = normalization.action.cut(config.action_dim)
        self.name, self.checkpoint, self.is_demo = name, checkpoint, is_demo
        self.load_timings: dict = {}  # set by from_pretrained: seconds per stage, weight bytes, GB/s
        self.engine = None  # set by enable_fast_path (CUDA)
        self.device_lock = threading.RLock()
        self.prefix_cache = None  # set by enable_prefix_cache
        self.prompt_buckets: tuple[int, ...] | None = None  # set by set_prompt_buckets
        self.memory_profile = PROFILES["default"]  # set by use_memory_profile
        self.offload = None  # the LayerOffload streaming vision/VLM layers, under the offload profile

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, device: str = "auto", dtype: str = "auto",
                        tokenizer: str | Path | None = None, progress: bool = True,
                        fast_path: bool = True, memory_profile: str = "default", max_batch_size: int = 1,
                        memory_budget: int | None = None, warmup: str = "blocking",
                        weights_loader: str = "safetensors") -> "Policy":
        """Loads a LeRobot/OpenPI Pi0.5 checkpoint. On CUDA the graph-captured fast path is used
        unless `fast_path=False` (the eager model then runs, as on the CPU). `dtype` "auto":
        bfloat16 on CUDA, float32 on the CPU.

        `warmup` (CUDA fast path): "blocking" compiles the kernels and captures the batch-1 graphs
        before returning; "background" returns at once and serves with the eager model (same
        function, bf16 rounding differs) until the fast path is ready, which is what a restarting
        server wants: the first action comes back ~10 s sooner on a machine with cold caches.

        `memory_profile`: default, edge-16gb or offload (vlaserve.memory). Before any weight loads, the
        profile's estimated device memory for batches of up to `max_batch_size` is checked against
        what the process may use on CUDA (or against `memory_budget` bytes, on any device), and
        InsufficientMemory names the numbers and the profiles that would fit.

        `weights_loader`: safetensors (mmap) or runai-streamer (runai-model-streamer's parallel reads;
        same tensors bit for bit). `load_timings` then says where the time went."""
        timings = StageTimer()
        if warmup not in ("blocking", "background"):
            raise ValueError(f"warmup must be 'blocking' or 'background', not {warmup!r}")
        torch_device = resolve_device(device)
        dtype = resolve_dtype(dtype, torch_device)
        loader = check_weight_loader(weights_loader)
        directory = resolve_checkpoint(path_or_id)
        config = load_policy_config(directory)
        pipeline = ProcessorPipeline.load(directory, config)  # [ckpt hook]
        normalization = pipeline.normalization
        prompt_tokenizer = PromptTokenizer.from_path(find_tokenizer(directory, tokenizer))
        profile = get_profile(memory_profile)
        timings.mark("config_s")
        check_before_loading(directory, config, DTYPES[dtype], profile, torch_device, max_batch_size, memory_budget,
                             fast_path)
        timings.mark("device_s")  # CUDA initialization, mostly
        # Offload loads to the host: the streamed layers never touch the device as a whole.
        load_device = torch.device("cpu") if profile.offload else torch_device
        model = load_weights(build_model(config.model), directory, DTYPES[dtype], load_device, progress=progress,
                             loader=loader)
        _sync(load_device)
        timings.mark("weights_s")
        # A hub snapshot's directory is named after a commit: the hub id names the model better.
        name = str(path_or_id) if not Path(path_or_id).expanduser().is_dir() else directory.name
        policy = cls(model, config, normalization, prompt_tokenizer, torch_device, DTYPES[dtype],
                     name=name, checkpoint=str(directory), is_demo=config.is_demo, pipeline=pipeline)
        policy.use_memory_profile(profile, fast_path, background_warmup=warmup == "background")
        timings.mark("engine_s")
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Loaded to the host (offload), safetensors maps the files without reading them; the reading
        # happens while the layers are packed into pinned memory, in engine_s: no throughput to report.
        gb_per_s = None if load_device.type == "cpu" else weight_bytes / 1e9 / max(timings.stages["weights_s"], 1e-9)
        policy.load_timings = {**timings.stages, "total_s": timings.total(), "weights_loader": loader,
                               "weight_bytes": weight_bytes, "weights_gb_per_s": gb_per_s}
        return policy

    def use_memory_profile(self, profile: MemoryProfile, fast_path: bool = True,
                           background_warmup: bool = False) -> None:
        """Places the weights and picks the engine as `profile` says; on CUDA with `fast_path`, the
        graph engine (under offload too, its prefix streaming the layers), warmed up at batch 1."""
        self.memory_profile = profile
        if profile.offload:
            from .engine.offload import LayerOffload

            self.engine, self.offload = None, LayerOffload(self.model, self.device)
        if fast_path and self.device.type == "cuda":
            self.enable_fast_path(max_graph_batch=profile.max_graph_batch, background_warmup=background_warmup)

    def enable_fast_path(self, use_graphs: bool = True, use_triton: bool = True,
                         max_graph_batch: int | None = None, warmup: bool = True,
                         background_warmup: bool = False) -> None:
        """The CUDA engine: fused weights, Triton kernels for the expert steps, CUDA graphs.

        With `background_warmup`, kernels compile and batch-1 graphs are captured on a thread while
        calls keep running on the eager model; the engine takes over once it is ready."""
        from .engine.graphs import CudaGraphEngine

        if self.device.type != "cuda":
            raise ValueError("the fast path needs a CUDA device; the eager model serves on the CPU")
        c = self.config
        engine = CudaGraphEngine(self.model, num_cameras=len(c.cameras), token_len=c.max_token_len,
                                 horizon=c.action_horizon, use_graphs=use_graphs, use_triton=use_triton,
                                 max_graph_batch=max_graph_batch, capture_lock=self.device_lock,
                                 layer_stream=self.offload)
        if not warmup:
            self.engine = engine
        elif background_warmup:
            threading.Thread(target=self._warm_up_then_switch, args=(engine,), name="vlaserve-warmup",
                             daemon=True).start()
        else:
            engine.warmup((1,), c.num_inference_steps)
            self.engine = engine

    def _warm_up_then_switch(self, engine) -> None:
        started = time.perf_counter()
        try:
            engine.warmup((1,), self.config.num_inference_steps)
        except Exception:
            log.exception("fast path warm-up failed; serving continues with the eager model")
            return
        self.engine = engine
        log.info("fast path ready after %.1f s of background warm-up (kernels compiled, graphs captured)",
                 time.perf_counter() - started)

    def enable_prefix_cache(self, max_entries: int | None = None) -> None:
        """Opt-in exact prefix cache (see engine/prefix_cache.py); each entry holds one prefix's K/V.
        By default it holds as many entries as the memory profile allows."""
        from .engine.prefix_cache import PrefixCache

        if max_entries is None:
            max_entries = self.memory_profile.prefix_cache_entries

        revision = _checkpoint_revision(self.checkpoint)
        self.prefix_cache = PrefixCache(max_entries, f"{revision}|{self.dtype}|{self.device}")

    def set_prompt_buckets(self, buckets) -> None:
        """Opt-in: pad prompts only up to the smallest of these lengths that holds the batch's
        longest prompt, instead of to max_token_len. Padding is masked, so actions change only by
        float reassociation; the prefix shrinks (and each bucket gets its own CUDA graphs)."""
        if not buckets:
            self.prompt_buckets = None
            return
        buckets = sorted({int(b) for b in buckets} | {self.config.max_token_len})
        if buckets[0] < 1 or buckets[-1] > self.config.max_token_len:
            raise ValueError(f"prompt buckets must lie in [1, {self.config.max_token_len}]")
        self.prompt_buckets = tuple(buckets)

    @property
    def metadata(self) -> dict:
        c = self.config
        return {
            "model": self.name, "checkpoint": self.checkpoint, "is_demo": self.is_demo,
            "cameras": list(c.cameras), "state_dim": c.state_dim, "action_dim": c.action_dim,
            "action_horizon": c.action_horizon, "max_action_dim": c.model.max_action_dim,
            "max_token_len": c.max_token_len, "num_inference_steps": c.num_inference_steps,
            "image_resolution": list(c.image_resolution), "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device), "parameter_counts": parameter_counts(self.model),
            "normalization": self.normalization.source, "tokenizer": self.tokenizer.source,
            "fast_path": self.engine is not None, "memory_profile": self.memory_profile.name,
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats(),
            "prompt_buckets": None if self.prompt_buckets is None else list(self.prompt_buckets),
            "rename_map": self.pipeline.rename_map,  # [ckpt hook] the server's key table applies it
            "relative_actions": self.pipeline.relative_actions is not None,  # [ckpt hook]
        }

    # ---- preprocessing ------------------------------------------------------------------
    def check_observation(self, obs: dict) -> PreparedObservation:
        """Raises InvalidObservation naming the field at fault; returns the preprocessed observation,
        which infer/infer_batch accept in place of the dict."""
        return self.prepare(obs)

    def prepare(self, obs: dict) -> PreparedObservation:
        if not isinstance(obs, dict):
            raise InvalidObservation("observation", "expected a mapping with images, state and task")
        obs = self.layout.canonical(obs)  # [ckpt hook] LeRobot / OpenPI / ALOHA / DROID keys
        c = self.config
        images = obs.get("images")
        if not isinstance(images, dict) or not images:
            raise InvalidObservation("images", f"expected a mapping camera -> image for some of {list(c.cameras)}")
        unknown = [k for k in images if k not in c.cameras]
        if unknown:
            raise InvalidObservation(f"images.{unknown[0]}", f"unknown camera; this policy takes {list(c.cameras)}")
        task = obs.get("task")
        if not isinstance(task, str):
            raise InvalidObservation("task", "expected a string")

        state = _as_float_array(obs.get("state"), "state")
        if state.shape != (c.state_dim,):
            raise InvalidObservation("state", f"expected shape [{c.state_dim}], got {list(state.shape)}")

        resolution = c.image_resolution[0]
        normalized = bool(obs.get("images_normalized", False))
        present = [cam for cam in c.cameras if cam in images and images[cam] is not None]
        if not present:
            raise InvalidObservation("images", "at least one camera image is required")
        # The reference's slot order: present cameras in config order, then the absent ones.
        slot_cameras = present + [cam for cam in c.cameras if cam not in present]
        slots = [prepare_image(images[cam], resolution, f"images.{cam}", normalized, keep_bytes=True)
                 for cam in present]
        if all(s.dtype == torch.uint8 for s in slots):
            blank = torch.zeros_like(slots[0])  # byte 0 is -1 in the model's range, like empty_image
        else:
            slots = [bytes_to_model_range(s) if s.dtype == torch.uint8 else s for s in slots]
            blank = empty_image(resolution)
        slots += [blank] * (len(c.cameras) - len(present))
        image_mask = torch.tensor([cam in present for cam in slot_cameras])

        normalized_state = self.state_norm.normalize(state)
        bins = discretize_state(normalized_state)
        prompt = build_prompt(task, bins)
        tokenized = self.tokenizer(prompt, c.max_token_len)
        return PreparedObservation(
            images=torch.stack(slots), image_mask=image_mask, slot_cameras=slot_cameras,
            tokens=torch.from_numpy(tokenized.ids), token_mask=torch.from_numpy(tokenized.mask),
            normalized_state=normalized_state, state_bins=bins, prompt=prompt, truncated=tokenized.truncated,
            raw_state=state)  # [ckpt hook]

    def collate(self, prepared: list[PreparedObservation]) -> ModelInputs:
        images = [p.images for p in prepared]
        if len({im.dtype for im in images}) > 1:  # bytes and floats in one batch: floats for all
            images = [bytes_to_model_range(im) if im.dtype == torch.uint8 else im for im in images]
        return ModelInputs(images=torch.stack(images),
                           image_masks=torch.stack([p.image_mask for p in prepared]),
                           tokens=torch.stack([p.tokens for p in prepared]),
                           token_mask=torch.stack([p.token_mask for p in prepared]))

    def make_noise(self, noise, seed) -> torch.Tensor:
        shape = (self.config.action_horizon, self.config.model.max_action_dim)
        if noise is not None:
            arr = _as_float_array(noise, "noise")
            if arr.shape != shape:
                raise InvalidObservation("noise", f"expected shape {list(shape)}, got {list(arr.shape)}")
            return torch.from_numpy(arr)
        if seed is not None:
            if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
                raise InvalidObservation("seed", "expected an integer")
            return torch.randn(shape, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float32)
        return torch.randn(shape, dtype=torch.float32)

    def make_rtc(self, rtcs: list[dict | None]) -> RTCGuidance | None:
        if not any(r is not None for r in rtcs):
            return None
        h, a = self.config.action_horizon, self.config.model.max_action_dim
        prev = torch.zeros(len(rtcs), h, a)
        weights = torch.zeros(len(rtcs), h)
        max_weight = torch.zeros(len(rtcs))
        for i, rtc in enumerate(rtcs):
            if rtc is None:
                continue
            if not isinstance(rtc, dict):
                raise InvalidObservation("rtc", "expected a mapping")
            unknown = set(rtc) - set(RTC_DEFAULTS) - {"prev_chunk"}
            if unknown:
                raise InvalidObservation(f"rtc.{sorted(unknown)[0]}", "unknown RTC option")
            opts = {**RTC_DEFAULTS, **rtc}
            chunk = _as_float_array(rtc.get("prev_chunk"), "rtc.prev_chunk")
            if chunk.ndim != 2 or not 1 <= chunk.shape[0] <= h:
                raise InvalidObservation("rtc.prev_chunk", f"expected shape [T <= {h}, D], got {list(chunk.shape)}")
            if opts["space"] == "action" and self.pipeline.relative_actions is not None:  # [ckpt hook]
                raise InvalidObservation("rtc.space", "action-space chunks of a relative-actions checkpoint "
                                                      "need re-anchoring to the state; send model space")
            if opts["space"] == "action":
                if chunk.shape[1] != self.config.action_dim:
                    raise InvalidObservation("rtc.prev_chunk", f"action-space chunks have {self.config.action_dim} dims")
                chunk = self.action_norm.normalize(chunk)
            elif opts["space"] != "model":
                raise InvalidObservation("rtc.space", "expected 'model' or 'action'")
            if chunk.shape[1] > a:
                raise InvalidObservation("rtc.prev_chunk", f"at most {a} dims, got {chunk.shape[1]}")
            for key in ("inference_delay", "execution_horizon"):
                if not isinstance(opts[key], (int, np.integer)) or isinstance(opts[key], bool) or opts[key] < 0:
                    raise InvalidObservation(f"rtc.{key}", "expected a non-negative integer")
            w_max = opts["max_guidance_weight"]
            if not isinstance(w_max, (int, float)) or not math.isfinite(w_max) or w_max < 0:
                raise InvalidObservation("rtc.max_guidance_weight", "expected a finite non-negative number")
            try:
                weights[i] = rtc_prefix_weights(int(opts["inference_delay"]),
                                                min(int(opts["execution_horizon"]), chunk.shape[0]), h,
                                                str(opts["schedule"]).lower())
            except ValueError as e:
                raise InvalidObservation("rtc.schedule", str(e)) from None
            prev[i, : chunk.shape[0], : chunk.shape[1]] = torch.from_numpy(chunk)
            max_weight[i] = float(w_max)
        return RTCGuidance(prev.to(self.device), weights.to(self.device), max_weight.to(self.device))

    # ---- inference ----------------------------------------------------------------------
    def infer(self, obs: dict, noise=None, seed=None, num_steps: int | None = None,
              rtc: dict | None = None) -> InferenceResult:
        return self.infer_batch([obs], noise=None if noise is None else [noise],
                                seeds=None if seed is None else [seed], num_steps=num_steps,
                                rtcs=None if rtc is None else [rtc])[0]

    def infer_batch(self, observations: list[dict], noise=None, seeds=None, num_steps: int | None = None,
                    rtcs=None) -> list[InferenceResult]:
        started = time.perf_counter()
        n = len(observations)
        if n == 0:
            return []
        noise = _per_item(noise, n, "noise")
        seeds = _per_item(seeds, n, "seed")
        rtcs = _per_item(rtcs, n, "rtc")
        steps = self.config.num_inference_steps if num_steps is None else num_steps
        if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or not 1 <= steps <= 1000:
            raise InvalidObservation("num_steps", "expected an integer in [1, 1000]")

        prepared_obs = [o if isinstance(o, PreparedObservation) else self.prepare(o) for o in observations]
        inputs = self._bucketed(self.collate(prepared_obs))
        keys = None
        if self.prefix_cache is not None:
            keys = [self.prefix_cache.key(inputs.images[i], inputs.image_masks[i], inputs.tokens[i],
                                          inputs.token_mask[i]) for i in range(n)]
        x1 = torch.stack([self.make_noise(z, s) for z, s in zip(noise, seeds)])
        # Device work holds the lock a background warm-up takes while it captures a CUDA graph: a
        # capture fails if another thread touches the (legacy default) stream meanwhile.
        with self.device_lock:
            rtc = self.make_rtc(rtcs)
            inputs, x1 = inputs.to(self.device), x1.to(self.device)
            _sync(self.device)
            prepared = time.perf_counter()
            model_actions, stage_ms = self._sample(inputs, x1, int(steps), rtc, keys)
            post_start = time.perf_counter()
            model_np = model_actions.float().cpu().numpy()
        actions = self.action_norm.unnormalize(model_np[..., : self.config.action_dim])
        actions = self.pipeline.to_absolute(actions, np.stack([p.raw_state for p in prepared_obs]))  # [ckpt hook]
        finished = time.perf_counter()
        timings = {"preprocess_ms": (prepared - started) * 1e3, **stage_ms,
                   "postprocess_ms": (finished - post_start) * 1e3, "batch_size": n}
        return [InferenceResult(actions=actions[i], model_actions=model_np[i], timings=dict(timings))
                for i in range(n)]

    def _bucketed(self, inputs: ModelInputs) -> ModelInputs:
        if self.prompt_buckets is None:
            return inputs
        longest = int(inputs.token_mask.sum(1).max())
        length = next(b for b in self.prompt_buckets if b >= longest)
        return ModelInputs(inputs.images, inputs.image_masks, inputs.tokens[:, :length].contiguous(),
                           inputs.token_mask[:, :length].contiguous())

    @torch.no_grad()
    def _sample(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None,
                prefix_keys: list[bytes] | None = None):
        if self.engine is not None:
            return self.engine.sample(inputs, noise, num_steps, rtc, self.prefix_cache, prefix_keys)
        t0 = time.perf_counter()
        ctx = self._cached_prefix(inputs, prefix_keys)
        _sync(self.device)
        t1 = time.perf_counter()
        actions = self.model.denoise(ctx, noise, num_steps, rtc)
        _sync(self.device)
        t2 = time.perf_counter()
        return actions, {"prefix_ms": (t1 - t0) * 1e3, "denoise_ms": (t2 - t1) * 1e3}

    def compute_prefix(self, inputs: ModelInputs) -> PrefixContext:
        inputs = inputs.to(self.device)
        embs, pad_mask = self.model.embed_prefix(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)
        return self.model.compute_prefix(embs, pad_mask)

    def _cached_prefix(self, inputs: ModelInputs, keys: list[bytes] | None) -> PrefixContext:
        from .engine.prefix_cache import PrefixEntry

        if keys is None:
            return self.compute_prefix(inputs)
        entries = [self.prefix_cache.get(k) for k in keys]
        if all(e is not None for e in entries):
            kv = [(torch.stack([e.k[layer] for e in entries])[:, None], torch.stack([e.v[layer] for e in entries])[:, None])
                  for layer in range(len(entries[0].k))]
            pad = torch.stack([e.pad for e in entries])
            return PrefixContext(kv=kv, pad_mask=pad, num_valid=pad.long().sum(1))
        ctx = self.compute_prefix(inputs)
        for i, (key, entry) in enumerate(zip(keys, entries)):
            if entry is None:
                self.prefix_cache.put(key, PrefixEntry(torch.stack([k[i, 0] for k, _ in ctx.kv]),
                                                       torch.stack([v[i, 0] for _, v in ctx.kv]),
                                                       ctx.pad_mask[i].clone()))
        return ctx


def _checkpoint_revision(checkpoint: str) -> str:
    """Identifies the weights: their files' names, sizes and modification times."""
    directory = Path(checkpoint)
    files = checkpoint_files(directory) if directory.is_dir() else []
    return checkpoint + "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _per_item(values, n: int, field: str) -> list:
    if values is None:
        return [None] * n
    if len(values) != n:
        raise InvalidObservation(field, f"expected one entry per observation ({n}), got {len(values)}")
    return list(values)


def _as_float_array(value, field: str) -> np.ndarray:
    if value is None:
        raise InvalidObservation(field, "missing")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except Exception:
        raise InvalidObservation(field, "expected a numeric array") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise InvalidObservation(field, f"expected numbers, got {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise InvalidObservation(field, "contains NaN or inf")
    return arr
