"""Policy: the facade the server and Python callers use. It wires the pieces and owns none of
their logic: processing/ turns a Request into model inputs, runtime/ runs them on the device,
processing/ turns model actions back into the robot's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from .checkpoint.files import checkpoint_files
from .checkpoint.update import read_tensors, stored_dtypes
from .checkpoint.weights import check_weights, load_weights, materialize, parameter_counts
from .config import PolicyConfig, RuntimeConfig
from .demo import DEMO_IDS, find_checkpoint
from .errors import InvalidRequest, WeightUpdateRefused
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
from .updates import check_compatible, find_update, refuse_unless_swappable

log = logging.getLogger(__name__)


class Policy:
    def __init__(self, config: PolicyConfig, preprocessor: Preprocessor, runtime: Runtime, name: str,
                 checkpoint: str, parameter_counts: dict[str, int], load_timings: dict | None = None,
                 precision: dict | None = None, stored_dtypes: dict | None = None):
        self.config, self.preprocessor, self.runtime = config, preprocessor, runtime
        self.name, self.checkpoint = name, checkpoint
        self.parameter_counts = parameter_counts
        self.layout = KeyLayout(config.cameras, rename_map=preprocessor.pipeline.rename_map)
        self.load_timings = load_timings or {}  # seconds per loading stage, weight bytes, GB/s
        self.precision = precision or {"precision": "bf16"}  # the fp8 gate's report (vlaserve.precision)
        # Weight updates in place (update_weights): the dtype each tensor is stored in, which a new checkpoint
        # must keep; the version served (0: the weights loaded at start, +1 per update).
        self.stored_dtypes = stored_dtypes or {}
        self.weight_version = 0
        # Held around a batch's preparation and enqueue, and around a swap: a batch's weights and statistics are
        # one version's.
        self._serving = threading.Lock()
        self._updating = threading.Lock()  # one update at a time

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
        dtypes = stored_dtypes(sources)

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
        return cls(config, preprocessor, runtime, name, str(directory), parameter_counts(model), timings, precision,
                   dtypes)

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
            "weight_version": self.weight_version,
            **r.stats(),
        }

    # ---- the Python API ----------------------------------------------------------------------
    def request(self, obs: dict, noise=None, seed=None, num_steps=None, rtc=None, *, return_noise: bool = False,
                return_trace: bool = False) -> Request:
        """A Request from an observation in any layout the server takes ({"images": {camera: image},
        "state", "task"}, LeRobot's or OpenPI's keys; processing/layouts.py), its values checked."""
        if not isinstance(obs, dict):
            raise InvalidRequest("observation", "expected a mapping with images, state and task")
        canonical = self.layout.canonical(obs)
        observation = Observation.create(canonical["images"], canonical.get("state"), canonical.get("task"),
                                         canonical.get("images_normalized", False))
        return Request.create(observation, canonical.get("noise") if noise is None else noise, seed, num_steps, rtc,
                              default_steps=self.config.num_inference_steps, return_noise=return_noise,
                              return_trace=return_trace)

    def prepare(self, request: Request | dict) -> PreparedObservation:
        """Validates against this checkpoint and preprocesses; raises InvalidInput naming the field."""
        return self.preprocessor.prepare(request if isinstance(request, Request) else self.request(request))

    def is_light(self, request: Request) -> bool:
        """Whether `prepare(request)` is cheap enough to run where latency matters (raw frames: no
        decode, no host resize)."""
        return self.preprocessor.is_light(request)

    def infer(self, obs: dict, noise=None, seed=None, num_steps: int | None = None, rtc: dict | None = None, *,
              return_noise: bool = False, return_trace: bool = False) -> InferenceResult:
        """One action chunk. `seed` seeds the noise (docs/server.md#reproducible-runs) when none is given;
        `return_noise` / `return_trace`: the result's `noise` / `trace` (InferenceResult)."""
        return self.run([self.request(obs, noise, seed, num_steps, rtc, return_noise=return_noise,
                                      return_trace=return_trace)])[0]

    def infer_batch(self, observations: list[dict], noise=None, seeds=None, num_steps: int | None = None,
                    rtcs=None, *, return_noise: bool = False, return_trace: bool = False) -> list[InferenceResult]:
        """`infer` for several observations at once: `noise`, `seeds` and `rtcs`, if given, one per
        observation (item i's noise is a function of seeds[i] alone)."""
        n = len(observations)
        per_item = {}
        for field, values in (("noise", noise), ("seed", seeds), ("rtc", rtcs)):
            if values is not None and len(values) != n:
                raise InvalidRequest(field, f"expected one entry per observation ({n}), got {len(values)}")
            per_item[field] = [None] * n if values is None else list(values)
        return self.run([self.request(o, z, s, num_steps, r, return_noise=return_noise, return_trace=return_trace)
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
        if len({r.graphs for r in requests}) != 1:
            raise InvalidRequest("cuda_graph", "requests of one batch must all use graphs or none")
        started = time.perf_counter()
        with self._serving:  # (a request prepared before a weight update is prepared again here)
            preprocessor = self.preprocessor
            inputs, noise, rtc = preprocessor.collate(requests)
            prepared = time.perf_counter()
            launched = self.runtime.enqueue(inputs, noise, steps.pop(), rtc, [r.prefix_cache for r in requests],
                                           requests[0].graphs, trace=any(r.return_trace for r in requests))
        return LaunchedBatch(self, preprocessor, requests, launched, (prepared - started) * 1e3)

    def update_weights(self, path_or_id: str) -> dict:
        """Loads a checkpoint of the served family and architecture into the served parameters in place, its
        normalization statistics with them (SGLang's update_weights_from_disk). Everything is checked, and every
        tensor read and staged beside the served ones, while batches go on; then, between two batches, the
        weights are copied in and the statistics replaced: batches enqueued before run on the old version,
        batches after on the new, none on a mix. The fast path's graphs stay valid (they read the parameters in
        place; what they derived is computed again), and the prefix cache is emptied. -> {"weight_version",
        "checkpoint", "read_ms": checks, reads and staging, "wait_ms": for the batch being launched, "swap_ms":
        batches held back, "load_ms": all}.
        Raises WeightUpdateRefused (nothing changed) naming the reason."""
        if not self._updating.acquire(blocking=False):
            raise WeightUpdateRefused("busy", "another weight update is running; send this one when it has answered")
        try:
            started = time.perf_counter()
            refuse_unless_swappable(self)
            directory = find_update(path_or_id)
            pipeline, sources = check_compatible(self, directory)
            staged = self.runtime.stage_weights(read_tensors(sources))
            old, version = self.preprocessor, self.weight_version + 1
            preprocessor = Preprocessor(self.config, pipeline, old.tokenizer, old.family,
                                        self.runtime.settings.prompt_buckets, old.defer_resize, weight_version=version)
            read = time.perf_counter()
            with self._serving:  # (after the batch being prepared or enqueued: on a CPU, its whole run)
                locked = time.perf_counter()
                self.runtime.swap_weights(staged)
                self.preprocessor, self.weight_version, self.checkpoint = preprocessor, version, str(directory)
            swapped = time.perf_counter()
            finish_queued(self.runtime.device)  # the copies done (behind the batch in flight)
            del staged
            done = time.perf_counter()
        finally:
            self._updating.release()
        log.info("weights updated to version %d from %s: read in %.2f s, batches held back %.1f ms, %.2f s in all",
                 self.weight_version, directory, read - started, (swapped - locked) * 1e3, done - started)
        return {"weight_version": self.weight_version, "checkpoint": str(directory), "read_ms": (read - started) * 1e3,
                "wait_ms": (locked - read) * 1e3, "swap_ms": (swapped - locked) * 1e3, "load_ms": (done - started) * 1e3}


class LaunchedBatch:
    """A batch on its way through the device; `finish` waits for it and post-processes."""

    def __init__(self, policy: Policy, preprocessor: Preprocessor, requests: list[Request], launched,
                 preprocess_ms: float):
        self.policy, self.requests, self.launched, self.preprocess_ms = policy, requests, launched, preprocess_ms
        self.preprocessor = preprocessor  # whose statistics prepared it: they un-normalize its actions

    def done(self) -> bool:
        return self.launched.done()

    def finish(self) -> list[InferenceResult]:
        model_np, stages = self.launched.wait()
        post_start = time.perf_counter()
        actions = self.preprocessor.postprocess(model_np, self.requests)
        timings = {"preprocess_ms": self.preprocess_ms, **stages, "device_ms": stages["prefix_ms"] + stages["denoise_ms"],
                   "postprocess_ms": (time.perf_counter() - post_start) * 1e3, "batch_size": len(self.requests)}
        trace = self.launched.trace
        return [InferenceResult(actions[i], model_np[i], dict(timings), self._warnings(r.prepared),
                                noise=r.prepared.noise.numpy().copy() if r.return_noise else None,
                                trace=trace[i] if r.return_trace else None)
                for i, r in enumerate(self.requests)]

    def _warnings(self, prepared: PreparedObservation) -> list[str]:
        if prepared.truncated:
            return [f"the prompt was cut at max_token_len tokens: its end "
                    f"({self.preprocessor.family.prompt_end}) is missing"]
        return []


def _checkpoint_revision(directory: Path) -> str:
    """Identifies the weights: their files' names, sizes and modification times."""
    files = checkpoint_files(directory) if directory.is_dir() else []
    return str(directory) + "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)

