"""Tiny random-weight Pi0.5 and Pi0 checkpoints, built offline, so `vlaserve serve` works with no download.

The demo produces meaningless actions: it exists to exercise the whole serving path (formats,
protocols, batching) on any machine. It is written in the LeRobot checkpoint layout of its family
(`vlaserve serve --demo pi0` for Pi0), so it loads through exactly the same code as a real checkpoint.

The random-model helpers (random weights in the LeRobot layout, a random model on any device) build
benchmark models too. torch and the model are imported by the functions that use them, so that the
command line can read DEMO_NAMES without loading torch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .checkpoint.files import resolve_checkpoint

DEMO_NAMES = {"pi05": "demo-pi05-v1", "pi0": "demo-pi0-v1"}
DEMO_NAME = DEMO_NAMES["pi05"]  # the default demo
# Checkpoint ids that name a demo (Policy.from_pretrained("demo-pi0"), `vlaserve serve demo-pi0`) -> its family.
DEMO_IDS = {"demo": "pi05", "demo-pi05": "pi05", "demo-pi0": "pi0"}
DEMO_SEED = 20261201
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
STATE_DIM = ACTION_DIM = 14
CHUNK_SIZE = 50
NUM_STEPS = 10
TOKENIZER_MAX_LENGTH = 48  # short prompts keep the demo prefix small and the CPU fast
TOKENIZER_VOCAB_SIZE = 768
MODEL_VOCAB_SIZE = 1024

log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("VLASERVE_CACHE") or Path.home() / ".cache" / "vlaserve")


def demo_checkpoint(cache_dir: str | os.PathLike | None = None, policy_type: str = "pi05") -> Path:
    """Path of the family's demo checkpoint, built on first use (atomically, so concurrent starts are safe)."""
    if policy_type not in DEMO_NAMES:
        raise ValueError(f"no demo for policy type {policy_type!r} (demos: {', '.join(DEMO_NAMES)})")
    name = DEMO_NAMES[policy_type]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.warning("building the %s DEMO checkpoint (tiny, random weights) in %s", policy_type, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write_demo_checkpoint(staging, policy_type)
        os.rename(staging, target)
    except OSError:
        # Another process finished first; its copy is identical (same seed), so use it.
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def find_checkpoint(path_or_id: str | os.PathLike) -> Path:
    """A local directory; else a demo id (DEMO_IDS; built on first use); else a Hugging Face hub id."""
    if str(path_or_id) in DEMO_IDS and not Path(path_or_id).expanduser().is_dir():
        return demo_checkpoint(policy_type=DEMO_IDS[str(path_or_id)])
    return resolve_checkpoint(path_or_id)


def write_demo_checkpoint(out: Path, policy_type: str = "pi05") -> None:
    from safetensors.numpy import save_file as save_numpy
    from safetensors.torch import save_file as save_torch

    from .family import family_named, load_policy_config

    family = family_named(policy_type)
    architecture = demo_architecture(policy_type)
    _write_json(out / "architecture.json", architecture)
    _write_json(out / "config.json", demo_config(policy_type))
    # Read back through the loader, so the weights have exactly the shapes serving will expect.
    model = family.build_model(load_policy_config(out))
    state_dict = random_lerobot_state_dict(model, family.weights, seed=DEMO_SEED, std=architecture["init"]["std"])
    save_torch({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"))

    stats = normalization_stats(np.random.default_rng(DEMO_SEED))
    preprocessor = preprocessor_pipeline(policy_type)
    _write_json(out / "policy_preprocessor.json", preprocessor)
    normalizer = next(step for step in preprocessor["steps"] if step["registry_name"] == "normalizer_processor")
    save_numpy(stats, str(out / normalizer["state_file"]))
    _write_json(out / "policy_postprocessor.json", postprocessor_pipeline(policy_type))
    save_numpy(stats, str(out / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))

    tokenizer_dir = out / "tokenizer"
    tokenizer_dir.mkdir()
    build_tokenizer().save(str(tokenizer_dir / "tokenizer.json"))
    _write_json(tokenizer_dir / "tokenizer_config.json", {
        "backend": "tokenizers", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "padding_side": "right", "tokenizer_class": "TokenizersBackend",
    })
    _write_json(tokenizer_dir / "special_tokens_map.json",
                {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"})
    (out / "README.md").write_text(
        "# vlaserve DEMO checkpoint\n\n"
        f"Tiny {family.display} with RANDOM weights, generated offline by `vlaserve.demo`. Its actions mean nothing;\n"
        "it exists to try the server and its protocols without downloading a model.\n"
    )


def random_lerobot_state_dict(model, layout, seed: int = 0, std: float = 0.02) -> dict:
    """Random float32 weights in the LeRobot layout (a checkpoint.weights.WeightLayout) for `model`'s
    parameters (its shapes only: it may live on the meta device); demo and benchmark checkpoints.

    Gemma RMSNorm offsets and SigLIP LayerNorm scales are drawn around their identity values.
    """
    import torch

    from .checkpoint.weights import EMBED, LM_HEAD

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * std
        if name.endswith("layernorm.weight") and name.startswith("vision."):
            value = 1.0 + noise
        else:
            value = noise
        out[layout.to_lerobot(name)] = value.contiguous()
    out["model." + LM_HEAD] = out[layout.to_lerobot(EMBED)].clone()  # tied, as PaliGemma stores it
    return out


def build_model(config):
    """A Pi0.5 module tree (config: a config.ModelConfig) without storage: shapes only, for
    estimates and checks at any size."""
    import torch

    from .model.pi05 import Pi05Model

    with torch.device("meta"):
        return Pi05Model(config)


def random_model(config, dtype, device, seed: int = 0, std: float = 0.02):
    """A random Pi0.5 (config: a config.ModelConfig) built directly on `device`, under the serving
    dtype policy (for speed and memory work at full size)."""
    import torch

    from .checkpoint.weights import apply_dtype_policy
    from .model.pi05 import Pi05Model

    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Pi05Model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std, generator=gen)
            if name.startswith("vision.") and name.endswith("layernorm.weight"):
                p.add_(1.0)
    return apply_dtype_policy(model, dtype).eval().requires_grad_(False)


def demo_architecture(policy_type: str = "pi05") -> dict:
    """Same schema as the family's golden test checkpoint's architecture.json, with the same tiny sizes."""
    gemma = {"num_heads": 8, "num_kv_heads": 1, "head_dim": 16, "vocab_size": MODEL_VOCAB_SIZE,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "gelu_pytorch_tanh"}
    # Pi0.5's expert norms are AdaRMS (conditioned on the time); Pi0's are plain RMSNorms.
    adarms = {"adarms": True, "adarms_cond_dim": 32} if policy_type == "pi05" else {"adarms": False}
    return {
        "format": f"{policy_type}-golden-architecture/1",
        "demo": True,
        "lerobot_variant_names": {"vlm": "gemma_2b", "expert": "gemma_300m"},
        "note": "vlaserve demo checkpoint: tiny sizes, random weights; config.json names the lerobot variants only.",
        "vlm": {"width": 64, "depth": 2, "mlp_dim": 128, **gemma, "embed_scale": 8.0},
        "expert": {"width": 32, "depth": 2, "mlp_dim": 64, **gemma, **adarms, "embed_tokens": None,
                   "lm_head_unused": True},
        "vision": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "head_dim": 16, "mlp_dim": 64,
                   "patch_size": 14, "image_size": 224, "num_patches": 256, "projection_dim": 64,
                   "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "use_head": False},
        "policy": {
            "cameras": list(CAMERAS), "camera_key_prefix": "observation.images.",
            "state_dim": STATE_DIM, "action_dim": ACTION_DIM, "chunk_size": CHUNK_SIZE,
            "n_action_steps": CHUNK_SIZE, "num_inference_steps": NUM_STEPS,
            "tokenizer_max_length": TOKENIZER_MAX_LENGTH, "max_state_dim": 32, "max_action_dim": 32,
            "empty_cameras": 0, "image_resolution": [224, 224],
            "prefix_len": len(CAMERAS) * 256 + TOKENIZER_MAX_LENGTH,
            "time_embedding": {"dim": 32, "min_period": 0.004, "max_period": 4.0},
            "dtype": "float32",
            **(_PI0_POLICY if policy_type == "pi0" else {}),
        },
        "init": {"seed": DEMO_SEED, "std": 0.1, "norm_std": 0.1},
    }


# What Pi0's architecture.json adds to the policy section (as the pi0 golden checkpoint has it).
_PI0_POLICY = {
    "type": "pi0", "suffix_len": 1 + CHUNK_SIZE,
    "normalization": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
    "projections": {"state_proj": {"in": 32, "out": 32}, "action_in_proj": {"in": 32, "out": 32},
                    "action_time_mlp_in": {"in": 64, "out": 32}, "action_time_mlp_out": {"in": 32, "out": 32},
                    "action_out_proj": {"in": 32, "out": 32}},
}


def demo_config(policy_type: str = "pi05") -> dict:
    """A LeRobot PI05Config or PI0Config (draccus JSON), as `save_pretrained` writes it."""
    config = _pi05_config()
    if policy_type == "pi0":  # PI0Config: the same fields, MEAN_STD, tokenizer_max_length last
        length = config.pop("tokenizer_max_length")
        config.update(type="pi0", normalization_mapping=NORM_MAPS["pi0"], tokenizer_max_length=length)
    return config


def _pi05_config() -> dict:
    visual = {"type": "VISUAL", "shape": [3, 224, 224]}
    return {
        "type": "pi05",
        "n_obs_steps": 1,
        "input_features": {
            **{f"observation.images.{cam}": dict(visual) for cam in CAMERAS},
            "observation.state": {"type": "STATE", "shape": [STATE_DIM]},
        },
        "output_features": {"action": {"type": "ACTION", "shape": [ACTION_DIM]}},
        "device": "cpu",
        "use_amp": False,
        "use_peft": False,
        "push_to_hub": False,
        "repo_id": None,
        "private": None,
        "tags": ["vlaserve-demo"],
        "license": None,
        "pretrained_path": None,
        "pretrained_revision": None,
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "dtype": "float32",
        "chunk_size": CHUNK_SIZE,
        "n_action_steps": CHUNK_SIZE,
        "max_state_dim": 32,
        "max_action_dim": 32,
        "num_inference_steps": NUM_STEPS,
        "time_sampling_beta_alpha": 1.5,
        "time_sampling_beta_beta": 1.0,
        "time_sampling_scale": 0.999,
        "time_sampling_offset": 0.001,
        "min_period": 0.004,
        "max_period": 4.0,
        "use_relative_actions": False,
        "relative_exclude_joints": ["gripper"],
        "action_feature_names": None,
        "rtc_config": None,
        "image_resolution": [224, 224],
        "empty_cameras": 0,
        "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
        "gradient_checkpointing": False,
        "compile_model": False,
        "compile_mode": "max-autotune",
        "freeze_vision_encoder": False,
        "train_expert_only": False,
        "optimizer_lr": 2.5e-05,
        "optimizer_betas": [0.9, 0.95],
        "optimizer_eps": 1e-08,
        "optimizer_weight_decay": 0.01,
        "optimizer_grad_clip_norm": 1.0,
        "scheduler_warmup_steps": 1000,
        "scheduler_decay_steps": 30000,
        "scheduler_decay_lr": 2.5e-06,
    }


def _normalizer_features(with_inputs: bool) -> dict:
    features = {}
    if with_inputs:
        features.update({f"observation.images.{cam}": {"type": "VISUAL", "shape": [3, 224, 224]} for cam in CAMERAS})
        features["observation.state"] = {"type": "STATE", "shape": [STATE_DIM]}
    features["action"] = {"type": "ACTION", "shape": [ACTION_DIM]}
    return features


NORM_MAPS = {"pi05": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
             "pi0": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}


def preprocessor_pipeline(policy_type: str = "pi05") -> dict:
    """The family's pre-processor steps in LeRobot's order (processing/pipeline.py PRE_STEPS)."""
    from .processing.pipeline import PRE_STEPS

    steps = {
        "rename_observations_processor": {"rename_map": {}},
        "to_batch_processor": {},
        "relative_actions_processor": {"enabled": False, "exclude_joints": ["gripper"], "action_names": None},
        "normalizer_processor": {"eps": 1e-08, "features": _normalizer_features(True),
                                 "norm_map": NORM_MAPS[policy_type]},
        "pi05_prepare_state_tokenizer_processor_step": {},
        "pi0_new_line_processor": {},
        "tokenizer_processor": {"max_length": TOKENIZER_MAX_LENGTH, "task_key": "task", "padding_side": "right",
                                "padding": "max_length", "truncation": True,
                                "tokenizer_name": "google/paligemma-3b-pt-224"},
        "device_processor": {"device": "cpu", "float_dtype": None},
    }
    entries = []
    for i, name in enumerate(PRE_STEPS[policy_type]):
        entry = {"registry_name": name, "config": steps[name]}
        if name == "normalizer_processor":
            entry["state_file"] = f"policy_preprocessor_step_{i}_normalizer_processor.safetensors"
        entries.append(entry)
    return {"name": "policy_preprocessor", "steps": entries}


def postprocessor_pipeline(policy_type: str = "pi05") -> dict:
    return {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor",
         "config": {"eps": 1e-08, "features": _normalizer_features(False), "norm_map": NORM_MAPS[policy_type]},
         "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"},
        {"registry_name": "absolute_actions_processor", "config": {"enabled": False}},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
    ]}


def normalization_stats(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per-dimension statistics with the orderings real data has: min < q01 < mean < q99 < max."""
    stats = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        q01 = rng.normal(0.0, 1.0, dim)
        spread = rng.uniform(0.5, 3.0, dim)
        q99 = q01 + spread
        values = {
            "q01": q01, "q99": q99,
            "mean": q01 + rng.uniform(0.3, 0.7, dim) * spread,
            "std": rng.uniform(0.15, 0.35, dim) * spread,
            "min": q01 - rng.uniform(0.05, 0.5, dim) * spread,
            "max": q99 + rng.uniform(0.05, 0.5, dim) * spread,
        }
        stats.update({f"{key}.{name}": v.astype(np.float32) for name, v in values.items()})
    return stats


# Prompts look like "Task: pick up the red block, State: 12 200 -1 ...;\nAction: ", so the corpus is
# task phrases, the prompt scaffolding and the state-bin numbers.
_VERBS = ("pick up", "put down", "place", "move", "push", "pull", "open", "close", "stack", "fold",
          "grasp", "lift", "insert", "rotate", "wipe", "pour", "hand over", "slide", "press", "sort")
_OBJECTS = ("the red block", "the blue cup", "the green bowl", "the drawer", "the towel", "the lid",
            "the bottle", "the sponge", "the marker", "the box", "the door", "the plate", "the spoon",
            "the cube", "the shirt", "the peg", "the cable", "the button", "the tray", "the can")
_PLACES = ("on the table", "into the box", "onto the plate", "to the left", "to the right",
           "next to the cup", "in the bin", "on the shelf", "neatly", "slowly")


def tokenizer_corpus() -> list[str]:
    lines = []
    for i, verb in enumerate(_VERBS):
        for j, obj in enumerate(_OBJECTS):
            place = _PLACES[(i + j) % len(_PLACES)]
            bins = " ".join(str((37 * i + 11 * j + 5 * k) % 256) for k in range(STATE_DIM))
            # "\n" stays out of the corpus so that it is byte-encoded, as in the golden tokenizer.
            lines += [f"Task: {verb} {obj} {place}, State: {bins};", "Action: "]
    lines.append(" ".join(str(n) for n in range(256)))
    return lines


def build_tokenizer():
    """A small BPE with PaliGemma's conventions, matching the golden checkpoint's stand-in tokenizer:
    <pad>=0 <eos>=1 <bos>=2 <unk>=3, byte fallback <0x00>..<0xFF> = 4..259, '▁' word boundaries,
    <bos> prepended and no <eos>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=False))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    return tokenizer


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=4) + "\n")
