"""Model dimensions and policy settings, read from a checkpoint directory.

Dims come from `architecture.json` when present (tiny test checkpoints use it, since their
config.json still names the full-size variants), else from the variant names in config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import CheckpointError


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

    @property
    def action_horizon(self) -> int:
        return self.model.chunk_size

    def with_model(self, model: ModelConfig) -> "PolicyConfig":
        return replace(self, model=model)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _model_from_architecture(arch: dict, chunk_size: int, max_action_dim: int) -> ModelConfig:
    def gemma(d: dict) -> GemmaDims:
        return GemmaDims(
            width=d["width"], depth=d["depth"], mlp_dim=d["mlp_dim"], num_heads=d["num_heads"],
            num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"], vocab_size=d.get("vocab_size", 257152),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
        )

    v = arch["vision"]
    vision = VisionDims(
        width=v["hidden_size"], depth=v["num_layers"], mlp_dim=v["mlp_dim"], num_heads=v["num_heads"],
        head_dim=v["head_dim"], patch_size=v.get("patch_size", 14), image_size=v.get("image_size", 224),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
    )
    time = arch.get("policy", {}).get("time_embedding", {})
    return ModelConfig(
        vision=vision, vlm=gemma(arch["vlm"]), expert=gemma(arch["expert"]),
        max_action_dim=max_action_dim, chunk_size=chunk_size,
        time_min_period=time.get("min_period", 4e-3), time_max_period=time.get("max_period", 4.0),
    )


def load_policy_config(checkpoint_dir: Path) -> PolicyConfig:
    """Reads a LeRobot pi05 `config.json` (+ optional `architecture.json`)."""
    cfg = _read_json(checkpoint_dir / "config.json")
    if cfg.get("type", "pi05") != "pi05":
        raise CheckpointError(f"{checkpoint_dir}/config.json has type {cfg.get('type')!r}; vlaserve serves pi05")

    features = cfg.get("input_features") or {}
    cameras = [k.split("observation.images.", 1)[1] for k, f in features.items()
               if f.get("type") == "VISUAL" and k.startswith("observation.images.")]
    # LeRobot also writes the empty cameras into input_features when it saves: count each once.
    cameras += [name for name in (f"empty_camera_{i}" for i in range(int(cfg.get("empty_cameras", 0))))
                if name not in cameras]
    if not cameras:
        raise CheckpointError(f"{checkpoint_dir}/config.json declares no VISUAL input features")
    state = features.get("observation.state")
    action = (cfg.get("output_features") or {}).get("action")
    if state is None or action is None:
        raise CheckpointError(f"{checkpoint_dir}/config.json lacks observation.state or action features")

    chunk_size = int(cfg.get("chunk_size", 50))
    max_action_dim = int(cfg.get("max_action_dim", 32))
    arch_path = checkpoint_dir / "architecture.json"
    arch = _read_json(arch_path) if arch_path.exists() else None
    if arch is not None:
        model = _model_from_architecture(arch, chunk_size, max_action_dim)
    else:
        try:
            vlm = GEMMA_VARIANTS[cfg.get("paligemma_variant", "gemma_2b")]
            expert = GEMMA_VARIANTS[cfg.get("action_expert_variant", "gemma_300m")]
        except KeyError as e:
            raise CheckpointError(f"unknown Gemma variant {e.args[0]!r} (known: {sorted(GEMMA_VARIANTS)})") from None
        model = ModelConfig(SIGLIP_SO400M_14, vlm, expert, max_action_dim=max_action_dim, chunk_size=chunk_size,
                            time_min_period=float(cfg.get("min_period", 4e-3)),
                            time_max_period=float(cfg.get("max_period", 4.0)))

    resolution = tuple(cfg.get("image_resolution", (224, 224)))
    if resolution[0] != resolution[1] or resolution[0] != model.vision.image_size:
        raise CheckpointError(f"image_resolution {resolution} does not match the vision tower "
                              f"({model.vision.image_size}x{model.vision.image_size})")
    return PolicyConfig(
        model=model,
        cameras=tuple(cameras),
        state_dim=int(state["shape"][0]),
        action_dim=int(action["shape"][0]),
        num_inference_steps=int(cfg.get("num_inference_steps", 10)),
        max_token_len=int(cfg.get("tokenizer_max_length", 200)),
        image_resolution=(int(resolution[0]), int(resolution[1])),
        is_demo=bool(arch and arch.get("demo")),
    )
