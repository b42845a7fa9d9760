"""Two models on one node pool: instances of the test model and of a
model with half its KV per block (grouped-query attention, two KV heads
instead of four) share one meta service. The second model's blocks take
whole slots of the first's size; each model hits its own prefixes from
the pool and never the other's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import BLOCK, assert_loads_succeeded, complete, delta, hit_after_eviction, tokens
from tests.e2e.test_pool import DISK, EXT_HITS, HOST, Node

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_models(tiny_model: str, gqa_model: str, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Node, VllmServer, VllmServer]]:
    node = Node(tmp_path_factory.mktemp("pool-models"), tiny_model)
    node.meta.start()
    try:
        mha = node.instance("mha")  # first: the pool's slots are sized for its blocks
        gqa = node.instance("gqa", model=gqa_model)
        yield node, mha, gqa
    finally:
        for srv in node.servers.values():
            srv.stop()
        node.meta.stop()


def test_two_models_share_one_pool_and_each_hits_only_its_own_blocks(
        two_models: tuple[Node, VllmServer, VllmServer]) -> None:
    node, mha, gqa = two_models
    health = node.meta.health()
    assert len(health["clients"]) == 2  # the second model was not refused
    assert "refused this instance" not in gqa.log_text()

    # The same tokens on both: each model's own keys (the namespace).
    prompt = tokens(40, 20 * BLOCK)
    for srv, seed in ((mha, 100), (gqa, 200)):
        device_hit, again, before, after = hit_after_eviction(srv, prompt, filler_seed=seed)
        assert again["text"] == device_hit["text"]
        # From the pool's DRAM, or its SSD where the fillers pushed blocks there.
        assert delta(after, before, EXT_HITS) == 19 * BLOCK == delta(after, before, HOST) + delta(after, before, DISK)
        assert_loads_succeeded(before, after, 19 * BLOCK)

    # A prefix the first model saved is not a hit for the second, however
    # alike the tokens, and the other way round.
    only_mha, only_gqa = tokens(41, 12 * BLOCK), tokens(42, 12 * BLOCK)
    complete(mha, only_mha)
    complete(gqa, only_gqa)
    for srv, other in ((gqa, only_mha), (mha, only_gqa)):
        before = srv.metrics()
        complete(srv, other)
        assert delta(srv.metrics(), before, EXT_HITS) == 0
    acc = node.meta.health()["slots"]
    assert acc["used"] > 0 and acc["used"] + acc["free"] + acc["held"] == acc["total"]
