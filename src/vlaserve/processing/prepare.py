"""Request -> PreparedObservation -> ModelInputs, and model actions -> robot actions.

Everything here depends on the checkpoint (cameras, dims, normalization, tokenizer); value checks
happened when the Request was built (vlaserve.types). Each request is prepared once, on whichever
thread validates it, and the batch is only stacked afterwards.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ..config import PolicyConfig, prompt_lengths
from ..errors import InvalidObservation, InvalidRequest
from ..types import EncodedImage, ModelInputs, PreparedObservation, PreparedRtc, Request, RTCGuidance, RtcOptions
from .encoded import decode_image
from .images import bytes_to_model_range, empty_image, place_frames, prepare_image
from .pipeline import ProcessorPipeline
from .prompt import PromptTokenizer

log = logging.getLogger(__name__)


class Preprocessor:
    """`family` (vlaserve.family.Family) says how the state reaches the model: in the prompt, or as a
    model input of its own."""

    def __init__(self, config: PolicyConfig, pipeline: ProcessorPipeline, tokenizer: PromptTokenizer,
                 family, prompt_buckets: tuple[int, ...] = (), defer_resize: bool = False, weight_version: int = 0):
        self.config, self.pipeline, self.tokenizer, self.family = config, pipeline, tokenizer, family
        self.weight_version = weight_version  # of the weights whose statistics these are (Policy.update_weights)
        # Frames of another size than the model's are resized where the batch runs (on a GPU: ~2 ms
        # of host time per 480x640 frame saved); without it (a CPU device) here, during prepare,
        # which the server runs on its worker threads.
        self.defer_resize = defer_resize
        self.normalization = pipeline.normalization
        self.state_norm = pipeline.state_normalizer.cut(config.state_dim)
        self.action_norm = pipeline.action_unnormalizer.cut(config.action_dim)
        if prompt_buckets and not 1 <= prompt_buckets[0] <= prompt_buckets[-1] <= config.max_token_len:
            raise ValueError(f"prompt buckets must lie in [1, {config.max_token_len}]")
        # Pad prompts only to the smallest bucket that holds the batch's longest prompt (buckets
        # resolved by RuntimeConfig.resolved_prompt_buckets). Padding is masked, so actions change
        # only by float reassociation.
        self.prompt_buckets = prompt_lengths(prompt_buckets, config.max_token_len) if prompt_buckets else ()
        if not family.state_to_model:  # the state goes into the prompt: its token pieces are ready before a frame
            tokenizer.state_words()

    @property
    def noise_shape(self) -> tuple[int, int]:
        return self.config.action_horizon, self.config.model.max_action_dim

    def prepare(self, request: Request) -> PreparedObservation:
        """Checks the request against this checkpoint and preprocesses it (once: the result is kept
        on the request; again only when other weights' statistics prepared it)."""
        if request.prepared is not None and request.prepared.weight_version == self.weight_version:
            return request.prepared
        c, obs = self.config, request.observation
        unknown = [k for k in obs.images if k not in c.cameras]
        if unknown:
            raise InvalidObservation(f"images.{unknown[0]}", f"unknown camera; this policy takes {list(c.cameras)}")
        if obs.state.shape != (c.state_dim,):
            raise InvalidObservation("state", f"expected shape [{c.state_dim}], got {list(obs.state.shape)}")
        present = [cam for cam in c.cameras if cam in obs.images]
        if not present:
            raise InvalidObservation("images", "at least one camera image is required")
        resolution = c.image_resolution[0]
        # The reference's slot order: present cameras in config order, then the absent ones.
        slot_cameras = present + [cam for cam in c.cameras if cam not in present]
        slots = [prepare_image(_pixels(obs.images[cam], f"images.{cam}"), resolution, f"images.{cam}",
                               obs.images_normalized, keep_bytes=True, defer_resize=self.defer_resize)
                 for cam in present]
        # Frames left unresized (defer_resize) are finished on the device; their slots hold the blank.
        pending = [(i, s) for i, s in enumerate(slots) if s.shape[1:] != (resolution, resolution)]
        bytes_only = all(s.dtype == torch.uint8 for s in slots)
        if not bytes_only:
            slots = [bytes_to_model_range(s) if s.dtype == torch.uint8 and s.shape[1:] == (resolution, resolution)
                     else s for s in slots]
        absent = len(c.cameras) - len(present)
        if pending or absent:  # byte 0 is -1 in the model's range, like empty_image
            blank = (torch.zeros(resolution, resolution, 3, dtype=torch.uint8).permute(2, 0, 1) if bytes_only
                     else empty_image(resolution))
            for i, _ in pending:
                slots[i] = blank
            slots += [blank] * absent

        normalized_state = self.state_norm.normalize(obs.state)
        prompt, bins = self.family.prompt(obs.task, normalized_state)
        # A prompt with state bins is Pi0.5's template: tokenized from cached pieces (the same ids).
        tokenized = (self.tokenizer(prompt, c.max_token_len) if bins is None
                     else self.tokenizer.state_prompt(obs.task, bins, c.max_token_len))
        request.prepared = PreparedObservation(
            images=_stacked_frames(slots), image_mask=torch.tensor([cam in present for cam in slot_cameras]),
            slot_cameras=slot_cameras, tokens=torch.from_numpy(tokenized.ids),
            token_mask=torch.from_numpy(tokenized.mask), normalized_state=normalized_state, state_bins=bins,
            prompt=prompt, truncated=tokenized.truncated, noise=self._noise(request),
            rtc=None if request.rtc is None else self._rtc(request.rtc), pending=tuple(pending),
            weight_version=self.weight_version)
        return request.prepared

    def is_light(self, request: Request) -> bool:
        """Whether preparing `request` costs the host only a fraction of a millisecond: every frame raw
        bytes (uint8), none to
        decode (PNG, JPEG) or resize on the host."""
        side = self.config.image_resolution[0]
        return all(isinstance(image, np.ndarray) and image.dtype == np.uint8
                   and (self.defer_resize or (side, side) in (image.shape[:2], image.shape[1:]))
                   for image in request.observation.images.values())

    def _noise(self, request: Request) -> torch.Tensor:
        shape = self.noise_shape
        if request.noise is not None:
            if request.noise.shape != shape:
                raise InvalidRequest("noise", f"expected shape {list(shape)}, got {list(request.noise.shape)}")
            return torch.from_numpy(request.noise)
        generator = None if request.seed is None else torch.Generator().manual_seed(request.seed)
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    def _rtc(self, rtc: RtcOptions) -> PreparedRtc:
        h, a = self.noise_shape
        chunk = rtc.prev_chunk
        # Action-space chunks carry the robot's dims; model-space ones any prefix of the padded dims
        # (LeRobot's left-over has only the robot's dims and is zero-padded).
        width = self.config.action_dim if rtc.space == "action" else a
        if not 1 <= chunk.shape[0] <= h or not 1 <= chunk.shape[1] <= width or (
                rtc.space == "action" and chunk.shape[1] != width):
            dims = f"D = {width}" if rtc.space == "action" else f"1 <= D <= {width}"
            raise InvalidRequest("rtc.prev_chunk", f"must have shape [T, D] with 1 <= T <= {h} and {dims} "
                                                   f"for space {rtc.space!r}, got {list(chunk.shape)}")
        for name in ("inference_delay", "execution_horizon"):
            if getattr(rtc, name) > h:
                raise InvalidRequest(f"rtc.{name}", f"at most the action horizon, {h}")
        if rtc.space == "action" and self.pipeline.relative_actions is not None:
            raise InvalidRequest("rtc.space", "action-space chunks of a relative-actions checkpoint need "
                                              "re-anchoring to the state; send the model-space chunk")
        if rtc.space == "action":
            chunk = self.action_norm.normalize(chunk)
        prev = torch.zeros(h, a)
        prev[: chunk.shape[0], : chunk.shape[1]] = torch.from_numpy(chunk)
        weights = rtc_prefix_weights(rtc.inference_delay, min(rtc.execution_horizon, chunk.shape[0]), h, rtc.schedule)
        return PreparedRtc(prev, weights, rtc.max_guidance_weight)

    def collate(self, requests: list[Request]) -> tuple[ModelInputs, torch.Tensor, RTCGuidance | None]:
        """The batch's model inputs (host), noise [B, H, A] and RTC guidance (None when no item has RTC)."""
        prepared = [self.prepare(r) for r in requests]
        images = [p.images for p in prepared]
        if len({im.dtype for im in images}) > 1:  # bytes and floats in one batch: floats for all
            images = [model_images(p) for p in prepared]  # (pending frames finished here, on the host)
            pending = ()
        else:
            pending = tuple((i, slot, frame) for i, p in enumerate(prepared) for slot, frame in p.pending)
        tokens = _batched([p.tokens for p in prepared])
        token_mask = _batched([p.token_mask for p in prepared])
        if self.prompt_buckets:
            longest = int(token_mask.sum(1).max())
            length = next(b for b in self.prompt_buckets if b >= longest)
            tokens, token_mask = tokens[:, :length].contiguous(), token_mask[:, :length].contiguous()
        state = None
        if self.family.state_to_model:  # zero-padded after normalization, as the reference
            state = torch.zeros(len(prepared), self.config.max_state_dim)
            state[:, : self.config.state_dim] = torch.from_numpy(np.stack([p.normalized_state for p in prepared]))
        # (Not stacked into pinned memory for one DMA up: that made this stack several times slower.)
        inputs = ModelInputs(_batched_frames(images), _batched([p.image_mask for p in prepared]), tokens,
                             token_mask, state, pending)
        noise = _batched([p.noise for p in prepared])
        rtc = None
        if any(p.rtc is not None for p in prepared):
            h, a = self.noise_shape
            # Items without RTC get zero weights, which leaves them unguided exactly.
            prev = torch.stack([torch.zeros(h, a) if p.rtc is None else p.rtc.prev for p in prepared])
            weights = torch.stack([torch.zeros(h) if p.rtc is None else p.rtc.weights for p in prepared])
            max_weight = torch.tensor([0.0 if p.rtc is None else p.rtc.max_weight for p in prepared])
            rtc = RTCGuidance(prev, weights, max_weight)
        return inputs, noise, rtc

    def postprocess(self, model_actions: np.ndarray, requests: list[Request]) -> np.ndarray:
        """Model-space actions [B, H, max_action_dim] -> the robot's actions [B, H, action_dim]:
        un-normalized, and made absolute for relative-actions checkpoints (offsets from each raw state)."""
        actions = self.action_norm.unnormalize(model_actions[..., : self.config.action_dim])
        if self.pipeline.relative_actions is None:
            return actions
        return self.pipeline.to_absolute(actions, np.stack([r.observation.state for r in requests]))


def _pixels(image, field: str):
    """A PNG or JPEG is decoded here, on the thread that prepares the request (the server's workers)."""
    return decode_image(image, field) if isinstance(image, EncodedImage) else image


def model_images(prepared: PreparedObservation) -> torch.Tensor:
    """[N, 3, S, S] float32 in [-1, 1], pending resizes done here (on the host)."""
    images = place_frames(prepared.images, prepared.pending) if prepared.pending else prepared.images
    return bytes_to_model_range(images) if images.dtype == torch.uint8 else images


def _stacked_frames(slots: list[torch.Tensor]) -> torch.Tensor:
    """The camera slots [3, S, S] as one [N, 3, S, S] tensor. Cameras send channels-last (HWC)
    frames, which reach here as channels-first views: stacked as they lie (a plain copy per frame)
    and viewed channels-first, they are put in channels-first order on the device (runtime/transfer.py);
    a stack in channels-first order transposes on the host, an order of magnitude slower."""
    channels_last = [s.permute(1, 2, 0) for s in slots]
    if all(s.is_contiguous() for s in channels_last):
        return torch.stack(channels_last).permute(0, 3, 1, 2)
    return torch.stack(slots)


def _batched_frames(images: list[torch.Tensor]) -> torch.Tensor:
    """The items' camera slots [N, 3, S, S] as one [B, N, 3, S, S] tensor. Stacked as they lie where every
    item's frames are channels-last (`_stacked_frames`): the same tensor, strides included, as a stack of
    the channels-first views, but made by plain copies (a fraction of the transposing stack's time)."""
    channels_last = [im.permute(0, 2, 3, 1) for im in images]
    if len(images) > 1 and all(im.is_contiguous() for im in channels_last):
        return torch.stack(channels_last).permute(0, 1, 4, 2, 3)
    return _batched(images)


def _batched(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors stacked on a new batch dimension; one alone is a view, not copied: a lone robot's
    request is where host time shows, and a fresh image stack costs a fraction of a millisecond on a CPU
    that has been idle. Nothing downstream writes into model inputs."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def rtc_prefix_weights(inference_delay: int, execution_horizon: int, horizon: int, schedule: str = "linear"):
    """Per-timestep guidance weights [horizon] (the reference's prefix attention schedule)."""
    start, end = min(inference_delay, execution_horizon), execution_horizon
    w = torch.zeros(horizon)
    if schedule == "zeros":
        w[:start] = 1.0
        return w
    if schedule == "ones":
        w[:end] = 1.0
        return w
    if schedule not in ("linear", "exp"):
        raise ValueError(f"unknown RTC schedule {schedule!r} (linear, exp, ones, zeros)")
    n = min(end, horizon) - start
    ramp = torch.linspace(1, 0, n + 2)[1:-1] if end > start and n > 0 else torch.zeros(0)
    if schedule == "exp":
        ramp = ramp * torch.expm1(ramp).div(math.e - 1)
    w[start : start + len(ramp)] = ramp
    w[: min(start, horizon)] = 1.0
    return w
