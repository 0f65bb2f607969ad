"""Weight loading: both loaders give the same tensors, clear loader errors, reading the checkpoint ahead."""

import logging

import pytest
import torch

from vlaserve import CheckpointError, Policy
from vlaserve.checkpoint import files as files_module
from vlaserve.cli import read_checkpoint_ahead
from vlaserve.options import UsageError, serve_options
from vlaserve.checkpoint.files import ReadAhead, check_weight_loader, checkpoint_files, read_ahead


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runai_streamer_and_safetensors_load_identical_tensors(golden, dtype):
    pytest.importorskip("runai_model_streamer")  # a test extra: installed by the README test command
    loaded = {loader: Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype=dtype, progress=False,
                                             weights_loader=loader) for loader in ("safetensors", "runai-streamer")}
    ours = dict(loaded["safetensors"].model.named_parameters())
    theirs = dict(loaded["runai-streamer"].model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype and torch.equal(p, theirs[name]), name  # bit for bit
    assert loaded["runai-streamer"].load_timings["weights_loader"] == "runai-streamer"


def test_load_timings_account_for_the_load(golden):
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    weights_loader="safetensors")
    t = policy.load_timings
    assert t["weights_loader"] == "safetensors"
    assert t["weight_bytes"] == sum(p.numel() * 4 for p in policy.model.parameters())  # float32 everywhere
    stages = t["config_s"] + t["device_s"] + t["weights_s"] + t["engine_s"]
    assert 0 < stages <= t["total_s"]
    assert t["weights_gb_per_s"] is None  # on the CPU nothing crosses to a device: no throughput to claim


def test_weight_loader_choice_and_errors(monkeypatch):
    with pytest.raises(CheckpointError, match="not known"):
        check_weight_loader("fast")
    assert check_weight_loader("safetensors") == "safetensors"
    real_find_spec = files_module.importlib.util.find_spec
    monkeypatch.setattr(files_module.importlib.util, "find_spec",
                        lambda name: None if name == "runai_model_streamer" else real_find_spec(name))
    with pytest.raises(CheckpointError, match="pip install runai-model-streamer"):
        check_weight_loader("runai-streamer")
    with pytest.raises(UsageError, match="weights_loader"):
        serve_options({"weights_loader": "mmap"})


def test_read_ahead_reads_every_byte_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ReadAhead, "CHUNK_BYTES", 64 * 1024)
    sizes = [1_000_000 + 123, 64 * 1024, 7]  # a partial last chunk, an exact chunk, a tiny file
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / f"model-{i}.safetensors")
        paths[-1].write_bytes(bytes(size))
    ahead = ReadAhead(paths, threads=3)
    assert ahead.wait(timeout=60)
    assert ahead.error is None and ahead.bytes_read == ahead.total_bytes == sum(sizes)
    assert ahead.seconds is not None


def test_read_ahead_failure_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vlaserve.checkpoint.files"):
        ahead = ReadAhead([tmp_path], threads=2)  # a directory: the read fails
        assert ahead.wait(timeout=60)
    assert ahead.error is not None
    assert "loading reads it directly" in caplog.text


def test_read_ahead_only_when_memory_allows(golden, monkeypatch):
    checkpoint = golden / "checkpoint"
    size = sum(f.stat().st_size for f in checkpoint_files(checkpoint))
    monkeypatch.setattr(files_module, "available_memory_bytes", lambda: size)  # would take all of it
    assert read_ahead(checkpoint) is None
    monkeypatch.setattr(files_module, "available_memory_bytes", lambda: 10 * size)
    ahead = read_ahead(checkpoint)
    assert ahead is not None and ahead.wait(timeout=60) and ahead.bytes_read == size


def test_serve_reads_a_local_checkpoint_ahead_only_for_the_mmap_loader(golden):
    checkpoint = str(golden / "checkpoint")
    ahead = read_checkpoint_ahead(serve_options({"checkpoint": checkpoint}))  # the default loader
    assert ahead is not None and ahead.wait(timeout=60) and ahead.error is None
    assert read_checkpoint_ahead(serve_options({"checkpoint": None})) is None  # the demo
    assert read_checkpoint_ahead(serve_options({"checkpoint": "owner/model"})) is None  # a hub id
    # runai-model-streamer reads in parallel itself
    assert read_checkpoint_ahead(serve_options({"checkpoint": checkpoint, "weights_loader": "runai-streamer"})) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_copy_moves_every_byte_and_casts_as_a_direct_move(golden, dtype):
    """The CUDA loader's path (two staging buffers, chunked copies, the cast after the move), run on
    the CPU with 4 KiB chunks, so tensors span many chunks, end mid-chunk, and the buffers alternate:
    every golden tensor comes out bit for bit as `.to(dtype)` gives it (bf16 of an fp32 tensor: one
    round to nearest even either way)."""
    from safetensors.torch import load_file

    from vlaserve.checkpoint.weights import StagedCopy

    tensors = {}
    for path in checkpoint_files(golden / "checkpoint"):
        tensors.update(load_file(path))
    tensors["odd"] = torch.randn(4097 * 3 + 5)  # not a whole number of chunks in any dtype
    copy = StagedCopy(torch.device("cpu"), chunk_bytes=4096, staged=True)
    assert copy.staged and max(t.numel() * t.element_size() for t in tensors.values()) > 8 * 4096
    for name, tensor in tensors.items():
        moved = copy(tensor, dtype)
        expected = tensor.to(dtype)
        assert moved.dtype == dtype and moved.shape == tensor.shape, name
        assert torch.equal(moved.view(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
    copy.finish()
    direct = StagedCopy(torch.device("cpu"))
    assert not direct.staged and direct(tensors["odd"], torch.float32) is tensors["odd"]  # no copy on the CPU


def test_materialized_parameters_are_filled_in_place_as_a_meta_model_is_filled(golden):
    """Both ways of loading give the same tensors bit for bit, the cast of a float32 checkpoint to bfloat16
    included; in place, each parameter keeps its storage."""
    from vlaserve.checkpoint.weights import load_weights, materialize
    from vlaserve.family import family_of

    reference = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="bfloat16", progress=False)
    family = family_of(reference.config)
    model = materialize(family.build_model(reference.config), torch.bfloat16, torch.device("cpu"), family.weights)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    load_weights(model, golden / "checkpoint", torch.bfloat16, torch.device("cpu"), progress=False,
                 layout=family.weights)
    expected = dict(reference.model.named_parameters())
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name], name
        assert p.dtype == expected[name].dtype and torch.equal(p, expected[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_copy_into_a_tensor_writes_only_its_bytes(golden, dtype):
    """The in-place path of the CUDA loader (a fused matrix's row slice as the destination), on the CPU with
    4 KiB chunks: the slice gets what `.to(dtype)` gives, bit for bit, the rows around it stay as they were."""
    from vlaserve.checkpoint.weights import StagedCopy

    tensor = torch.randn(37, 129)  # float32, as checkpoints store some; 18.6 KiB: several chunks
    fused = torch.full((100, 129), 7.0, dtype=dtype)
    copy = StagedCopy(torch.device("cpu"), chunk_bytes=4096, staged=True)
    out = copy(tensor, dtype, into=fused[20:57])
    copy.finish()
    assert out.data_ptr() == fused[20:57].data_ptr()
    assert torch.equal(fused[20:57], tensor.to(dtype))
    assert bool((fused[:20] == 7).all()) and bool((fused[57:] == 7).all())


@pytest.mark.parametrize("family_name", ["pi05_golden", "pi0_golden"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("meta", [True, False])
def test_the_load_by_ranges_gives_every_tensor_as_the_mapped_load(family_name, dtype, meta):
    """The CUDA loader's path (each file read in ranges, each range staged once, casts after the bytes), run on
    the CPU with 4 KiB ranges so that tensors span ranges, end inside them and share them: every parameter is
    what the per-tensor load gives (a view of the file, `.to(dtype)`), bit for bit, into a meta model or in place."""
    from fixtures import fixture_dir

    from vlaserve.checkpoint.weights import StagedCopy, load_weights, materialize
    from vlaserve.family import family_of, load_policy_config

    checkpoint = fixture_dir(family_name) / "checkpoint"
    config = load_policy_config(checkpoint)
    family = family_of(config)
    expected = load_weights(family.build_model(config), checkpoint, dtype, torch.device("cpu"), progress=False,
                            layout=family.weights)
    model = family.build_model(config)
    if not meta:
        model = materialize(model, dtype, torch.device("cpu"), family.weights)
    staging = StagedCopy(torch.device("cpu"), chunk_bytes=4096, staged=True)
    load_weights(model, checkpoint, dtype, torch.device("cpu"), progress=False, layout=family.weights, staging=staging)
    reference = dict(expected.named_parameters())
    assert max(p.numel() * p.element_size() for p in reference.values()) > 4 * 4096
    for name, p in model.named_parameters():
        assert p.dtype == reference[name].dtype and torch.equal(p, reference[name]), name


def test_the_load_by_ranges_reads_only_the_tensors_it_loads(tmp_path):
    """A file whose tensors are not all loaded (an ignored one between two wanted ones, an empty one, three
    dtypes; safetensors lays them out by dtype, then name): each wanted tensor gets its own bytes, and the
    ignored one is not read."""
    from safetensors.torch import save_file

    from vlaserve.checkpoint.weights import StagedCopy, _load_ranges, read_header

    tensors = {"a": torch.randn(2000), "b_ignored": torch.randn(3001), "c": torch.zeros(0), "e": torch.randn(1500),
               "f": torch.randn(1001).to(torch.bfloat16), "g": torch.arange(7, dtype=torch.int8)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    order = sorted(read_header(path), key=lambda name: read_header(path)[name].begin)
    assert order.index("a") < order.index("b_ignored") < order.index("e")
    wanted = [name for name in tensors if name != "b_ignored"]
    params = {name: torch.full_like(tensors[name], 9) for name in wanted}
    staged = []

    class Recording(StagedCopy):
        def pieces(self, source, targets):
            staged.append(source.numel())
            super().pieces(source, targets)

    copy = Recording(torch.device("cpu"), chunk_bytes=1024, staged=True)
    bar = type("Bar", (), {"n": 0, "update": lambda self, k=1: setattr(self, "n", self.n + k)})()
    _load_ranges(params, {name: (path, name) for name in wanted}, copy, bar)
    for name in wanted:
        assert torch.equal(params[name], tensors[name]), name
    assert bar.n == len(wanted)
    assert sum(staged) == sum(t.numel() * t.element_size() for name, t in tensors.items() if name != "b_ignored")


def test_weights_loaded_to_the_host_do_not_change_with_the_file(golden, tmp_path):
    """A CPU load copies each tensor out of the file's mapping: overwriting the checkpoint file in place afterwards
    (a re-download into the same file) leaves the served parameters as they were loaded."""
    import shutil

    from vlaserve.checkpoint.weights import read_header

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(golden / "checkpoint", checkpoint)
    policy = Policy.from_pretrained(checkpoint, device="cpu", dtype="float32", progress=False)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    weights = checkpoint / "model.safetensors"
    start = min(t.begin for t in read_header(weights).values())
    with open(weights, "r+b") as f:  # the same file (inode), its data bytes overwritten
        f.seek(start)
        f.write(bytes(weights.stat().st_size - start))
    for name, p in policy.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert any(bool(t.any()) for t in before.values())


def test_a_truncated_weights_file_is_named(tmp_path):
    from safetensors.torch import save_file

    from vlaserve.checkpoint.weights import read_header

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(100)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        read_header(path)
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_header(path)
    header = b"[1, 2]"  # JSON, but not a map of tensors
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_header(path)


def test_the_engine_starts_before_the_weights_only_where_nothing_changes_them_after_the_load():
    """capture_while_loading (on by default) applies on CUDA's fast path with the background warm-up, where no
    fp8 conversion follows the load and no layer stays on the host; `--no-capture-while-loading` turns it off."""
    from vlaserve.config import RuntimeConfig
    from vlaserve.options import serve_options

    assert RuntimeConfig().captures_while_loading("cuda")
    assert not RuntimeConfig().captures_while_loading("cpu")
    for off in ({"warmup": "blocking"}, {"precision": "fp8"}, {"memory_profile": "offload"}, {"fast_path": False},
                {"capture_while_loading": False}):
        assert not RuntimeConfig(**off).captures_while_loading("cuda"), off
    assert serve_options({"checkpoint": "x", "capture_while_loading": False})["runtime"].capture_while_loading is False
