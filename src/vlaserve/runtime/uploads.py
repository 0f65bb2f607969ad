"""Camera frames sent to the device as soon as a request's images have passed their checks.

A robot's observation carries 0.45 MB of raw frames (3 cameras of 224x224). Copied up in the launch
(`processing.prepare.into_buffers`), from pageable memory, they held the host for most of the half
millisecond a lone robot's device waited before its prefix started (performance.md, "A lone robot's
host time"). Here they go up on a thread and a CUDA stream of their own while the thread that prepares
the request goes on with its state, prompt and noise, the batcher and the launch; the launch then
only orders its stream after the upload. A request queued behind a running batch has its frames on
the device before its batch is formed. The bytes are the same, so the model's inputs are too.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..processing.images import stacked_frames


class Upload:
    """One request's camera slots on their way to the device; `slots` are the host views they left from
    (a batch that runs from host memory stacks them: processing.prepare.host_images)."""

    def __init__(self, slots: list[torch.Tensor], future: Future):
        self.slots, self._future = slots, future

    def frames(self) -> torch.Tensor:
        """The slots on the device, [N, 3, S, S] uint8, once the copies are enqueued; the calling thread's
        current stream is ordered after them (and the memory held until that stream is past its use)."""
        frames, copied = self._future.result()
        if copied is not None:
            stream = torch.cuda.current_stream(frames.device)
            stream.wait_event(copied)
            frames.record_stream(stream)
        return frames


class FrameUploads:
    """Uploads camera slots (uint8 [3, S, S] views of the frames as they arrived) to `device`, one
    request after another, on one thread; on CUDA on a stream of its own, so a copy never waits for
    the batch running on the serving stream.

    At most `max_held` requests' frames are held on the device at once (uploaded, or on their way, and
    not yet dropped with their request): past that, `submit` declines and the request's frames go up in
    its launch as without uploads, so a backlog of queued requests never grows device memory."""

    # Four batches of the largest size: a lone robot's frames (0.45 MB at 3 x 224 x 224) and a full
    # batch queued behind a running one are far below it. At most 14 MB of frames at 3 x 224 x 224: inside
    # the margin the startup memory check keeps over the measured peak (runtime/memory.py, HEADROOM_BYTES).
    MAX_HELD = 32

    def __init__(self, device: torch.device, max_held: int = MAX_HELD):
        self.device, self.max_held = device, max_held
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vlaserve-upload")
        self._lock = threading.Lock()
        self.held = 0
        self.uploads = 0  # requests whose frames were sent ahead
        self.declined = 0  # requests that found `max_held` held and went the launch's way

    def submit(self, slots: list[torch.Tensor]) -> Upload | None:
        """Starts the upload of one request's slots -> its Upload, or None when `max_held` are held."""
        with self._lock:
            if self.held >= self.max_held:
                self.declined += 1
                return None
            self.held += 1
            self.uploads += 1
        upload = Upload(slots, self._thread.submit(self._upload, slots))
        weakref.finalize(upload, self._release)  # its device memory goes with it (and its request)
        return upload

    def _release(self) -> None:
        with self._lock:
            self.held -= 1

    def stats(self) -> dict:
        with self._lock:
            return {"uploads": self.uploads, "held": self.held, "declined": self.declined}

    def _upload(self, slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self._stream is None:
            return stacked_frames(slots, self.device), None
        with torch.cuda.stream(self._stream):
            frames = stacked_frames(slots, self.device)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return frames, copied

