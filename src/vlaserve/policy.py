"""Policy: the facade the server and Python callers use. It wires the pieces and owns none of
their logic: processing/ turns a Request into model inputs, runtime/ runs them on the device,
processing/ turns model actions back into the robot's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from .checkpoint.files import checkpoint_files
from .checkpoint.weights import check_weights, load_weights, materialize, parameter_counts
from .config import PolicyConfig, RuntimeConfig
from .demo import DEMO_IDS, find_checkpoint
from .errors import InvalidRequest
from .family import family_of, load_policy_config
from .precision import apply_precision
from .processing.layouts import KeyLayout
from .processing.pipeline import ProcessorPipeline
from .processing.prepare import Preprocessor
from .processing.prompt import PromptTokenizer, find_tokenizer
from .runtime.device import finish_queued, resolve_device, resolve_dtype
from .runtime.fast.precompile import hash_triton_ahead
from .runtime.fast.targets import require_fp8
from .runtime.memory import check_before_loading
from .runtime.runner import Runtime
from .startup.engine import captures_while_loading, start
from .types import InferenceResult, Observation, PreparedObservation, Request

log = logging.getLogger(__name__)


class Policy:
    def __init__(self, config: PolicyConfig, preprocessor: Preprocessor, runtime: Runtime, name: str,
                 checkpoint: str, parameter_counts: dict[str, int], load_timings: dict | None = None,
                 precision: dict | None = None):
        self.config, self.preprocessor, self.runtime = config, preprocessor, runtime
        self.name, self.checkpoint = name, checkpoint
        self.parameter_counts = parameter_counts
        self.layout = KeyLayout(config.cameras, rename_map=preprocessor.pipeline.rename_map)
        self.load_timings = load_timings or {}  # seconds per loading stage, weight bytes, GB/s
        self.precision = precision or {"precision": "bf16"}  # the fp8 gate's report (vlaserve.precision)

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, runtime: RuntimeConfig | None = None, progress: bool = True,
                        **options) -> "Policy":
        """Loads a LeRobot/OpenPI Pi0.5 or LeRobot Pi0 checkpoint (a directory, a hub id, or a built-in
        DEMO: "demo" or "demo-pi05", "demo-pi0"; tiny, random weights) as `runtime` says; keyword
        `options` override its fields (e.g. device="cuda", prefix_cache=16). On CUDA the fast path
        serves unless fast_path=False; `warmup` "blocking" returns once every CUDA graph is captured,
        "background" at once (batches wait for batch 1's graphs, then run on the captured ones while
        the rest are captured: Runtime). Before any weight loads, the memory profile's estimate
        is checked against the device (InsufficientMemory names the numbers and what would fit)."""
        settings = replace(runtime or RuntimeConfig(), **options)
        started = last = time.perf_counter()
        stages: dict[str, float] = {}

        def mark(stage: str) -> None:
            nonlocal last
            now = time.perf_counter()
            stages[stage], last = now - last, now

        device = resolve_device(settings.device)
        if settings.precision != "bf16":
            require_fp8(device, settings.precision)  # before anything is read or loaded
        dtype = resolve_dtype(settings.dtype, device)
        directory = find_checkpoint(path_or_id)
        config = load_policy_config(directory)
        settings = replace(settings, prompt_buckets=settings.resolved_prompt_buckets(config.max_token_len, device.type))
        family = family_of(config)
        pipeline = ProcessorPipeline.load(directory, config)
        tokenizer = PromptTokenizer.from_path(find_tokenizer(directory, settings.tokenizer, pipeline.tokenizer_name))
        preprocessor = Preprocessor(config, pipeline, tokenizer, family, settings.prompt_buckets,
                                    defer_resize=device.type == "cuda")
        mark("config_s")
        check_before_loading(directory, config, dtype, settings, device)
        mark("device_s")  # CUDA initialization, mostly
        if settings.runs_fast_path(device.type):
            hash_triton_ahead()  # while the weights load: off the first warm-up's path
        # Offload loads to the host: the streamed layers never touch the device as a whole.
        load_device = resolve_device("cpu") if settings.profile.offload else device
        model, revision = family.build_model(config).eval(), _checkpoint_revision(directory)
        layout = KeyLayout(config.cameras, rename_map=pipeline.rename_map)

        # Names and shapes checked against the checkpoint's headers before anything is allocated, compiled or read.
        sources = check_weights(model, directory, family.weights)

        def load() -> None:
            load_weights(model, directory, dtype, load_device, progress=progress, loader=settings.weights_loader,
                         layout=family.weights, sources=sources)
            finish_queued(load_device)  # the copies' casts, queued behind the copy stream (graphs may be recording)
            mark("weights_s")

        early = captures_while_loading(settings, device)
        if early:
            # The engine first, on parameters not loaded yet: the graphs serving waits for are compiled and captured
            # while the weights arrive (the graphs read them where they land), and serving waits for them.
            runtime = Runtime(materialize(model, dtype, device, family.weights), config, settings, device, dtype,
                              revision)
            startup = start(runtime, progress=progress, weights_pending=True)
            mark("engine_s")
            try:
                load()
            except BaseException as e:
                startup.weights_failed(e)  # its capture thread stops
                raise
            startup.weights_loaded()
            precision = apply_precision(model, directory, config, preprocessor, layout, load_device, settings)
            mark("precision_s")
        else:
            load()
            precision = apply_precision(model, directory, config, preprocessor, layout, load_device, settings)
            mark("precision_s")
            runtime = Runtime(model, config, settings, device, dtype, revision)
            start(runtime, progress=progress)
            mark("engine_s")
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Loaded to the host (offload, a CPU device) the stage is host copies, no transfer: no throughput to report.
        rate = None if load_device.type == "cpu" else weight_bytes / 1e9 / max(stages["weights_s"], 1e-9)
        # A hub snapshot's directory is named after a commit: the hub id names the model better.
        hub = not Path(path_or_id).expanduser().is_dir() and str(path_or_id) not in DEMO_IDS
        name = str(path_or_id) if hub else directory.name
        timings = {**stages, "total_s": time.perf_counter() - started, "weights_loader": settings.weights_loader,
                   "captured_while_loading": early,
                   "weight_bytes": weight_bytes, "weights_gb_per_s": rate}
        return cls(config, preprocessor, runtime, name, str(directory), parameter_counts(model), timings, precision)

    @property
    def model(self):
        """The eager reference model (the fast path computes the same function on its weights)."""
        return self.runtime.model

    @property
    def metadata(self) -> dict:
        """What the policy is and how it serves right now (fast path, cache stats, readiness are live)."""
        c, r = self.config, self.runtime
        return {
            "model": self.name, "checkpoint": self.checkpoint, "hub_id": c.hub_id, "is_demo": c.is_demo,
            "policy_type": c.policy_type,
            "cameras": list(c.cameras), "state_dim": c.state_dim, "action_dim": c.action_dim,
            "action_horizon": c.action_horizon, "max_action_dim": c.model.max_action_dim,
            "max_token_len": c.max_token_len, "num_inference_steps": c.num_inference_steps,
            "image_resolution": list(c.image_resolution), "dtype": str(r.dtype).removeprefix("torch."),
            "device": str(r.device), "parameter_counts": self.parameter_counts,
            "normalization": self.preprocessor.normalization.source, "tokenizer": self.preprocessor.tokenizer.source,
            "memory_profile": r.settings.memory_profile, "max_batch_size": r.settings.batch_limit,
            "batch_invariant": r.settings.batch_invariant,
            "prompt_buckets": list(self.preprocessor.prompt_buckets) or None,
            "rename_map": self.preprocessor.pipeline.rename_map,
            "relative_actions": self.preprocessor.pipeline.relative_actions is not None, "precision": self.precision,
            **r.stats(),
        }

    # ---- the Python API ----------------------------------------------------------------------
    def request(self, obs: dict, noise=None, seed=None, num_steps=None, rtc=None) -> Request:
        """A Request from an observation in any layout the server takes ({"images": {camera: image},
        "state", "task"}, LeRobot's or OpenPI's keys; processing/layouts.py), its values checked."""
        if not isinstance(obs, dict):
            raise InvalidRequest("observation", "expected a mapping with images, state and task")
        canonical = self.layout.canonical(obs)
        observation = Observation.create(canonical["images"], canonical.get("state"), canonical.get("task"),
                                         canonical.get("images_normalized", False))
        return Request.create(observation, canonical.get("noise") if noise is None else noise, seed, num_steps, rtc,
                              default_steps=self.config.num_inference_steps)

    def prepare(self, request: Request | dict) -> PreparedObservation:
        """Validates against this checkpoint and preprocesses; raises InvalidInput naming the field."""
        return self.preprocessor.prepare(request if isinstance(request, Request) else self.request(request))

    def is_light(self, request: Request) -> bool:
        """Whether `prepare(request)` is cheap enough to run where latency matters (raw frames: no
        decode, no host resize)."""
        return self.preprocessor.is_light(request)

    def infer(self, obs: dict, noise=None, seed=None, num_steps: int | None = None,
              rtc: dict | None = None) -> InferenceResult:
        return self.run([self.request(obs, noise, seed, num_steps, rtc)])[0]

    def infer_batch(self, observations: list[dict], noise=None, seeds=None, num_steps: int | None = None,
                    rtcs=None) -> list[InferenceResult]:
        n = len(observations)
        per_item = {}
        for field, values in (("noise", noise), ("seed", seeds), ("rtc", rtcs)):
            if values is not None and len(values) != n:
                raise InvalidRequest(field, f"expected one entry per observation ({n}), got {len(values)}")
            per_item[field] = [None] * n if values is None else list(values)
        return self.run([self.request(o, z, s, num_steps, r)
                         for o, z, s, r in zip(observations, per_item["noise"], per_item["seed"], per_item["rtc"])])

    def run(self, requests: list[Request]) -> list[InferenceResult]:
        """Runs requests of one step count together."""
        return self.launch(requests).finish() if requests else []

    def launch(self, requests: list[Request]) -> "LaunchedBatch":
        """Collates requests of one step count and enqueues them on the device without waiting (the
        batcher's call: it enqueues the next batch while this one runs); `finish()` waits for them."""
        steps = {r.num_steps for r in requests}
        if len(steps) != 1:
            raise InvalidRequest("num_steps", "requests of one batch must share the step count")
        if len({r.cuda_graph for r in requests}) != 1:
            raise InvalidRequest("cuda_graph", "requests of one batch must all use graphs or none")
        started = time.perf_counter()
        inputs, noise, rtc = self.preprocessor.collate(requests)
        prepared = time.perf_counter()
        launched = self.runtime.enqueue(inputs, noise, steps.pop(), rtc, [r.prefix_cache for r in requests],
                                       requests[0].cuda_graph)
        return LaunchedBatch(self, requests, launched, (prepared - started) * 1e3)


class LaunchedBatch:
    """A batch on its way through the device; `finish` waits for it and post-processes."""

    def __init__(self, policy: Policy, requests: list[Request], launched, preprocess_ms: float):
        self.policy, self.requests, self.launched, self.preprocess_ms = policy, requests, launched, preprocess_ms

    def done(self) -> bool:
        return self.launched.done()

    def finish(self) -> list[InferenceResult]:
        model_np, stages = self.launched.wait()
        post_start = time.perf_counter()
        actions = self.policy.preprocessor.postprocess(model_np, self.requests)
        timings = {"preprocess_ms": self.preprocess_ms, **stages, "device_ms": stages["prefix_ms"] + stages["denoise_ms"],
                   "postprocess_ms": (time.perf_counter() - post_start) * 1e3, "batch_size": len(self.requests)}
        return [InferenceResult(actions[i], model_np[i], dict(timings), self._warnings(r.prepared))
                for i, r in enumerate(self.requests)]

    def _warnings(self, prepared: PreparedObservation) -> list[str]:
        if prepared.truncated:
            return [f"the prompt was cut at max_token_len tokens: its end "
                    f"({self.policy.preprocessor.family.prompt_end}) is missing"]
        return []


def _checkpoint_revision(directory: Path) -> str:
    """Identifies the weights: their files' names, sizes and modification times."""
    files = checkpoint_files(directory) if directory.is_dir() else []
    return str(directory) + "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)

