"""Quickstart: 100 concurrent identical requests, one loader run, one cached answer.

Run: python examples/quickstart.py [REDIS_URL]   (default: a private embedded server)
"""

import asyncio
import sys

from flightcache import FlightCache


async def main(url: str) -> None:
    async with FlightCache(url, namespace="quickstart") as fc:
        runs = 0

        async def ask_model() -> str:  # stands in for an LLM call
            nonlocal runs
            runs += 1
            await asyncio.sleep(0.5)
            return "Relativity: the laws of physics are the same for every observer."

        question = {"role": "user", "content": "What is relativity?"}
        request = {"model": "demo", "messages": [question]}
        answers = await asyncio.gather(*(fc.do(request, ask_model, ttl=600) for _ in range(100)))
        print(f"{len(answers)} answers, {len(set(answers))} distinct, loader runs: {runs}")
        print("cached:", await fc.get(request))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "embedded://"))
