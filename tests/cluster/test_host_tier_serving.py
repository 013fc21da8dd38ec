"""The host KV tier behind Serve: two engine replicas on the node, pools far smaller than the
traffic. A prompt no pool holds any more is answered from the node's tier, token for token, and
its usage says the prompt was cached; /stats shows both replicas reading the one tier."""

from __future__ import annotations

import random
import time
from typing import Any, Iterator

import httpx
import openai
import pytest
from _serve_apps import deploy_tiny
from ray import serve

MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="module")
def url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    yield from deploy_tiny(
        serve_url,
        "hosttier",
        tiny_llama,
        served_model_name=MODEL,
        num_replicas=2,
        routing="power-of-two",
        num_kv_blocks=24,
        kv_offloading_size=0.01,
    )


def complete(client: openai.OpenAI, prompt: list[int]) -> Any:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )


def replicas(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/stats", timeout=30).json()["replicas"]


def test_a_prompt_no_pool_holds_comes_back_from_the_tier(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    rng = random.Random(2026)
    prompt = [rng.randrange(1, 250) for _ in range(100)]
    first = complete(client, prompt)
    # Two dozen other prompts: whichever replicas they go to (one request at a time, power of
    # two may send them all to one), a pool of 24 blocks (7 a prompt) that saw the first prompt
    # has evicted it several times over.
    for _ in range(24):
        complete(client, [rng.randrange(1, 250) for _ in range(100)])
    stats = replicas(url)
    assert len(stats) == 2 and sum(r["host_tier_saved_blocks"] for r in stats) > 0, stats
    hits_before = sum(r["external_prefix_cache_hits"] for r in stats)
    again = complete(client, prompt)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK
    hits = sum(r["external_prefix_cache_hits"] for r in replicas(url)) - hits_before
    assert hits == 6 * BLOCK, "the hit came from the tier, not a pool"
    # One tier for the node: both replicas (one of which may have served nothing) report the
    # same blocks held.
    held = {r["host_tier_num_blocks"] for r in replicas(url)}
    assert len(held) == 1 and held.pop() > 0


def test_a_redeployed_engine_starts_with_what_the_old_one_cached(
    serve_url: str, tiny_llama: str
) -> None:
    """Without write-through and with nothing evicted, an engine replica Serve shuts down (a
    redeploy, a scale-down, a deleted app) saves its pool's cache to the node's tier first: the
    replica after it answers the same prompt from there."""
    rng = random.Random(2027)
    prompt = [rng.randrange(1, 250) for _ in range(100)]
    args = {"served_model_name": MODEL, "num_kv_blocks": 256, "kv_offloading_size": 0.01}
    texts, cached = [], []
    for _ in range(2):
        app = deploy_tiny(serve_url, "redeployed", tiny_llama, **args)
        url = next(app)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = complete(client, prompt)
        texts.append(answer.choices[0].text)
        details = answer.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        with pytest.raises(StopIteration):
            next(app)  # serve.delete: the replica drains, saves, exits
    assert texts[0] == texts[1]
    assert cached == [0, 6 * BLOCK], "the second replica loaded the first one's blocks"
    assert "redeployed" not in serve.status().applications


def test_a_request_sent_away_from_its_prefix_pulls_the_blocks_from_the_holder(
    serve_url: str, tiny_llama: str
) -> None:
    """Cache-aware, two replicas, nothing in the tier: while the replica that cached a prompt
    is busier (a long stream shares its prefix), the router sends the prompt to the other one
    (a load fallback), which pulls the blocks from the holder instead of computing them: the
    same text, its prompt cached, the holder's pool the source."""
    rng = random.Random(2028)
    prompt = [rng.randrange(1, 250) for _ in range(100)]
    args = {
        "served_model_name": MODEL,
        "num_replicas": 2,
        "routing": "cache-aware",
        "routing_load_threshold": 0,
        "routing_pull_min_blocks": 2,
        "num_kv_blocks": 256,
        "kv_offloading_size": 0.01,
    }
    app = deploy_tiny(serve_url, "pulls", tiny_llama, **args)
    url = next(app)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        first = complete(client, prompt)  # no match: power of two, which learns both loads
        holder = max(replicas(url), key=lambda r: r["num_computed_tokens_total"])
        time.sleep(0.5)  # the holder's KV events reach the ingress
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt + [5] * 20,
            max_tokens=900,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # it runs on the holder (its prefix is there)
        again = complete(client, prompt)
        stream.close()
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK
        by_id = {r["replica_id"]: r for r in replicas(url)}
        assert by_id[holder["replica_id"]]["num_kv_exported_blocks"] == 6
        (other,) = (r for r in by_id.values() if r["replica_id"] != holder["replica_id"])
        assert other["prompt_tokens_external_kv_transfer"] == 6 * BLOCK
    finally:
        with pytest.raises(StopIteration):
            next(app)
