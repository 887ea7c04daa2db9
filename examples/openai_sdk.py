"""The OpenAI SDK, coalesced: 50 identical concurrent calls, one upstream call.

Run: python examples/openai_sdk.py [REDIS_URL] [BASE_URL]

Without a BASE_URL it starts flightcache's mock upstream (a test double, not a model) in
this process; with one (``https://api.openai.com/v1``) it calls that API with
OPENAI_API_KEY. Without a REDIS_URL it uses a private embedded server.
"""

import asyncio
import os
import sys
from collections import Counter

from openai import AsyncOpenAI

from flightcache import FlightCache
from flightcache.integrations.openai import coalesce


async def main(redis_url: str, base_url: str, model: str) -> None:
    outcomes = Counter()
    async with FlightCache(redis_url, namespace="openai-example") as fc:
        client = coalesce(
            AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "sk-demo")),
            fc,
            on_outcome=lambda outcome: outcomes.update([outcome.cache]),
        )
        request = {
            "model": model,
            "messages": [{"role": "user", "content": "What is relativity?"}],
            "temperature": 0,  # deterministic: stored (sampled answers are only coalesced)
        }
        answers = await asyncio.gather(
            *(client.chat.completions.create(**request) for _ in range(50))
        )
        distinct = {answer.choices[0].message.content for answer in answers}
        print(f"{len(answers)} ChatCompletion answers, {len(distinct)} distinct, {dict(outcomes)}")

        # The same request as a stream: its answer is already stored, replayed as chunks.
        stream = await client.chat.completions.create(**request, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        print(f"stream: {stream.source}, same text: {text in distinct}")

        # The Responses API, stream and not, shares flights the same way.
        ask = {"model": model, "input": "Say something about flights.", "temperature": 0}
        response, again = await asyncio.gather(
            client.responses.create(**ask), client.responses.create(**ask)
        )
        print(f"responses: {type(response).__name__}, one answer: {response.id == again.id}")
        await client.close()


if __name__ == "__main__":
    redis_url = sys.argv[1] if len(sys.argv) > 1 else "embedded://"
    if len(sys.argv) > 2:
        asyncio.run(main(redis_url, sys.argv[2], "gpt-4o-mini"))
    else:
        from flightcache.gateway._mock import make_mock_app
        from flightcache.gateway._serve_util import ServerThread

        with ServerThread(make_mock_app(latency_ms=300)) as mock:
            asyncio.run(main(redis_url, f"{mock.url}/v1", "mock-chat"))
            import httpx

            print("upstream calls:", httpx.get(f"{mock.url}/stats").json()["calls"])
