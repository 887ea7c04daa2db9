"""Testing code that uses flightcache: memory:// as the test double, disabled() to turn
caching off, no change to the application's code.

Run: python examples/testing.py
"""

from flightcache import FlightCacheSync

# --- the application ------------------------------------------------------------------
cache = FlightCacheSync("memory://")  # in production: FlightCacheSync("redis://...", ...)
calls = []


@cache.flight(ttl=300)
def price(product: str) -> float:
    calls.append(product)  # stands in for a slow pricing service
    return {"tea": 3.5, "cake": 4.25}[product]


# --- its tests ------------------------------------------------------------------------
def test_price_is_cached() -> None:
    assert price("tea") == 3.5 and price("tea") == 3.5
    assert calls.count("tea") == 1


def test_price_without_the_cache() -> None:
    with cache.disabled():  # every call reaches the pricing service, nothing is stored
        assert price("cake") == 4.25 and price("cake") == 4.25
    assert calls.count("cake") == 2


if __name__ == "__main__":
    test_price_is_cached()
    test_price_without_the_cache()
    cache.close()
    print("2 tests passed; pricing service calls:", calls)
