"""A checkpoint read for an in-place weight update (Policy.update_weights): its tensors checked against the
served model's (names, shapes, stored dtypes) from the headers, then every one read in full into host memory
before the caller copies any of them.

The reads are plain file reads, not a mapping: a file that is cut short while it is read (a trainer still
writing it) gives a short read, which is refused, where a mapped page past the new end would kill the
process (SIGBUS)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, WeightUpdateRefused
from .files import checkpoint_files
from .weights import StoredTensor, WeightLayout, _by_file, check_weights, read_header


def stored_dtypes(sources: dict[str, tuple[Path, str]]) -> dict[str, torch.dtype]:
    """Our parameter name -> the dtype its checkpoint stores it in (`check_weights`' answer, headers only)."""
    headers: dict[Path, dict[str, StoredTensor]] = {}
    out = {}
    for ours, (path, key) in sources.items():
        if path not in headers:
            headers[path] = read_header(path)
        out[ours] = headers[path][key].dtype
    return out


def check_update(model: nn.Module, directory: Path, layout: WeightLayout,
                 served_dtypes: dict[str, torch.dtype]) -> dict[str, tuple[Path, str]]:
    """The checkpoint's weights checked against `model` and the dtypes the served checkpoint stores them in,
    from the headers alone -> our name -> (file, key), as `check_weights`. Refused (WeightUpdateRefused) with
    the reason: a weight file missing, a header unreadable or not matching its file's size (truncated), a
    tensor missing, unexpected or of another shape or stored dtype."""
    try:
        files = checkpoint_files(directory)
    except CheckpointError as e:
        raise WeightUpdateRefused("not_found", str(e)) from None
    try:
        headers = {path: read_header(path) for path in files}
    except CheckpointError as e:
        raise WeightUpdateRefused("unreadable", str(e)) from None
    try:
        sources = check_weights(model, directory, layout)
    except CheckpointError as e:
        raise WeightUpdateRefused("mismatch", str(e)) from None
    other = [f"{key}: {str(headers[path][key].dtype).removeprefix('torch.')} (served: "
             f"{str(served_dtypes[ours]).removeprefix('torch.')})"
             for ours, (path, key) in sorted(sources.items()) if headers[path][key].dtype != served_dtypes[ours]]
    if other:
        more = f" … and {len(other) - 12} more" if len(other) > 12 else ""
        raise WeightUpdateRefused("mismatch", f"{directory}: tensors stored in another dtype than the served "
                                              f"checkpoint's: {'; '.join(other[:12])}{more}")
    return sources


def read_tensors(sources: dict[str, tuple[Path, str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, host tensor in its stored dtype) for each of `check_update`'s sources, each read in full with
    plain reads, file by file in file order; a short read (the file changed since its header was read) is
    refused as "unreadable"."""
    for path, items in _by_file(sources).items():
        try:
            index = read_header(path)
            with open(path, "rb", buffering=0) as f:
                for ours, key in sorted(items, key=lambda item: index[item[1]].begin):
                    stored = index[key]
                    data = torch.empty(stored.end - stored.begin, dtype=torch.uint8)
                    f.seek(stored.begin)
                    got = _read_into(f, memoryview(data.numpy()))
                    if got != data.numel():
                        raise WeightUpdateRefused("unreadable", f"{path}: {key} is truncated: {got} of "
                                                                f"{data.numel()} bytes could be read")
                    yield ours, data.view(stored.dtype).reshape(stored.shape)
        except (CheckpointError, OSError) as e:
            raise WeightUpdateRefused("unreadable", f"{path}: {e}") from None


def _read_into(f, buffer: memoryview) -> int:
    """Fills `buffer` from `f`'s position -> the bytes read: fewer only at the file's end (one read(2) moves at
    most ~2 GiB, so a large tensor takes several)."""
    done = 0
    while done < len(buffer):
        n = f.readinto(buffer[done:])
        if not n:
            break
        done += n
    return done
