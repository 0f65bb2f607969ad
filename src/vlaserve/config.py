"""What a policy is and how it is served, as plain dataclasses: the model's dimensions and the
policy's settings (read from a checkpoint by vlaserve.family.load_policy_config), and RuntimeConfig,
the serving options, validated once here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace

from .checkpoint.files import WEIGHT_LOADERS
from .errors import ConfigError


@dataclass(frozen=True)
class GemmaDims:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 257152
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class VisionDims:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    head_dim: int
    patch_size: int = 14
    image_size: int = 224
    layer_norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


GEMMA_VARIANTS = {
    "gemma_2b": GemmaDims(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256),
    "gemma_300m": GemmaDims(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
}
SIGLIP_SO400M_14 = VisionDims(width=1152, depth=27, mlp_dim=4304, num_heads=16, head_dim=72)


@dataclass(frozen=True)
class ModelConfig:
    vision: VisionDims
    vlm: GemmaDims
    expert: GemmaDims
    max_action_dim: int = 32
    chunk_size: int = 50
    time_min_period: float = 4e-3
    time_max_period: float = 4.0

    @staticmethod
    def full_size() -> "ModelConfig":
        """Pi0.5 as released: SigLIP So400m/14, Gemma-2B prefix, Gemma-300M action expert."""
        return ModelConfig(SIGLIP_SO400M_14, GEMMA_VARIANTS["gemma_2b"], GEMMA_VARIANTS["gemma_300m"])


@dataclass(frozen=True)
class PolicyConfig:
    model: ModelConfig
    cameras: tuple[str, ...]
    state_dim: int
    action_dim: int
    num_inference_steps: int = 10
    max_token_len: int = 200
    image_resolution: tuple[int, int] = (224, 224)
    is_demo: bool = False  # architecture.json says "demo": true (the embedded random-weight demo)
    policy_type: str = "pi05"  # config.json's type: the policy family (vlaserve.family)
    max_state_dim: int = 32  # Pi0: the state token's input width (the normalized state is zero-padded to it)
    hub_id: str | None = None  # the hub id the checkpoint records (config.json's repo_id, or its hub cache folder)

    @property
    def action_horizon(self) -> int:
        return self.model.chunk_size

    @property
    def prefix_len(self) -> int:
        """Image tokens of every camera slot, then the prompt's tokens."""
        return len(self.cameras) * self.model.vision.num_patches + self.max_token_len

    def with_model(self, model: ModelConfig) -> "PolicyConfig":
        return replace(self, model=model)


@dataclass(frozen=True)
class MemoryProfile:
    name: str
    summary: str
    offload: bool = False  # vision + VLM layer matrices in pinned host memory, streamed per call
    max_graph_batch: int | None = None  # largest batch with CUDA graphs, and the server's batch cap; None: no bound
    prefix_cache_entries: int = 64  # the prefix cache's default size (one prefix's K/V per entry)

    def batch_limit(self, max_batch_size: int) -> int:
        """The largest batch that runs: max_batch_size, capped by max_graph_batch. The one place the
        cap is computed; the batcher, the CUDA graphs and the memory estimate all read it (through
        RuntimeConfig.batch_limit when serving)."""
        return max_batch_size if self.max_graph_batch is None else min(max_batch_size, self.max_graph_batch)


PROFILES = {p.name: p for p in (
    MemoryProfile("default", "all weights resident; CUDA graphs and buffers for every batch size"),
    # Full size, a prefix cache entry is ~18 MB: 64 entries ~1.1 GiB, 16 ~0.28 GiB, 8 ~0.14 GiB.
    MemoryProfile("edge-16gb", "all weights resident; CUDA graphs and server batches of at most 4, "
                               "a smaller prefix cache", max_graph_batch=4, prefix_cache_entries=16),
    MemoryProfile("offload", "vision tower and VLM layer matrices in pinned host memory, streamed layer by "
                             "layer each call; expert, embeddings, projections and norms resident",
                  offload=True, prefix_cache_entries=8),
)}

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DTYPE_NAMES = ("auto", "bfloat16", "float32")
WARMUP_MODES = ("blocking", "background")
GRAPH_BATCHES = ("all", "ladder")
GEMM_LIBRARIES = ("cublas", "quack")
ATTENTION_LIBRARIES = ("triton", "fa4")
PRECISIONS = ("bf16", "fp8", "fp8+expert")
PRECISION_GATES = ("enforce", "warn")


def graph_batch_sizes(mode: str, limit: int) -> tuple[int, ...]:
    """The batch sizes whose CUDA graphs are captured at startup: every size up to `limit` ("all"),
    or powers of two and `limit` itself ("ladder"; a batch then runs padded to the next size)."""
    if mode == "all":
        return tuple(range(1, limit + 1))
    return tuple(sorted({1 << i for i in range(limit.bit_length()) if 1 << i < limit} | {limit}))


def prompt_lengths(buckets: tuple[int, ...], max_token_len: int) -> tuple[int, ...]:
    """Every length prompts are padded to, ascending: the prompt buckets and the checkpoint's own."""
    return tuple(sorted({*buckets, max_token_len}))


def _option(default, metavar: str | None, help: str, flag: bool = True):
    """A RuntimeConfig field that is a --config key and, unless `flag` is False, also a `vlaserve serve`
    option (the fp8 gate's inputs are read from the config file only: the command line stays short)."""
    return field(default=default, metadata={"metavar": metavar, "help": help, "flag": flag})


@dataclass(frozen=True)
class RuntimeConfig:
    """How a checkpoint is served: where, in which dtype, with which engine and caches. Validated
    once, here; `vlaserve serve`'s options and --config keys are these fields."""

    device: str = _option("auto", "DEVICE", "auto, cpu, cuda or cuda:N (auto: cuda when available)")
    dtype: str = _option("auto", "DTYPE", "auto, bfloat16 or float32 (auto: bfloat16 on CUDA, float32 on a CPU)")
    max_batch_size: int = _option(8, "N", "most observations run in one batch (memory is checked for it)")
    memory_profile: str = _option("default", "PROFILE", "default, edge-16gb or offload: where the weights live, "
                                                        "what the engine keeps (docs/memory.md)")
    warmup: str = _option("background", "MODE", "CUDA: background (ready once batch 1's first CUDA graphs are "
                                                "captured, the rest captured while serving) or blocking (ready "
                                                "once every one is)")
    weights_loader: str = _option("safetensors", "LOADER", "safetensors (mmap, read ahead while starting) or "
                                                           "runai-streamer (pip install -e '.[runai]')", flag=False)
    prefix_cache: int = _option(0, "N", "keep the prefix K/V of the last N distinct observations (exact; 0: off)")
    prompt_buckets: tuple[int, ...] | str = _option(
        "auto", "L1,L2", "pad prompts only to the smallest of these token lengths that fits, as 48,96; auto: on "
                         "CUDA's fast path half the checkpoint's prompt length, else none; none: always the "
                         "checkpoint's length (speed; docs/gpu.md)", flag=False)
    tokenizer: str | None = _option(None, "PATH", "tokenizer directory or file, when the checkpoint has none")
    graph_batches: str = _option("all", "SIZES", "CUDA graphs captured at startup: all (every batch size up to "
                                                 "the limit) or ladder (1, 2, 4, 8: other sizes run padded to the "
                                                 "next; less graph memory)")
    gemm_library: str = _option("cublas", "LIBRARY", "CUDA, batch 2 and up: cublas, or quack (CuTe DSL) for the prefix's "
                                                      "and SigLIP's GEMMs where it is faster, with their GeGLU / GELU in "
                                                      "the epilogue: the same bits (Hopper+, pip install -e '.[cute]'; "
                                                      "docs/gpu.md)")
    attention_library: str = _option("triton", "LIBRARY", "CUDA: the prefix's attention through triton (ours), or fa4 "
                                                           "(FlashAttention-4, CuTe DSL; faster from batch 1, most at 8; "
                                                           "Hopper+, pip install -e '.[cute]'; docs/gpu.md)")
    capture_while_loading: bool = _option(True, None, "compile and capture batch 1's first CUDA graphs while the "
                                          "weights load (CUDA, background warm-up, bf16 precision: the engine starts "
                                          "on parameters not filled yet; serving waits for both)", flag=False)
    compile_cache: str | None = _option(None, "DIR", "CUDA: keep compiled kernels here between starts, in a "
                                                     "subdirectory per GPU and CUDA, torch, Triton and vlaserve "
                                                     "version (default: $TRITON_CACHE_DIR if set, else "
                                                     "$XDG_CACHE_HOME/vlaserve/compile or ~/.cache/vlaserve/compile)")
    precision: str = _option("bf16", "MODE", "bf16 (the serving dtype: exact), fp8 (SigLIP's and the Gemma prefix's "
                                             "linear layers in e4m3, gated at startup: docs/gpu.md) or fp8+expert "
                                             "(the action expert's too)")
    precision_gate: str = _option("enforce", "MODE", "fp8: enforce (refuse to start when the accuracy gate fails) "
                                                     "or warn (log the failing figures and serve)", flag=False)
    precision_scales: str | None = _option(None, "FILE", "fp8: static activation scales from `vlaserve calibrate` "
                                                         "(default: per-token scales, no calibration)", flag=False)
    precision_observations: str | None = _option(None, "DIR", "fp8: the gate's held-out observations, one .npz per "
                                                              "observation (default: synthetic ones)", flag=False)
    gripper_dims: tuple[int, ...] | str = _option((), "I,J", "action dimensions that are grippers: the fp8 gate "
                                                             "refuses any sign disagreement on them", flag=False)
    action_groups: tuple | str = _option((), "NAME=I-J;...", "action groups the fp8 gate checks one by one, "
                                                             "as arm=0-5;gripper=6", flag=False)
    batch_invariant: bool = _option(False, None, "compute each observation's actions bit-identically at every batch "
                                                 "size and batch position (CUDA: fixed-order kernels, slower; "
                                                 "prompts padded to the checkpoint's length; docs/server.md)")
    fast_path: bool = True  # CUDA: fused weights, Triton kernels, CUDA graphs (False: the eager model)
    memory_budget_bytes: int | None = None  # check the fit against this instead of the free device memory

    def __post_init__(self):
        buckets = self.prompt_buckets
        word = buckets.strip().lower() if isinstance(buckets, str) else None
        if word in ("auto", "none"):
            buckets = "auto" if word == "auto" else ()
        elif word is not None:
            if buckets.strip() and not all(b.strip().isdigit() for b in buckets.split(",")):
                raise ConfigError("prompt_buckets must be auto, none or comma-separated token lengths, e.g. 48,96")
            buckets = [int(b) for b in buckets.split(",") if b.strip()]
        if buckets != "auto":
            buckets = tuple(sorted({int(b) for b in buckets or ()}))
        object.__setattr__(self, "prompt_buckets", buckets)
        object.__setattr__(self, "gripper_dims", _dims(self.gripper_dims, "gripper_dims"))
        object.__setattr__(self, "action_groups", _groups(self.action_groups))
        checks = [
            (DEVICE_PATTERN.match(str(self.device)), f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}"),
            (self.dtype in DTYPE_NAMES, f"dtype must be one of {', '.join(DTYPE_NAMES)}, not {self.dtype!r}"),
            (self.memory_profile in PROFILES,
             f"memory_profile must be one of {', '.join(PROFILES)}, not {self.memory_profile!r}"),
            (self.warmup in WARMUP_MODES, f"warmup must be one of {', '.join(WARMUP_MODES)}, not {self.warmup!r}"),
            (self.graph_batches in GRAPH_BATCHES,
             f"graph_batches must be one of {', '.join(GRAPH_BATCHES)}, not {self.graph_batches!r}"),
            (self.weights_loader in WEIGHT_LOADERS,
             f"weights_loader must be one of {', '.join(WEIGHT_LOADERS)}, not {self.weights_loader!r}"),
            (self.gemm_library in GEMM_LIBRARIES,
             f"gemm_library must be one of {', '.join(GEMM_LIBRARIES)}, not {self.gemm_library!r}"),
            (self.attention_library in ATTENTION_LIBRARIES,
             f"attention_library must be one of {', '.join(ATTENTION_LIBRARIES)}, not {self.attention_library!r}"),
            (self.precision in PRECISIONS,
             f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}"),
            (self.precision_gate in PRECISION_GATES,
             f"precision_gate must be one of {', '.join(PRECISION_GATES)}, not {self.precision_gate!r}"),
            (self.precision == "bf16" or not PROFILES.get(self.memory_profile, PROFILES["default"]).offload,
             "precision fp8 does not combine with the offload memory profile (fp8 weights already halve the memory)"),
            (self.precision == "bf16" or self.gemm_library == "cublas",
             "precision fp8 runs its GEMMs through torch._scaled_mm: gemm_library must be cublas"),
            (not self.batch_invariant or self.precision == "bf16",
             "batch_invariant needs precision bf16: fp8's per-token scales and GEMMs are not batch-invariant"),
            (not self.batch_invariant or self.gemm_library == "cublas",
             "batch_invariant takes its own fixed-order GEMMs: gemm_library must be cublas (the default), not quack"),
            (not self.batch_invariant or self.attention_library == "triton",
             "batch_invariant takes its own fixed-order attention: attention_library must be triton, not fa4"),
            (not self.batch_invariant or self.prompt_buckets in ("auto", ()),
             "batch_invariant pads every prompt to the checkpoint's length: prompt_buckets must be auto or none "
             "(a bucket chosen by a batch's longest prompt would change the other items' shapes)"),
            (self.max_batch_size >= 1, "max_batch_size must be at least 1"),
            (self.prefix_cache >= 0, "prefix_cache must not be negative"),
            (self.compile_cache is None or bool(str(self.compile_cache).strip()),
             "compile_cache must be a directory, not empty"),
            (self.prompt_buckets == "auto" or all(b >= 1 for b in self.prompt_buckets),
             "prompt_buckets must be positive token lengths"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def profile(self) -> MemoryProfile:
        return PROFILES[self.memory_profile]

    def resolved_prompt_buckets(self, max_token_len: int, device_type: str) -> tuple[int, ...]:
        """The prompt buckets as given, or for "auto": where the fast path serves (CUDA, fast_path)
        one bucket at half the checkpoint's prompt length (rounded down to a multiple of 16), else
        none. The padding a bucket drops is masked, so actions change by float reassociation only
        (max|Δ| vs fp32 as without); on CUDA its graphs are captured at warm-up, and a call whose prompt
        fits runs a shorter prefix (docs/benchmarks.md).
        The eager model (a CPU, or fast_path=False) keeps the reference's shapes, where the golden
        cases compare every intermediate tensor. batch_invariant: none (one prompt length for every batch)."""
        if self.prompt_buckets != "auto" or self.batch_invariant:
            return () if self.batch_invariant else self.prompt_buckets
        half = max_token_len // 2 // 16 * 16
        return (half,) if self.runs_fast_path(device_type) and 16 <= half < max_token_len else ()

    def captures_while_loading(self, device_type: str) -> bool:
        """Whether the engine starts before the weights load (`capture_while_loading`): where nothing between the
        load and the engine changes the weights (no fp8 conversion, no layers kept on the host) and the graphs
        are captured in the background, so serving can wait for the weights."""
        return (self.capture_while_loading and self.runs_fast_path(device_type) and self.warmup == "background"
                and self.precision == "bf16" and not self.profile.offload)

    def runs_fast_path(self, device_type: str) -> bool:
        """Whether the CUDA fast path (fused weights, Triton kernels, CUDA graphs) serves on this
        device type; the eager model serves otherwise."""
        return self.fast_path and device_type == "cuda"

    @property
    def batch_limit(self) -> int:
        """The largest batch that runs (the server's batches, the graphs captured, the memory checked for)."""
        return self.profile.batch_limit(self.max_batch_size)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return graph_batch_sizes(self.graph_batches, self.batch_limit)

    @staticmethod
    def options() -> list:
        """The fields that are command-line options (they carry a help text)."""
        return [f for f in fields(RuntimeConfig) if "help" in f.metadata]


def _dims(value, name: str) -> tuple[int, ...]:
    """Action indices as "6,13" or a sequence of ints; ranges as "0-5"."""
    if not isinstance(value, str):
        return tuple(int(v) for v in value)
    dims = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        low, _, high = part.partition("-")
        if not (low.isdigit() and (not high or high.isdigit())):
            raise ConfigError(f"{name} must be action indices or ranges as 6,13 or 0-5, not {value!r}")
        dims.extend(range(int(low), int(high or low) + 1))
    return tuple(dims)


def _groups(value) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Named action groups: "arm=0-5;gripper=6", a mapping {name: dims} or ((name, dims), ...)."""
    if isinstance(value, str):
        pairs = []
        for part in (p.strip() for p in value.split(";") if p.strip()):
            name, eq, dims = part.partition("=")
            if not eq or not name.strip():
                raise ConfigError(f"action_groups must look like arm=0-5;gripper=6, not {value!r}")
            pairs.append((name.strip(), dims))
    else:
        pairs = list(value.items()) if isinstance(value, dict) else list(value)
    return tuple((name, _dims(dims, f"action_groups[{name}]")) for name, dims in pairs)
