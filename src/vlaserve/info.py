"""`vlaserve info`: what serving a checkpoint takes, from its headers and config files (no weight
is read), on the device and in the dtype `vlaserve serve` would use here (or the ones given). torch
is imported when it runs, not when the command line is parsed."""

from __future__ import annotations

import json
import logging

from .config import DTYPE_NAMES, RuntimeConfig
from .demo import DEMO_NAMES, find_checkpoint
from .errors import VlaserveError
from .options import DEMO_HELP, UsageError, checkpoint_or_demo

log = logging.getLogger("vlaserve")


def add_parser(commands) -> None:
    info = commands.add_parser(
        "info", help="describe a checkpoint without loading its weights",
        description="Parameter counts per dtype, expected device memory per memory profile, cameras, dims, "
                    "tokenizer and normalization of a checkpoint, read from its headers and config files.")
    info.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                      help="local directory or Hugging Face hub id (owner/name); none: the built-in DEMO")
    info.add_argument("--demo", choices=tuple(DEMO_NAMES), help=DEMO_HELP)
    info.add_argument("--device", default="auto", metavar="DEVICE",
                      help="device the memory assumes: auto (as serve: cuda when available), cpu, cuda or cuda:N "
                           "(default: auto)")
    info.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                      help="serving dtype the counts and memory assume (default: auto, as serve: bfloat16 on CUDA, "
                           "float32 on a CPU)")
    info.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                      help="batch size of the second memory column (default: 8, as serve)")
    info.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory or file, when the checkpoint has none")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    info.set_defaults(run=info_command)


def checkpoint_info(checkpoint: str | None, dtype: str, max_batch_size: int, tokenizer: str | None = None,
                    demo: str | None = None, device: str = "auto") -> dict:
    """What `vlaserve info` reports, from headers and config files only (no weight is read).
    `device` and `dtype` as RuntimeConfig takes them ("auto": what `vlaserve serve` uses here); the
    memory counts CUDA graphs where serve runs them (on CUDA), the eager model elsewhere."""
    import torch

    from .checkpoint.weights import check_weights, checkpoint_shapes
    from .config import PROFILES, prompt_lengths
    from .errors import CheckpointError
    from .family import family_of, load_policy_config
    from .processing.pipeline import load_normalization
    from .processing.prompt import find_tokenizer
    from .runtime.device import resolve_device, resolve_dtype
    from .runtime.memory import counts_by_dtype, estimate_memory, prefix_kv_bytes

    settings = RuntimeConfig(device=device, dtype=dtype, max_batch_size=max_batch_size)  # checks the names
    # Like serve, but describing a CUDA device needs none here.
    target = resolve_device("auto") if settings.device == "auto" else torch.device(settings.device)
    torch_dtype = resolve_dtype(settings.dtype, target)
    graphs = settings.runs_fast_path(target.type)
    directory = find_checkpoint(checkpoint_or_demo(checkpoint, demo))
    config = load_policy_config(directory)
    family = family_of(config)
    layout = family.weights
    check_weights(family.build_model(config), directory, layout)  # config.json's type and the weights agree
    shapes = checkpoint_shapes(directory, layout)
    counts = counts_by_dtype(shapes, torch_dtype, layout)
    info = {
        "checkpoint": str(directory), "policy_type": config.policy_type, "is_demo": config.is_demo,
        "device": target.type, "dtype": str(torch_dtype).removeprefix("torch."), "cuda_graphs": graphs,
        "parameters": {"total": sum(counts.values()), "by_dtype": counts},
        "cameras": list(config.cameras), "state_dim": config.state_dim, "action_dim": config.action_dim,
        "action_horizon": config.action_horizon, "num_inference_steps": config.num_inference_steps,
        "max_token_len": config.max_token_len,
    }
    try:
        info["tokenizer"] = str(find_tokenizer(directory, tokenizer))
    except CheckpointError as e:
        info["tokenizer"], info["tokenizer_error"] = None, str(e)
    try:
        info["normalization"] = load_normalization(directory, config).source
    except CheckpointError as e:
        info["normalization"], info["normalization_error"] = None, str(e)
    entry = prefix_kv_bytes(config, torch_dtype.itemsize)
    # The prompt lengths serve captures graphs for: its default buckets on this device, and the checkpoint's.
    lengths = prompt_lengths(settings.resolved_prompt_buckets(config.max_token_len, target.type), config.max_token_len)
    info["memory"] = {
        "batch_sizes": [1, max_batch_size], "prompt_lengths": list(lengths) if graphs else [config.max_token_len],
        "prefix_cache_entry_bytes": entry,
        "profiles": {p.name: {
            "summary": p.summary, "max_graph_batch": p.max_graph_batch,
            "prefix_cache_entries": p.prefix_cache_entries, "prefix_cache_bytes": p.prefix_cache_entries * entry,
            "estimates": [estimate_memory(shapes, config, torch_dtype, p, b, fast_path=graphs,
                                          num_prompt_lengths=len(lengths)).as_dict() for b in (1, max_batch_size)],
        } for p in PROFILES.values()},
    }
    return info


def format_info(info: dict) -> str:
    gib = 2**30
    params = info["parameters"]
    split = " + ".join(f"{n:,} {dtype}" for dtype, n in sorted(params["by_dtype"].items(), key=lambda kv: -kv[1]))
    tokenizer = info["tokenizer"] or f"not found: {info['tokenizer_error']}"
    normalization = info["normalization"] or f"not found: {info['normalization_error']}"
    lines = [
        f"checkpoint      {info['checkpoint']}",
        f"policy type     {info['policy_type']}",
        f"demo            {'yes (tiny, random weights)' if info['is_demo'] else 'no'}",
        f"parameters      {params['total']:,} used: {split} (serving dtype {info['dtype']})",
        f"cameras         {', '.join(info['cameras'])}",
        f"state dim       {info['state_dim']}",
        f"action dim      {info['action_dim']}",
        (f"action horizon  {info['action_horizon']} ({info['num_inference_steps']} denoising steps, "
         f"prompts of {info['max_token_len']} tokens)"),
        f"tokenizer       {tokenizer}",
        f"normalization   {normalization}",
        "",
        f"expected {info['device']} memory per profile (estimates; docs/memory.md)",
    ]
    memory = info["memory"]
    small, large = memory["batch_sizes"]
    engine = "graphs" if info["cuda_graphs"] else "eager"
    lines.append(f"{'profile':<11} {f'batch {small}':>10} {f'batch {large}':>10} {'host, pinned':>13} "
                 f"{f'{engine} at batch {large}':>18}")
    for name, p in memory["profiles"].items():
        first, second = p["estimates"]
        host = f"{first['host_pinned'] / gib:.2f} GiB" if first["host_pinned"] else "-"
        capped = "*" if second["batch_size"] < large else " "
        # The engine's share: the CUDA fast path's static buffers for every batch size 1..N and the
        # graphs' pool, or the eager model's K/V and activations.
        graphs = (second["kv_and_buffers"] + second["activations"] + second["graph_pool"]) / gib
        lines.append(f"{name:<11} {first['total'] / gib:>6.2f} GiB {second['total'] / gib:>6.2f} GiB{capped}"
                     f"{host:>13} {graphs:>14.2f} GiB")
    capped = [f"{name} runs batches of at most {p['max_graph_batch']}" for name, p in memory["profiles"].items()
              if p["max_graph_batch"] is not None and p["max_graph_batch"] < large]
    if capped:
        lines.append("* " + "; ".join(capped))
    limits = ", ".join(f"{name} {p['prefix_cache_entries']}" for name, p in memory["profiles"].items())
    lines.append(f"prefix cache (opt-in, not included): {memory['prefix_cache_entry_bytes'] / 2**20:.1f} MiB per "
                 f"entry; entries: {limits}")
    if info["cuda_graphs"]:
        default = memory["profiles"]["default"]["estimates"][1]
        lengths = ", ".join(map(str, memory["prompt_lengths"]))
        lines.append(f"graphs: the CUDA fast path's static buffers (batches 1..{large}) and the pool of its "
                     f"{default['graph_count']} CUDA graphs (default profile: prompt lengths {lengths}, each camera "
                     f"layout, RTC on and off), captured at startup; included in the totals and in the startup "
                     "memory check")
    else:
        lines.append(f"eager: on {info['device']} the eager model serves (no CUDA graphs); its prefix K/V and widest "
                     f"activations at batch {large}, included in the totals")
    return "\n".join(lines)


def info_command(cli: dict) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        info = checkpoint_info(cli["checkpoint"], cli["dtype"], cli["max_batch_size"], cli["tokenizer"], cli["demo"],
                               cli["device"])
    except (VlaserveError, OSError, UsageError) as e:
        log.error("%s", e)
        return 2
    print(json.dumps(info, indent=1) if cli["json"] else format_info(info))
    return 0
