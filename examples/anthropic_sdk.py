"""The Anthropic SDK, coalesced, from threads: 20 identical calls, one upstream call.

Run: python examples/anthropic_sdk.py [REDIS_URL] [BASE_URL]

The sync client takes a ``FlightCacheSync``. Without a BASE_URL it starts flightcache's
mock upstream (a test double, not a model) in this process; with one
(``https://api.anthropic.com``) it calls that API with ANTHROPIC_API_KEY. Without a
REDIS_URL it uses a private embedded server.
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from anthropic import Anthropic

from flightcache import FlightCacheSync
from flightcache.integrations.anthropic import coalesce


def main(redis_url: str, base_url: str, model: str) -> None:
    with FlightCacheSync(redis_url, namespace="anthropic-example") as fcs:
        api_key = os.environ.get("ANTHROPIC_API_KEY", "ak-demo")
        # The Messages API samples by default: cache_sampled=True stores the answers too
        # (without it identical calls are still coalesced while one is in flight).
        client = coalesce(Anthropic(base_url=base_url, api_key=api_key), fcs, cache_sampled=True)
        request = {
            "model": model,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "What is relativity?"}],
        }
        with ThreadPoolExecutor(20) as pool:
            messages = list(pool.map(lambda _: client.messages.create(**request), range(20)))
        texts = {message.content[0].text for message in messages}
        print(f"{len(messages)} Message answers from threads, {len(texts)} distinct")

        with client.messages.create(**request, stream=True) as stream:
            events = list(stream)
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        print(
            f"stream: {stream.source}, {type(events[0]).__name__} first, same text: {text in texts}"
        )
        client.close()


if __name__ == "__main__":
    redis_url = sys.argv[1] if len(sys.argv) > 1 else "embedded://"
    if len(sys.argv) > 2:
        main(redis_url, sys.argv[2], "claude-sonnet-4-5")
    else:
        from flightcache.gateway._mock import make_mock_app
        from flightcache.gateway._serve_util import ServerThread

        with ServerThread(make_mock_app(latency_ms=300)) as mock:
            main(redis_url, mock.url, "mock-claude")
            import httpx

            print("upstream calls:", httpx.get(f"{mock.url}/stats").json()["calls"])
