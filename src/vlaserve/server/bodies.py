"""Reading and decoding request bodies and websocket frames: bounded in size and time, decoded
where decoding can't stall the event loop (server.workers)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from .codec import JSON_MEDIA_TYPE, DecodeError, OverBudget, is_msgpack, loads_json, media_type, unpackb
from .schema import ApiError
from .workers import Workers

# Decoding in place is cheaper than a hop to a worker while a body is small. A JSON body costs per
# byte; a msgpack body per object, not per byte (ndarrays are views of the payload: a 3-camera body
# is a handful of objects, where nested int lists are millions). So msgpack decodes in place up to
# 1 MiB and 1,024 maps and lists, else (stopping early) in a thread (bench_prepare.py measures both).
INLINE_JSON_BYTES = 64 * 1024
INLINE_MSGPACK_BYTES = 2**20
INLINE_MSGPACK_CONTAINERS = 1024

# How much of a body over the payload limit is read (and discarded) before its 413, in payload limits.
DRAIN_FACTOR = 4


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or 413 past `limit` bytes, or 408 when it takes longer than `timeout_s`
    (a client that sends a body slowly, or stops half-way, would otherwise hold its slot forever).

    A body over the limit is read to its end and discarded before the 413, as long as it stays
    within DRAIN_FACTOR limits: most HTTP clients (urllib, requests, httpx) upload the whole body
    before reading anything, and a connection closed under their upload resets, losing the answer.
    Past that bound the 413 goes out at once and the client may see a reset instead."""
    too_large = ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes (--max-payload-mb)")
    drain_limit = DRAIN_FACTOR * limit
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > drain_limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            async for chunk in request.stream():
                if size <= limit < size + len(chunk):  # from here on, discarding: a fresh timeout for that
                    deadline.reschedule(asyncio.get_running_loop().time() + timeout_s)
                    chunks.clear()
                size += len(chunk)
                if size > drain_limit:
                    raise too_large
                if size <= limit:
                    chunks.append(chunk)
    except TimeoutError:
        if size > limit:
            raise too_large from None
        raise ApiError(408, "request_timeout", f"the request body took longer than {timeout_s:g} s "
                                               "(--body-timeout-s)") from None
    if size > limit:
        raise too_large
    return b"".join(chunks)


def body_format(content_type: str | None) -> str:
    """"json" or "msgpack" from an exact media type; no Content-Type means JSON. Anything else is
    refused: browsers send text/plain, forms and multipart cross-site without a CORS preflight."""
    if is_msgpack(content_type):
        return "msgpack"
    if content_type is None or media_type(content_type) == JSON_MEDIA_TYPE:
        return "json"
    raise ApiError(415, "unsupported_media_type",
                   f"send application/json or application/msgpack, not {content_type!r}")


# What decode_in_place returns for a payload it leaves to a thread.
NOT_IN_PLACE = object()


async def decode(payload: bytes, fmt: str, workers: Workers):
    """The decoded, bounded body (codec); 400 when it does not decode."""
    try:
        if fmt == "json":
            if len(payload) <= INLINE_JSON_BYTES:
                return loads_json(payload)
            return await workers.in_process(loads_json, payload)
        body = decode_in_place(payload)
        return await workers.in_thread(unpackb, payload) if body is NOT_IN_PLACE else body
    except DecodeError as e:
        raise ApiError(400, f"invalid_{fmt}", str(e)) from None


def decode_in_place(payload: bytes):
    """A msgpack payload decoded here, on the calling thread, if it is cheap to (see above); else
    NOT_IN_PLACE. Raises DecodeError."""
    if len(payload) > INLINE_MSGPACK_BYTES:
        return NOT_IN_PLACE
    try:
        return unpackb(payload, INLINE_MSGPACK_CONTAINERS)
    except OverBudget:
        return NOT_IN_PLACE
