"""FlashAttention-4 (CuTe DSL) for the prefix's attention: `--attention-library fa4`.

The prefix's 8 query heads share one K/V head (head_dim 256), and every item's valid keys are the
first rows of its cache (FastPi05.prefix), so FA4 reads them as a key length (`seqused_k`) with
no mask tensor, q through a strided view of our head-major layout, and writes o_proj's layout. It
runs the prefix's attention faster than our kernel with the same error against fp32 math
(docs/performance.md). The expert's attention (50 queries a head) stays on our Triton kernel: FA4
has no key splits on sm90. Needs `pip install -e '.[cute]'` and an sm90 / sm100 GPU; its
kernels compile on first use (the warm-up).
"""

from __future__ import annotations

import torch

from . import cute

PINNED = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}  # a beta: the version we measured


def require(device: torch.device) -> None:
    """Raises ConfigError unless the pinned FA4 and CUTLASS DSL are installed and `device` is sm90 / sm100."""
    cute.require_pinned("attention_library 'fa4'", PINNED, device, "--attention-library triton")


def prefix_attention(q, k_cache, v_cache, valid_keys, num_heads: int, tokens: int) -> torch.Tensor:
    """q [B, num_heads * tokens, D] (head-major), k/v [B, T, D] (any item stride) whose first
    valid_keys[b] rows are item b's keys -> [B, tokens, num_heads * D], as kernels.mqa_attention."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    b, _, d = q.shape
    out, _ = flash_attn_varlen_func(q.view(b, num_heads, tokens, d).transpose(1, 2), k_cache.unsqueeze(2),
                                    v_cache.unsqueeze(2), seqused_k=valid_keys, softmax_scale=d**-0.5)
    return out.view(b, tokens, num_heads * d)
