"""Memory profiles: same actions in every profile, layer streaming, the startup fit check, `vlaserve info`."""

import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import golden_dir
from vlaserve import Policy
from vlaserve.cli import main
from vlaserve.config import PROFILES, ModelConfig, PolicyConfig, RuntimeConfig, prompt_lengths
from vlaserve.demo import build_model, random_model
from vlaserve.family import load_policy_config
from vlaserve.checkpoint.weights import checkpoint_shapes, param_dtype
from vlaserve.errors import ConfigError, InsufficientMemory
from vlaserve.golden import GoldenCase, case_dirs
from vlaserve.runtime.fast.model import FastPi05
from vlaserve.runtime.memory import GIB, DeviceBudget, check_fit, estimate_memory, gib, given_budget
from vlaserve.runtime.offload import ALIGN, STREAMED_PREFIXES, LayerOffload


def shapes_of(model_config: ModelConfig) -> dict:
    return {name: tuple(p.shape) for name, p in build_model(model_config).named_parameters()}


@pytest.mark.slow  # every golden case under every profile, twice
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_profile_gives_the_same_actions_for_the_same_noise(golden, dtype):
    policies = {name: Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype=dtype, progress=False,
                                             memory_profile=name) for name in PROFILES}
    assert policies["offload"].runtime.offload is not None and policies["default"].runtime.offload is None
    assert {p.metadata["memory_profile"] for p in policies.values()} == set(PROFILES)
    for case_dir in case_dirs(golden):
        case = GoldenCase.load(case_dir)
        actions = {}
        for name, policy in policies.items():
            results = policy.infer_batch(case.observations(), noise=list(case.tensors["input.noise"]),
                                         num_steps=case.meta["num_steps"], rtcs=case.rtcs())
            actions[name] = np.stack([r.model_actions for r in results])
        # Bitwise: offload runs the eager model's kernels in the eager model's order, on weights copied
        # byte for byte; on a CPU, edge-16gb is the eager model itself (its bounds concern CUDA graphs).
        for name in ("edge-16gb", "offload"):
            assert np.array_equal(actions[name], actions["default"]), (case_dir.name, name)


def tiny_config(depth: int) -> PolicyConfig:
    """The golden checkpoint's sizes with `depth` layers in every stack (the golden's 2 never reuse a slot)."""
    config = load_policy_config(golden_dir() / "checkpoint")
    m = config.model
    return config.with_model(replace(m, vision=replace(m.vision, depth=depth), vlm=replace(m.vlm, depth=depth),
                                     expert=replace(m.expert, depth=depth)))


def test_offload_streams_each_layer_through_two_slots():
    model = random_model(tiny_config(depth=5).model, torch.float32, "cpu", seed=3)
    reference = copy.deepcopy(model)
    offload = LayerOffload(model, torch.device("cpu"))
    stacks = {"vision": offload.vision, "vlm": offload.vlm}

    # While a streamed layer computes, its weights must live in one of its stack's two slots.
    seen = []

    def in_slot(stack_name):
        def hook(module, args):
            slots = [flat for flat, _ in stacks[stack_name].slots]
            ptr = module.weight.data_ptr()
            seen.append(any(flat.data_ptr() <= ptr < flat.data_ptr() + flat.numel() for flat in slots))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith(STREAMED_PREFIXES):
            module.register_forward_pre_hook(in_slot(name.split(".", 1)[0]))

    gen = torch.Generator().manual_seed(0)
    images = torch.rand(2, 1, 3, 224, 224, generator=gen) * 2 - 1
    image_masks = torch.ones(2, 1, dtype=torch.bool)
    tokens = torch.randint(0, 1000, (2, 12), generator=gen)
    token_mask = torch.arange(12)[None] < torch.tensor([[12], [7]])
    noise = torch.randn(2, 50, 32, generator=gen)
    expected = reference.sample(images, image_masks, tokens, token_mask, noise, 3)
    for call in (1, 2):
        out = model.sample(images, image_masks, tokens, token_mask, noise, 3)
        assert torch.equal(out, expected), call  # same float32 kernels in the same order: bitwise
        # Five layers alternate over two slots, so every pass copies every layer once.
        assert offload.bytes_copied == call * 5 * (offload.vision.layer_bytes + offload.vlm.layer_bytes)
    # Vision: 6 linears per layer; VLM: 7 (the last layer stops after q/k/v); 5 layers, 2 calls.
    assert len(seen) == 2 * (5 * 6 + 4 * 7 + 3) and all(seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_under_offload_gives_the_resident_fast_paths_actions(dtype):
    """The CUDA fast path streams the layers too (its stock-kernel math runs here): its fused Q/K/V and
    gate/up matrices must be views of the slots (no copy), and the actions the resident ones'."""
    config = tiny_config(depth=3)
    resident = random_model(config.model, dtype, "cpu", seed=5)
    streamed_model = copy.deepcopy(resident)
    offload = LayerOffload(streamed_model, torch.device("cpu"))

    gen = torch.Generator().manual_seed(1)
    b, n, token_len = 2, 2, 12
    images = torch.rand(b, n, 3, 224, 224, generator=gen) * 2 - 1
    image_masks = torch.tensor([[True, True], [True, False]])
    tokens = torch.randint(0, 1000, (b, token_len), generator=gen)
    token_mask = torch.arange(token_len)[None] < torch.tensor([[12], [7]])
    noise = torch.randn(b, 50, 32, generator=gen)
    # An eager call first, as while a server warms up: it leaves its last layers in their slots.
    with torch.no_grad():
        streamed_model.sample(images, image_masks, tokens, token_mask, noise, 3)
    fast = {"resident": FastPi05(resident, use_triton=False),
            "offload": FastPi05(streamed_model, use_triton=False, layer_stream=offload)}
    for i, lw in enumerate(fast["offload"].w.vlm):
        for fused in (lw.qkv, lw.gate_up):
            assert fused.untyped_storage().data_ptr() == offload.vlm.slots[i % 2][0].data_ptr()
    for i, (qkv, _) in enumerate(fast["offload"].w.vision_qkv):
        assert qkv.untyped_storage().data_ptr() == offload.vision.slots[i % 2][0].data_ptr()

    plen = n * config.model.vision.num_patches + token_len
    cache_len = -(-(plen + 50) // 64) * 64
    copied_before = offload.bytes_copied
    actions = {}
    with torch.no_grad():
        for name, f in fast.items():
            for call in range(2):
                k = torch.zeros(len(f.w.vlm), b, cache_len, config.model.vlm.head_dim, dtype=dtype)
                v = torch.zeros_like(k)
                pad = f.prefix(images, image_masks, tokens, token_mask, k, v, n)
                actions[name, call] = f.denoise(pad, noise, f.schedule(3), k, v)
    for call in range(2):
        assert torch.equal(actions["offload", call], actions["resident", call])  # same kernels, same order
    # Three layers over two slots: every pass ends with layers 2 and 1 in the slots, so the next one
    # finds layer 1 still in place and copies two layers per stack.
    assert offload.bytes_copied - copied_before == 2 * 2 * (offload.vision.layer_bytes + offload.vlm.layer_bytes)


def test_estimate_matches_what_offload_allocates():
    config = tiny_config(depth=3)
    model = random_model(config.model, torch.bfloat16, "cpu")
    estimate = estimate_memory(shapes_of(config.model), config, torch.bfloat16, PROFILES["offload"])
    offload = LayerOffload(model, torch.device("cpu"))
    streamed = [p for n, p in model.named_parameters() if n.startswith(STREAMED_PREFIXES) and p.dim() >= 2]
    # The slots pack each matrix at an ALIGN-byte boundary: at most ALIGN - 1 bytes of padding per tensor and slot.
    per_slot_padding = (ALIGN - 1) * len(streamed) // config.model.vision.depth
    assert 0 <= offload.slot_bytes - estimate.offload_slots <= 2 * per_slot_padding
    assert estimate.host_pinned == sum(p.numel() * p.element_size() for p in streamed)


def test_full_size_estimates():
    config = PolicyConfig(ModelConfig.full_size(), ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), 14, 14)
    shapes = shapes_of(config.model)
    default = estimate_memory(shapes, config, torch.bfloat16, PROFILES["default"], batch_size=8)
    edge = estimate_memory(shapes, config, torch.bfloat16, PROFILES["edge-16gb"], batch_size=8)
    offload = estimate_memory(shapes, config, torch.bfloat16, PROFILES["offload"], batch_size=8)
    # 3,353,433,872 parameters (docs/benchmarks.md), of which 119,720,608 in the fp32 set (OpenPI's and
    # SGLang's published count), counted by hand as in golden_fp32_split: 678,528 patch conv + 294,912
    # positions + 75,776 RMSNorms + 116,505,600 AdaRMS dense + 2,165,792 action/time projections (the
    # 126,720 SigLIP LayerNorm parameters are bf16, as in OpenPI).
    assert default.weights == edge.weights == (3_353_433_872 - 119_720_608) * 2 + 119_720_608 * 4
    assert offload.weights + offload.host_pinned == default.weights
    assert edge.batch_size == 4 and edge.total < default.total
    assert offload.total < edge.total
    # Weights dominate: the full-size default at batch 8 must not fit an 8 GiB card, offload must.
    assert default.total > 8 * GIB > offload.total


@pytest.mark.parametrize("graph_batches, num_prompt_lengths, graphs, measured_gib", [
    ("all", 1, 40, 1.96), ("ladder", 1, 20, 1.57), ("all", 2, 80, 2.19)])
def test_graph_memory_matches_the_h200s(graph_batches, num_prompt_lengths, graphs, measured_gib):
    """The fast path's buffers and CUDA graphs (MemoryEstimate.engine) against what the H200 measured
    at batches 1..8, full size, 3 cameras (docs/memory.md, docs/benchmarks.md run 117: 80 graphs 2.19
    GiB): one constant (GRAPH_POOL_PER_PROMPT_LENGTH) fits all three within 0.05 GiB; without the pool
    term the two-prompt-length case was 0.48 GiB short."""
    config = PolicyConfig(ModelConfig.full_size(), ("a", "b", "c"), 14, 14)
    estimate = estimate_memory(shapes_of(config.model), config, torch.bfloat16, PROFILES["default"], 8,
                               graph_batches=graph_batches, num_prompt_lengths=num_prompt_lengths)
    assert estimate.graph_count == graphs
    assert abs(estimate.engine / GIB - measured_gib) < 0.05
    assert estimate.total == estimate.weights + estimate.engine + estimate.headroom
    assert f"{graphs} CUDA graphs' pool" in estimate.describe()


def test_fit_check_refuses_with_the_numbers_and_names_a_profile_that_fits():
    config = PolicyConfig(ModelConfig.full_size(), ("a", "b", "c"), 14, 14)
    shapes = shapes_of(config.model)
    estimates = {name: estimate_memory(shapes, config, torch.bfloat16, p, 8) for name, p in PROFILES.items()}
    budget = given_budget((estimates["default"].total + estimates["edge-16gb"].total) // 2)
    with pytest.raises(InsufficientMemory) as refused:
        check_fit(shapes, config, torch.bfloat16, PROFILES["default"], 8, budget)
    message = str(refused.value)
    assert f"needs about {gib(estimates['default'].total)}" in message
    assert f"may use only {gib(budget.usable)}" in message
    assert f"edge-16gb (about {gib(estimates['edge-16gb'].total)})" in message
    assert "--memory-profile edge-16gb" in message
    assert check_fit(shapes, config, torch.bfloat16, PROFILES["edge-16gb"], 8, budget) == estimates["edge-16gb"]


def test_from_pretrained_refuses_before_loading_any_weight(golden, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the fit check refused")

    monkeypatch.setattr("vlaserve.policy.load_weights", no_loading)
    with pytest.raises(InsufficientMemory, match=r"may use only 0\.10 GiB \(the given budget of 0\.10 GiB\).*"
                                                 r"No profile fits"):
        Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                               memory_budget_bytes=GIB // 10)
    monkeypatch.undo()
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    memory_budget_bytes=2 * GIB, max_batch_size=8)
    assert policy.metadata["memory_profile"] == "default"


def test_offload_is_refused_when_the_host_cannot_pin_its_layers(golden, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the host check refused")

    config = load_policy_config(golden / "checkpoint")
    pinned = estimate_memory(shapes_of(config.model), config, torch.float32, PROFILES["offload"], 1).host_pinned
    assert pinned > 0
    monkeypatch.setattr("vlaserve.runtime.memory.available_memory_bytes", lambda: pinned - 1)
    monkeypatch.setattr("vlaserve.policy.load_weights", no_loading)
    with pytest.raises(InsufficientMemory, match=r"keeps .* pinned in host memory, but only"):
        Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                               memory_profile="offload", memory_budget_bytes=2 * GIB)
    # The resident profiles pin nothing on the host: not refused for it.
    with pytest.raises(AssertionError, match="weights were loaded"):
        Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                               memory_budget_bytes=2 * GIB)


def test_unknown_profile_is_refused():
    with pytest.raises(ConfigError, match="one of default, edge-16gb, offload"):
        RuntimeConfig(memory_profile="tiny")


def golden_fp32_split(golden) -> tuple[int, int]:
    """(used parameters, float32 parameters under the bf16 policy), derived from architecture.json by
    hand: the fp32 set (OpenPI's) is the vision patch and position embeddings, the Gemma norms (RMSNorm
    offsets, the expert's AdaRMS dense layers) and the four action/time projections; the SigLIP
    LayerNorms are in the serving dtype."""
    arch = json.loads((golden / "checkpoint" / "architecture.json").read_text())
    v, g, e, a = arch["vision"], arch["vlm"], arch["expert"], arch["policy"]["max_action_dim"]
    w, we = v["hidden_size"], e["width"]
    fp32 = (w * 3 * v["patch_size"] ** 2 + w + v["num_patches"] * w  # patch conv + bias, positions
            + (2 * g["depth"] + 1) * g["width"]  # two RMSNorms per layer + the final one
            + (2 * e["depth"] + 1) * (we * 3 * we + 3 * we)  # AdaRMS dense: cond -> (scale, shift, gate)
            + (a * we + we) + (we * a + a) + 2 * (we * we + we))  # action in/out, time MLP in/out
    # The state dict also holds two LM heads Pi0.5 never uses (the PaliGemma one tied to the embedding).
    used = arch["num_parameters"] - g["vocab_size"] * g["width"] - e["vocab_size"] * we
    return used, fp32


def test_info_prints_the_parameter_counts(golden, capsys):
    used, fp32 = golden_fp32_split(golden)
    assert used == 248_960
    assert main(["info", str(golden / "checkpoint"), "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert f"{used:,} used: {used:,} float32 (serving dtype float32)" in text
    assert "base_0_rgb, left_wrist_0_rgb, right_wrist_0_rgb" in text and "normalization   lerobot" in text
    assert main(["info", str(golden / "checkpoint"), "--device", "cuda"]) == 0  # auto dtype on CUDA: bfloat16
    text = capsys.readouterr().out
    assert f"{used:,} used: {used - fp32:,} bfloat16 + {fp32:,} float32 (serving dtype bfloat16)" in text
    for name in PROFILES:
        assert f"\n{name} " in text


def test_info_json_parses(golden, capsys):
    used, fp32 = golden_fp32_split(golden)
    assert main(["info", str(golden / "checkpoint"), "--json", "--max-batch-size", "4", "--device", "cuda"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == {"total": used, "by_dtype": {"bfloat16": used - fp32, "float32": fp32}}
    assert (info["state_dim"], info["action_dim"], info["action_horizon"]) == (14, 14, 50)
    assert info["is_demo"] is False and info["tokenizer"].endswith("tokenizer") and info["normalization"] == "lerobot"
    assert info["memory"]["batch_sizes"] == [1, 4]
    offload = info["memory"]["profiles"]["offload"]["estimates"][0]
    assert offload["total"] == sum(offload[k] for k in ("weights", "offload_slots", "kv_and_buffers",
                                                         "activations", "graph_pool", "headroom"))
    # On CUDA serve captures graphs for the golden checkpoint's prompt length (200) and its auto bucket (96).
    assert info["memory"]["prompt_lengths"] == [96, 200]
    # Under offload the prefix runs outside graphs: per batch size 1..4 and prompt length, a denoise graph
    # with and without RTC; the default profile adds one prefix graph per camera layout (3).
    assert offload["graph_count"] == 1 * 2 * 2 and info["memory"]["profiles"]["default"]["estimates"][1][
        "graph_count"] == 4 * 2 * (3 + 2)


def test_info_reports_what_serve_uses_on_this_machine(golden, capsys):
    """Device and dtype "auto", as serve: the dtype the loaded policy has, and CUDA graphs in the
    memory only where the policy runs the fast path (on a CPU: float32, the eager model)."""
    policy = Policy.from_pretrained(golden / "checkpoint", progress=False)  # serve's defaults
    meta = policy.metadata
    assert main(["info", str(golden / "checkpoint"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["device"], info["dtype"]) == (policy.runtime.device.type, meta["dtype"])
    assert info["cuda_graphs"] == meta["fast_path"]
    config, shapes = policy.config, checkpoint_shapes(golden / "checkpoint")
    for name, profile in PROFILES.items():
        assert info["memory"]["profiles"][name]["estimates"] == [
            estimate_memory(shapes, config, policy.runtime.dtype, profile, b, fast_path=meta["fast_path"]).as_dict()
            for b in (1, 8)]
    if policy.runtime.device.type == "cpu":
        assert (info["dtype"], info["cuda_graphs"]) == ("float32", False)
        assert main(["info", str(golden / "checkpoint")]) == 0
        assert "eager at batch 8" in capsys.readouterr().out


def test_info_on_the_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLASERVE_CACHE", str(tmp_path))
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["is_demo"] is True and info["checkpoint"] == str(tmp_path / "demo-pi05-v1")


def test_serve_takes_the_profile_from_the_command_line_or_the_config_file(tmp_path):
    from test_server_cli import options, run_serve

    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"memory_profile": "offload"}))
    assert options([])["memory_profile"] == "default"
    assert options(["--config", str(config)])["memory_profile"] == "offload"
    assert options(["--config", str(config), "--memory-profile", "edge-16gb"])["memory_profile"] == "edge-16gb"
    result = run_serve(["--memory-profile", "tiny", "--device", "cpu"], tmp_path)
    assert result.returncode == 2 and "memory_profile must be one of default, edge-16gb, offload" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_profile_caps_the_prefix_cache(golden):
    def entries(**options) -> int:
        policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                        memory_profile="edge-16gb", **options)
        return policy.metadata["prefix_cache"]["max_entries"]

    assert entries(prefix_cache=100) == PROFILES["edge-16gb"].prefix_cache_entries == 16
    assert entries(prefix_cache=3) == 3


def test_the_docs_expected_memory_is_the_estimators():
    """docs/memory.md's "Expected memory" table and its refusal example are the estimator's output for the
    full-size model at the server's default graphs (the checkpoint's prompt length and its bucket), and its
    parameter counts the serving dtype policy's."""
    doc = (Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    config = PolicyConfig(ModelConfig.full_size(), ("a", "b", "c"), 14, 14)
    shapes = shapes_of(config.model)
    lengths = len(prompt_lengths(RuntimeConfig().resolved_prompt_buckets(config.max_token_len, "cuda"),
                                 config.max_token_len))
    counts = {torch.bfloat16: 0, torch.float32: 0}
    for name, shape in shapes.items():
        counts[param_dtype(name, torch.bfloat16)] += int(np.prod(shape))
    assert f"{counts[torch.bfloat16]:,} parameters in bf16 + {counts[torch.float32]:,} in fp32" in " ".join(doc.split())
    table = doc[doc.index("| profile | batch 1 | batch 4 | batch 8 | weights on device |"):]
    for name, profile in PROFILES.items():
        cells = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |")).split(" | ")[1:4]
        for cell, batch in zip(cells, (1, 4, 8)):
            estimate = estimate_memory(shapes, config, torch.bfloat16, profile, batch, num_prompt_lengths=lengths)
            assert cell.startswith(gib(estimate.total)), (name, batch)
    with pytest.raises(InsufficientMemory) as refused:
        check_fit(shapes, config, torch.bfloat16, PROFILES["default"], 8,
                  DeviceBudget(8 * GIB, "139.20 GiB free of 139.80 GiB on cuda:0, per-process cap 8.00 GiB (5.7%)"),
                  num_prompt_lengths=lengths)
    example = re.search(r"```\n(memory profile 'default' needs about.*?)```", doc, re.S).group(1)
    assert " ".join(example.split()) == str(refused.value)
