"""A checkpoint on disk: where it is, which safetensors files make it, and reading them ahead.

Standard library only, so that `vlaserve serve` can start pulling the weights into the page cache
before it spends ~5 s importing torch and the server: on a cold disk that overlap is most of
the difference between a ~20 s and a ~14 s restart (docs/memory.md).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path

from ..errors import CheckpointError

log = logging.getLogger(__name__)


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local directory, or a Hugging Face hub id fetched through huggingface_hub."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"checkpoint {text!r} is not a directory (nor a hub id of the form owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "assets/**"]))
    except Exception as e:  # offline, gated, unknown repo: all end here with the reason
        raise CheckpointError(f"could not fetch {text!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
                              "Offline? Download it elsewhere and pass the local directory.") from None


def checkpoint_files(checkpoint_dir: Path) -> list[Path]:
    single = checkpoint_dir / "model.safetensors"
    if single.exists():
        return [single]
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (checkpoint_dir / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {missing}")
        return [checkpoint_dir / s for s in shards]
    shards = sorted(checkpoint_dir.glob("*.safetensors"))
    shards = [s for s in shards if "processor" not in s.name]
    if not shards:
        raise CheckpointError(f"{checkpoint_dir} holds no model.safetensors (or shards + index)")
    return shards


# safetensors: each file mapped and read in ranges, with the read-ahead `vlaserve serve` starts before its imports.
# runai-streamer: runai-model-streamer's parallel reads; on a local disk no faster (docs/memory.md)
# and it bypasses the page cache, so it is opt-in.
WEIGHT_LOADERS = ("safetensors", "runai-streamer")


def check_weight_loader(loader: str) -> str:
    if loader not in WEIGHT_LOADERS:
        raise CheckpointError(f"weight loader {loader!r} is not known (choose from {', '.join(WEIGHT_LOADERS)})")
    if loader == "runai-streamer" and importlib.util.find_spec("runai_model_streamer") is None:
        raise CheckpointError("weight loader 'runai-streamer' needs the runai-model-streamer package "
                              "(pip install runai-model-streamer), or use --weights-loader safetensors")
    return loader


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ReadAhead:
    """Reads files once, in parallel chunks, on daemon threads, so that a later mmap of them (the
    safetensors loader) finds their pages cached. Several reads in flight keep an NVMe queue busy
    where one thread's page faults do not; the reads release the GIL, so imports go on meanwhile.

    Nothing depends on it finishing: a loader that gets ahead of it reads the remaining pages
    itself. Failures are logged and ignored for the same reason."""

    CHUNK_BYTES = 16 * 2**20
    # A cold NVMe disk reads fastest with many requests in flight, and 16 reached the ceiling that 64
    # O_DIRECT readers did (docs/memory.md). Idle threads cost nothing on a smaller host.
    THREADS = 16

    def __init__(self, files: list[Path], threads: int = THREADS):
        sizes = {Path(f): Path(f).stat().st_size for f in files}
        self.total_bytes = sum(sizes.values())
        self.bytes_read = 0
        self.seconds: float | None = None  # set when done
        self.error: str | None = None
        self._chunks = [(f, offset) for f, size in sizes.items() for offset in range(0, size, self.CHUNK_BYTES)]
        self._next = 0
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._workers = [threading.Thread(target=self._work, name=f"vlaserve-readahead-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for worker in self._workers:
            worker.start()
        self._reporter = threading.Thread(target=self._report, name="vlaserve-readahead", daemon=True)
        self._reporter.start()

    def _take(self):
        with self._lock:
            if self._next >= len(self._chunks) or self.error:
                return None
            chunk = self._chunks[self._next]
            self._next += 1
            return chunk

    def _work(self) -> None:
        buffer = bytearray(self.CHUNK_BYTES)
        fds: dict[Path, int] = {}
        try:
            while (chunk := self._take()) is not None:
                path, offset = chunk
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                n = os.preadv(fds[path], [buffer], offset)
                with self._lock:
                    self.bytes_read += n
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            for fd in fds.values():
                os.close(fd)

    def _report(self) -> None:
        for worker in self._workers:
            worker.join()
        self.seconds = time.perf_counter() - self._started
        if self.error:
            log.warning("reading the checkpoint ahead stopped (%s); loading reads it directly", self.error)
        else:
            log.info("read %.2f GB of weights ahead in %.2f s (%.2f GB/s)", self.bytes_read / 1e9, self.seconds,
                     self.bytes_read / 1e9 / max(self.seconds, 1e-9))

    def wait(self, timeout: float | None = None) -> bool:
        self._reporter.join(timeout)
        return not self._reporter.is_alive()


def read_ahead(checkpoint_dir: Path, threads: int = ReadAhead.THREADS,
               max_fraction_of_free_memory: float = 0.5) -> ReadAhead | None:
    """Starts a ReadAhead of the checkpoint's weight files, unless they would take more than
    `max_fraction_of_free_memory` of the host's available memory (then the cached pages would
    only push each other, or the serving process, out)."""
    files = checkpoint_files(checkpoint_dir)
    total = sum(f.stat().st_size for f in files)
    free = available_memory_bytes()
    if free is not None and total > max_fraction_of_free_memory * free:
        log.info("not reading the checkpoint ahead: %.2f GB of weights, %.2f GB of host memory available",
                 total / 1e9, free / 1e9)
        return None
    return ReadAhead(files, threads)
