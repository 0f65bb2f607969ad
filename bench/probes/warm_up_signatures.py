"""Which warm-ups of the default capture plan launch a Triton kernel no earlier one did (CPU, seconds).

    python bench/probes/warm_up_signatures.py

Full-size Pi0.5 on the meta device, ALOHA-3, the H200's launch table (sm90): each warm-up signature's
call, in plan order, runs with every Triton launch recorded instead of compiled (precompile.KernelRecorder,
through Triton's own binder, a stand-in driver answering for an sm_90 device), and the specializations it
adds to the ones recorded before are counted. A signature that adds none can be captured without its
warm-up (`--capture-warmups on_new_kernel`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from common import aloha_config, model_config  # noqa: E402
from vlaserve.config import RuntimeConfig, prompt_lengths  # noqa: E402
from vlaserve.checkpoint.weights import apply_dtype_policy  # noqa: E402
from vlaserve.family import family_of  # noqa: E402
from vlaserve.runtime.capture import capture_plan  # noqa: E402
from vlaserve.runtime.fast import kernels, targets  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402
from vlaserve.runtime.fast.launch_tables import use_launch_table  # noqa: E402
from vlaserve.runtime.fast.precompile import KernelRecorder, _TargetDriver  # noqa: E402


def main() -> None:
    driver.set_active(_TargetDriver(GPUTarget("cuda", 90, 32)))
    kernels.available = lambda: True  # the Triton path, recorded, never launched
    use_launch_table(targets.TARGETS[90])
    config, settings = aloha_config(model_config(False)), RuntimeConfig()
    family = family_of(config)
    with torch.device("meta"):
        model = apply_dtype_policy(family.build_model(config), torch.bfloat16, family.weights)
    runner = FastRunner(model, config, use_graphs=False)
    lengths = prompt_lengths(settings.resolved_prompt_buckets(config.max_token_len, "cuda"), config.max_token_len)
    plan = capture_plan(settings.graph_sizes, lengths, len(config.cameras))
    seen, signatures = set(), {}
    for key in plan:
        signature = runner._call_of(key, config.num_inference_steps)[2]
        if signature in signatures:
            continue
        recorder = KernelRecorder()
        with recorder.recording():
            runner._warm_up_call(key, config.num_inference_steps)()
        signatures[signature] = (len(recorder.recorded), len(recorder.recorded.keys() - seen))
        seen |= recorder.recorded.keys()
        print(signature, "kernels", *signatures[signature][:1], "new", signatures[signature][1], flush=True)
    print(f"{len(plan)} graphs, {len(signatures)} warm-up signatures, {sum(new == 0 for _, new in signatures.values())} "
          f"of them launch no new kernel; {len(seen)} specializations in all")


if __name__ == "__main__":
    main()
