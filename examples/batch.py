"""Batch loading: many keys, one loader call for the ones nobody has.

Three overlapping page renders each ask for the users they show. Each user is a flight of
its own, so no user is loaded twice (the render that asked first loads it, the others wait
for it, here or in any other process), and each render's remaining users go to the
database in one query.

Run: python examples/batch.py [REDIS_URL]   (default: a private embedded server)
"""

import asyncio
import sys

from flightcache import NOT_FOUND, FlightCache

USERS = {i: {"id": i, "name": f"user {i}"} for i in range(1, 10)}  # no user 10
queries: list[list[int]] = []


async def load_users(keys: list[str]) -> dict[str, dict[str, object]]:
    """``do_many``'s loader: the keys this call must load, to a mapping of key -> value."""
    ids = sorted(int(key.removeprefix("user:")) for key in keys)
    queries.append(ids)  # stands in for SELECT ... WHERE id IN (...)
    await asyncio.sleep(0.2)
    return {f"user:{i}": USERS[i] for i in ids if i in USERS}  # a user left out: NOT_FOUND


async def main(url: str) -> None:
    async with FlightCache(url, namespace="batch") as fc:
        pages = [[1, 2, 3, 4], [3, 4, 5, 6], [5, 6, 7, 1]]
        renders = await asyncio.gather(
            *(fc.do_many([f"user:{i}" for i in page], load_users, ttl=600) for page in pages)
        )
        print(f"{len(renders)} pages, queries: {sorted(queries)}")
        print("page 2:", [user["name"] for user in renders[1]])
        later = await fc.do_many(["user:7", "user:8", "user:10"], load_users, ttl=600)
        names = [user if user is NOT_FOUND else user["name"] for user in later]
        print("later:", names, "query:", queries[-1])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "embedded://"))
