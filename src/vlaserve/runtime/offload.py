"""The `offload` memory profile: the vision tower's and the VLM's layer matrices live in (pinned) host
memory and pass through two preallocated device slots per stack, one layer at a time, on every call.
A layer's 1-D parameters (norms, biases: 0.1% of its bytes) stay resident, so code that reads the next
layer's norm early (the fused kernels do) never finds it away.

Each layer's streamed parameters normally hold their host copy. Just before a layer runs (a forward pre-hook),
its parameters are re-pointed at the slot its weights were copied into, and the next layer's copy is
started into the other slot on a side stream, so copying overlaps the current layer's compute. The
previous layer goes back to its host copy at that moment, which is also when an event marks its
slot free for reuse (all of its kernels are queued by then). On a CPU device the "copy stream" is
the identity: copies happen in place, in order, and the arithmetic is exactly the eager model's.

Two users. The CUDA fast path (runtime/graphs.py) calls `enter(stack, i)` before it uses layer i, and
builds its fused weights inside `slot_views()`: layer i always runs from slot i % 2, so the fused Q/K/V
and gate/up matrices are fixed views of a slot (its members are packed adjacently) and the actions are
the resident fast path's, bit for bit. The eager model is entered through forward pre-hooks.

Hook points (the eager model is not edited): a SigLIP layer is called as a module, so its own
pre-hook fires first. `GemmaPrefixLM.prefix_kv` calls no Gemma layer as a module; the first module it
calls for each layer is `input_layernorm`, so that is where the VLM's pre-hook sits. The last layer
of a pass stays on its slot until the next pass puts it back.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..model.pi05 import Pi05Model

# Parameter-name prefixes of the streamed layers; everything else stays resident on the device.
STREAMED_PREFIXES = ("vision.layers.", "vlm.layers.")
# Byte alignment of each parameter inside a layer's flat buffer: what vector loads and TMA need. Real
# layer matrices are multiples of 256 bytes, so consecutive ones (Q, K, V) are packed without a gap.
ALIGN = 16


def streamed(name: str, shape) -> bool:
    """Whether parameter `name` (our naming) is streamed under offload: a vision or VLM layer's matrix."""
    return name.startswith(STREAMED_PREFIXES) and len(shape) >= 2


def _packed(params: list[nn.Parameter], buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of a flat uint8 `buffer` shaped and typed like `params`, packed in order at ALIGN bytes."""
    views, offset = [], 0
    for p in params:
        n = p.numel() * p.element_size()
        views.append(buffer[offset:offset + n].view(p.dtype).view(p.shape))
        offset += -(-n // ALIGN) * ALIGN
    return views


def _packed_size(params: list[nn.Parameter]) -> int:
    return sum(-(-(p.numel() * p.element_size()) // ALIGN) * ALIGN for p in params)


class _LayerStack:
    """One stack of identically shaped layers: each layer's weights in one flat host buffer (pinned
    when the device is CUDA, so copies are asynchronous), and two flat device slots."""

    def __init__(self, layers: nn.ModuleList, device: torch.device, copy_stream):
        self.layers = layers
        self.device = device
        self.copy_stream = copy_stream  # None on a CPU device
        self.params = [[p for p in layer.parameters() if p.dim() >= 2] for layer in layers]
        shapes = [[(p.shape, p.dtype) for p in ps] for ps in self.params]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("offload needs the layers of a stack to have identical parameter shapes")
        self.layer_bytes = _packed_size(self.params[0])
        pin = device.type == "cuda"
        self.host = []  # per layer: (flat buffer, parameter views)
        for ps in self.params:
            flat = torch.empty(self.layer_bytes, dtype=torch.uint8, pin_memory=pin)
            views = _packed(ps, flat)
            for p, view in zip(ps, views):
                view.copy_(p.data)
                p.data = view  # the layer's previous storage (device or host) is freed here
            self.host.append((flat, views))
        self.slots = []
        for _ in range(2):
            flat = torch.empty(self.layer_bytes, dtype=torch.uint8, device=device)
            self.slots.append((flat, _packed(self.params[0], flat)))
        self.resident: list[int | None] = [None, None]  # layer whose weights each slot holds
        self.loaded: list = [None, None]  # per slot: event after its last copy (CUDA)
        self.free: list = [None, None]  # per slot: event after the last kernel that read it (CUDA)
        self.active: int | None = None  # layer whose parameters point at its slot now
        self.next_stack: _LayerStack | None = None  # prefetched when this stack's last layer starts
        self.bytes_copied = 0

    def load(self, i: int) -> None:
        """Starts copying layer i into its slot (a no-op if the slot still holds it)."""
        s = i % 2
        if self.resident[s] == i:
            return
        if self.active is not None and self.active % 2 == s:
            self._deactivate()
        if self.copy_stream is None:
            self.slots[s][0].copy_(self.host[i][0])
        else:
            with torch.cuda.stream(self.copy_stream):
                if self.free[s] is not None:
                    self.copy_stream.wait_event(self.free[s])
                self.slots[s][0].copy_(self.host[i][0], non_blocking=True)
                self.loaded[s] = torch.cuda.Event()
                self.loaded[s].record(self.copy_stream)
        self.resident[s] = i
        self.bytes_copied += self.layer_bytes

    def enter(self, i: int) -> None:
        """Layer i is about to run: put its weights in place and prefetch what runs after it."""
        if self.active == i:
            return
        if self.active is not None:
            self._deactivate()
        self.load(i)
        s = i % 2
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[s])
        for p, view in zip(self.params[i], self.slots[s][1]):
            p.data = view
        self.active = i
        if i + 1 < len(self.layers):
            self.load(i + 1)
        elif self.next_stack is not None:
            self.next_stack.load(0)

    def point_at_slots(self) -> None:
        """Each layer's parameters at the views of its slot (layer i: slot i % 2); no data moves."""
        for i, ps in enumerate(self.params):
            for p, view in zip(ps, self.slots[i % 2][1]):
                p.data = view

    def point_at_host(self) -> None:
        for i, ps in enumerate(self.params):
            for p, view in zip(ps, self.host[i][1]):
                p.data = view

    def _deactivate(self) -> None:
        i = self.active
        if self.copy_stream is not None:
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            self.free[i % 2] = freed
        for p, view in zip(self.params[i], self.host[i][1]):
            p.data = view
        self.active = None


class LayerOffload:
    """Streams the matrices of `model.vision.layers` and `model.vlm.layers` to `device`; moves the rest there."""

    def __init__(self, model: Pi05Model, device: torch.device):
        device = torch.device(device)
        for name, p in model.named_parameters():
            if not streamed(name, p.shape):
                p.data = p.data.to(device)
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.vision = _LayerStack(model.vision.layers, device, copy_stream)
        self.vlm = _LayerStack(model.vlm.layers, device, copy_stream)
        # The VLM's first layer copies while the vision tower's last layer runs.
        self.vision.next_stack = self.vlm
        for i, layer in enumerate(model.vision.layers):
            layer.register_forward_pre_hook(self._enter_hook(self.vision, i))
        for i, layer in enumerate(model.vlm.layers):
            layer.input_layernorm.register_forward_pre_hook(self._enter_hook(self.vlm, i))

    def enter(self, stack: str, i: int) -> None:
        """Layer i of stack "vision" or "vlm" is about to run (the fast path's entry point)."""
        (self.vision if stack == "vision" else self.vlm).enter(i)

    @contextmanager
    def slot_views(self):
        """While inside, every streamed parameter is its slot's view (contents undefined): for
        building tensors that must alias the slots, such as the fast path's fused weights."""
        for stack in (self.vision, self.vlm):
            if stack.active is not None:  # a finished call's last layer: its slot stays loaded
                stack._deactivate()
            stack.point_at_slots()
        try:
            yield
        finally:
            for stack in (self.vision, self.vlm):
                stack.point_at_host()

    @staticmethod
    def _enter_hook(stack: _LayerStack, i: int):
        def hook(module, args):
            stack.enter(i)

        return hook

    @property
    def bytes_copied(self) -> int:
        """Host-to-device weight bytes copied so far (a layer still in its slot is not copied again)."""
        return self.vision.bytes_copied + self.vlm.bytes_copied

    @property
    def slot_bytes(self) -> int:
        return 2 * (self.vision.layer_bytes + self.vlm.layer_bytes)
