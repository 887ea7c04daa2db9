"""The @flight decorator: the key is the function plus its canonical arguments.

Run: python examples/decorator.py [REDIS_URL]   (default: a private embedded server)
"""

import asyncio
import sys

from flightcache import FlightCache


async def main(url: str) -> None:
    async with FlightCache(url, namespace="decorator") as fc:

        @fc.flight(ttl=60)
        async def embed(text: str, model: str = "small") -> list[float]:
            await asyncio.sleep(0.2)  # stands in for an embeddings call
            return [float(len(text)), float(len(model))]

        first = await embed("hello")
        again = await embed(text="hello", model="small")  # same canonical arguments: a hit
        print(first, again, fc.stats["loader_runs"], "loader run(s)")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "embedded://"))
