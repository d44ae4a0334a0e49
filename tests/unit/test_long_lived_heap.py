"""A proxy that is its process's whole purpose freezes what it made to start and collects the
young generation less often (`long_lived_heap`); one embedded in another process leaves the
collector as it was. (What that saves is measured by bench/bench_gc.py, not asserted here.)"""

from __future__ import annotations

import gc

import pytest

from polar_mitm.proxy.embedded import YOUNG_OBJECTS, PolarProxy, ProxyConfig, long_lived_heap
from polar_mitm.service.node import GatewayNode, NodeConfig


@pytest.fixture
def collector():
    """The collector's state is the test process's: put back whatever a test changed."""
    threshold = gc.get_threshold()
    frozen = gc.get_freeze_count()
    yield frozen
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_long_lived_heap_freezes_the_heap_and_collects_the_young_every_10000(collector):
    made = [[] for _ in range(1000)]  # tracked containers, alive: frozen with the rest
    older = gc.get_threshold()[1:]
    long_lived_heap()
    assert gc.get_freeze_count() >= collector + len(made)
    assert gc.get_threshold() == (YOUNG_OBJECTS, *older)
    assert all(gc.is_tracked(x) for x in made)


@pytest.mark.parametrize("own", [False, True])
async def test_a_proxy_settles_its_processs_heap_only_when_it_is_the_processs_own(tmp_path, collector, own):
    threshold = gc.get_threshold()
    proxy = PolarProxy(
        ProxyConfig(
            mode="harvest", db=str(tmp_path / "db.sqlite"), certs_dir=tmp_path / "certs", own_process=own
        )
    )
    await proxy.start()
    try:
        frozen, now = gc.get_freeze_count(), gc.get_threshold()
    finally:
        await proxy.stop()
    if own:
        assert frozen > collector and now[0] == YOUNG_OBJECTS
    else:
        assert frozen == collector and now == threshold


def test_a_node_passes_own_process_to_its_proxy():
    for own in (False, True):
        node = GatewayNode(NodeConfig(server="http://127.0.0.1:1", node_token="t", own_process=own))
        assert node.proxy.config.own_process is own
