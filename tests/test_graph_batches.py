"""Which batch sizes get CUDA graphs at startup (--graph-batches all | ladder), what that costs in
memory, and how a batch between two ladder sizes runs (padded with its last item, rows dropped)."""

import pytest
import torch

from vlaserve.config import RuntimeConfig, graph_batch_sizes
from vlaserve.errors import ConfigError
from vlaserve.types import RTCGuidance
from vlaserve.runtime.graphs import _padded
from vlaserve.runtime.prefix_cache import PrefixEntry
from vlaserve.types import ModelInputs


@pytest.mark.parametrize("mode,limit,sizes", [("all", 8, (1, 2, 3, 4, 5, 6, 7, 8)), ("ladder", 8, (1, 2, 4, 8)),
                                              ("ladder", 6, (1, 2, 4, 6)), ("ladder", 1, (1,)),
                                              ("ladder", 16, (1, 2, 4, 8, 16)), ("all", 3, (1, 2, 3))])
def test_graph_batch_sizes(mode, limit, sizes):
    assert graph_batch_sizes(mode, limit) == sizes


def test_graph_batches_option_is_validated_and_follows_the_batch_limit():
    assert RuntimeConfig(graph_batches="ladder", max_batch_size=8).graph_sizes == (1, 2, 4, 8)
    # edge-16gb caps batches at 4: the ladder stops there too
    assert RuntimeConfig(graph_batches="ladder", memory_profile="edge-16gb").graph_sizes == (1, 2, 4)
    with pytest.raises(ConfigError, match="graph_batches"):
        RuntimeConfig(graph_batches="some")


def test_ladder_needs_less_memory_than_all_sizes():
    from vlaserve.config import PROFILES, ModelConfig, PolicyConfig
    from vlaserve.model.pi05 import Pi05Model
    from vlaserve.runtime.memory import _kv_and_buffers_per_item, estimate_memory

    cfg = ModelConfig.full_size()
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Pi05Model(cfg).named_parameters()}
    policy = PolicyConfig(cfg, ("a", "b", "c"), 14, 14)
    every = estimate_memory(shapes, policy, torch.bfloat16, PROFILES["default"], 8, graph_batches="all")
    ladder = estimate_memory(shapes, policy, torch.bfloat16, PROFILES["default"], 8, graph_batches="ladder")
    per_item = _kv_and_buffers_per_item(policy, torch.bfloat16, True)
    # buffers for 1+2+...+8 = 36 items against 1+2+4+8 = 15
    assert every.kv_and_buffers == 36 * per_item and ladder.kv_and_buffers == 15 * per_item
    assert ladder.total < every.total


def test_padded_batch_repeats_its_last_item():
    g = torch.Generator().manual_seed(0)
    inputs = ModelInputs(torch.rand(3, 2, 3, 4, 4, generator=g), torch.tensor([[True, True], [True, False],
                                                                               [True, True]]),
                         torch.randint(0, 9, (3, 5), generator=g), torch.ones(3, 5, dtype=torch.bool))
    noise = torch.randn(3, 6, 4, generator=g)
    rtc = RTCGuidance(torch.randn(3, 6, 4, generator=g), torch.rand(3, 6, generator=g), torch.tensor([1.0, 2.0, 3.0]))
    entries = [PrefixEntry(torch.full((1,), float(i)), torch.zeros(1), torch.ones(1, dtype=torch.bool))
               for i in range(3)]
    grown, grown_noise, grown_rtc, grown_prefix = _padded(4, inputs, noise, rtc, entries)
    for old, new in [(inputs.images, grown.images), (inputs.image_masks, grown.image_masks),
                     (inputs.tokens, grown.tokens), (noise, grown_noise), (rtc.prev, grown_rtc.prev),
                     (rtc.weights, grown_rtc.weights), (rtc.max_weight, grown_rtc.max_weight)]:
        assert new.shape[0] == 4
        assert torch.equal(new[:3], old) and torch.equal(new[3], old[2])
    assert grown.state is None
    assert [e.k.item() for e in grown_prefix] == [0.0, 1.0, 2.0, 2.0]
