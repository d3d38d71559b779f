"""Routes of real `noderuntime up` processes over gRPC and the relay (on loopback)."""

from __future__ import annotations

import signal
from pathlib import Path

import attrs
import pytest
import trio

from noderuntime.seams.client import GenerationRequest, RouteError
from noderuntime.seams.dialer import open_dialer
from noderuntime.testing.clusters import Cluster, running_cluster
from noderuntime.testing.linkproxy import link_proxy
from protocol import StatusCode

from .test_node_core import requests, solo_greedy

pytestmark = pytest.mark.slow
CUTS = [0, 10, 20, 30]


async def _eight_sessions_match(cluster: Cluster, model: Path) -> None:
    reqs = requests(8, seed=21)
    expected = [await trio.to_thread.run_sync(solo_greedy, model, r) for r in reqs]
    got: dict[int, tuple[int, ...]] = {}
    async with open_dialer() as dialer:

        async def one(i: int) -> None:
            got[i] = await cluster.generate(dialer, reqs[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(reqs)):
                nursery.start_soon(one, i)
    assert [got[i] for i in range(len(reqs))] == expected
    await cluster.wait_idle()


async def test_three_processes_over_grpc_match_the_whole_model(smollm2: Path, tmp_path: Path) -> None:
    with running_cluster(smollm2, CUTS, tmp_path) as cluster:
        await _eight_sessions_match(cluster, smollm2)
        seams = [(await cluster.status(i))["seams"] for i in range(3)]
        assert seams[0]["direct"] >= 8 and seams[1]["direct"] >= 8 and seams[2]["direct"] == 0


async def test_three_processes_over_the_relay_match_the_whole_model(smollm2: Path, tmp_path: Path) -> None:
    with running_cluster(smollm2, CUTS, tmp_path, relay_only=[1, 2]) as cluster:
        assert all(hop.address == "" for hop in cluster.hops[1:])
        await _eight_sessions_match(cluster, smollm2)
        seams = [(await cluster.status(i))["seams"] for i in range(3)]
        assert seams[0]["relay"] >= 8 and seams[1]["relay"] >= 8


async def test_tls_with_a_pinned_certificate_and_fallback_to_the_relay(smollm2: Path, tmp_path: Path) -> None:
    with running_cluster(smollm2, [0, 15, 30], tmp_path, tls=[0, 1], with_relay=True) as cluster:
        assert all(len(hop.tls_cert_sha256) == 32 for hop in cluster.hops)
        request = requests(1, seed=3)[0]
        expected = await trio.to_thread.run_sync(solo_greedy, smollm2, request)
        async with open_dialer() as dialer:
            assert await cluster.generate(dialer, request) == expected
            # the second hop's advertised address is dead: the head falls back to its relay
            broken = (cluster.hops[0], attrs.evolve(cluster.hops[1], address="127.0.0.1:9"))
            assert await cluster.generate(dialer, request, hops=broken) == expected
        assert (await cluster.status(0))["seams"]["fallbacks"] == 1
        await cluster.wait_idle()


async def test_a_spare_connection_to_a_host_gone_dark_gives_way_to_the_relay(smollm2: Path, tmp_path: Path) -> None:
    with running_cluster(smollm2, [0, 15, 30], tmp_path, with_relay=True) as cluster:
        async with link_proxy(int(cluster.hops[1].address.rsplit(":", 1)[1])) as proxy:
            request = requests(1, seed=5)[0]
            expected = await trio.to_thread.run_sync(solo_greedy, smollm2, request)
            # the head reaches the second hop through the proxy, and keeps a spare connection to it
            hops = (cluster.hops[0], attrs.evolve(cluster.hops[1], address=f"127.0.0.1:{proxy.port}"))
            async with open_dialer() as dialer:
                assert await cluster.generate(dialer, request, hops=hops) == expected
                with trio.fail_after(5):
                    while (await cluster.status(0))["seams"]["spares"] < 1:
                        await trio.sleep(0.05)
                # the host drops off the network: no reset, the spare still looks connected
                await trio.to_thread.run_sync(proxy.cut)
                with trio.fail_after(15):
                    assert await cluster.generate(dialer, request, hops=hops) == expected
            seams = (await cluster.status(0))["seams"]
            assert (seams["dead_spares_dropped"], seams["fallbacks"]) == (1, 1)
            await cluster.wait_idle()


async def test_a_head_drafting_with_a_model_over_a_slow_seam_gives_the_whole_models_reply(
    smollm2: Path, tmp_path: Path
) -> None:
    """``up --draft``: the head drafts with a model (SmolLM2, for itself) where its seam to the
    tail is 50 ms each way, long enough beside a draft for windows to pay; the reply is the whole
    model's, and the head's /status counts the model's drafts."""
    head_extra = ("--draft", str(smollm2))
    with running_cluster(smollm2, [0, 15, 30], tmp_path, head_extra=head_extra) as cluster:
        async with link_proxy(int(cluster.hops[1].address.rsplit(":", 1)[1])) as proxy:
            proxy.delay = 0.05
            plain = GenerationRequest(tuple(range(300, 340)), 24)
            expected = await trio.to_thread.run_sync(solo_greedy, smollm2, plain)
            hops = (cluster.hops[0], attrs.evolve(cluster.hops[1], address=f"127.0.0.1:{proxy.port}"))
            async with open_dialer() as dialer:
                assert await cluster.generate(dialer, attrs.evolve(plain, speculate=8), hops=hops) == expected
        drafting = [(await cluster.status(i))["draft_model"] for i in range(2)]
        assert drafting[0]["drafted"] > 0 and drafting[0]["ms_a_draft"] > 0 and drafting[1] is None, drafting
        await cluster.wait_idle()


@pytest.mark.parametrize("relayed", [False, True], ids=["grpc", "relay"])
async def test_cancellation_from_either_end_releases_kv_everywhere(
    smollm2: Path, tmp_path: Path, relayed: bool
) -> None:
    with running_cluster(smollm2, CUTS, tmp_path, relay_only=[1, 2] if relayed else []) as cluster:
        long = GenerationRequest(tuple(range(200, 260)), 400)
        async with open_dialer() as dialer:
            # the client end: leave in the middle of decoding (open_route_generation sends Cancel)
            with pytest.raises(_Stop):
                async with cluster.open(dialer, long, session_id=b"a" * 16) as gen:
                    for _ in range(10):
                        assert await gen.next() is not None
                    states = [await cluster.status(i) for i in range(3)]
                    assert all(s["active_sessions"] == 1 and s["kv_cells"] > 0 for s in states)
                    raise _Stop
        await cluster.wait_idle()
        # the far end: the tail dies in the middle of decoding
        async with open_dialer() as dialer:
            with pytest.raises(RouteError) as failure:
                async with cluster.open(dialer, long, session_id=b"b" * 16) as gen:
                    for _ in range(10):
                        await gen.next()
                    cluster.nodes[2].signal(signal.SIGKILL)
                    with trio.fail_after(15):
                        while await gen.next() is not None:
                            pass
        assert failure.value.code == StatusCode.UNAVAILABLE
        await cluster.wait_idle(indices=[0, 1])


class _Stop(Exception):
    """Leaves a generation early (the client going away)."""
