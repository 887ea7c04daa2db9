"""The protocol model (``model/``, docs/protocol.md "The model check"): its constants are the
code's, the small scopes hold every invariant, and every mutant gives a counterexample.

``make model`` runs the larger scopes; these are the ones that fit the suite's time.
"""

from __future__ import annotations

import inspect

import pytest

from flightcache import FlightCache
from flightcache._config import Tuning
from flightcache._protocol import loader
from flightcache._types import CallOptions
from model import constants
from model.__main__ import main
from model.check import INVARIANTS, check
from model.model import KNOWN_ISSUES, MUTANTS, Model
from model.scopes import ALL, KNOWN_ISSUE_SCOPES, LIVENESS, MUTANT_SCOPES, SMALL


def test_the_models_constants_are_the_codes() -> None:
    defaults = inspect.signature(FlightCache.__init__).parameters
    assert constants.LEASE_S == defaults["lease"].default
    assert constants.NEAR_LEASE_S == defaults["near_lease"].default
    assert constants.SKEW_MARGIN_S == defaults["skew_margin"].default
    assert constants.NODE_TTL_S == defaults["node_ttl"].default
    tuning = Tuning()
    assert constants.BLOCK_MARGIN_MS == tuning.block_margin_ms
    assert constants.STREAM_LINGER_MS == tuning.stream_linger_ms
    assert constants.TAKEOVER_STEP_S == tuning.takeover_step_s
    assert constants.TAKEOVER_MAX_RANK == tuning.takeover_max_rank
    # The periods the code derives: heartbeat.py (lease / 3) and nodes.py (node_ttl / 3).
    assert constants.RENEW_EVERY_S == defaults["lease"].default / 3
    assert constants.NODE_RENEW_EVERY_S == defaults["node_ttl"].default / 3
    # The wait bound (CallOptions.wait_bound_s) for the timeouts the scopes use and the
    # default, and the grace a loader that ignores its cancellation gets (loader.py).
    for timeout_s in (0.25, 1.0, defaults["timeout"].default):
        for lease_s in (constants.LEASE_S, 0.5):
            opts = CallOptions(
                ttl_ms=1000,
                lease_ms=int(lease_s * 1000),
                timeout_s=timeout_s,
                error_ttl_ms=0,
                key_text="k",
            )
            assert constants.wait_bound_s(timeout_s, lease_s) == opts.wait_bound_s
    assert constants.CANCEL_GRACE_S == loader.CANCEL_GRACE_S
    # The session backstop is smaller in the model than the code's (Tuning's 30 s): the
    # protocol's arguments need only that a bound meta outlives the session that proves it,
    # which both have (the code turns sessions off for a backstop not above the lease).
    assert Tuning().session_backstop_ms / 1000 > constants.LEASE_S
    assert constants.SESSION_BACKSTOP_S > constants.LEASE_S
    # Its stream linger (sessions) keeps the code's ratio to B: the code's 10 s of 30 s.
    assert Tuning().session_backstop_ms == (
        constants.STREAM_LINGER_OF_BACKSTOP * Tuning().stream_linger_ms
    )
    assert constants.SESSION_LINGER_S * constants.STREAM_LINGER_OF_BACKSTOP == (
        constants.SESSION_BACKSTOP_S
    )


def test_ticks_are_whole_and_refuse_a_tick_that_would_round_a_lease() -> None:
    t = constants.Timing.of(0.25, leases_for_readers=True)
    assert (t.lease, t.renew, t.near_lease, t.skew, t.node_ttl, t.node_renew) == (
        12,
        4,
        20,
        1,
        24,
        8,
    )
    assert t.margin == 1  # 50 ms rounded up to a tick: only ever later
    assert t.wait_bound(1.0) == 36  # 2 x (1 + 3) + 1 = 9 s
    assert constants.Timing.of(1.0, leases_for_readers=False).wait_bound(1.0) == 9
    assert constants.Timing.of(1.0, leases_for_readers=False).loader_bound(1.0) == 2
    flights = constants.Timing.of(1.0, leases_for_readers=False)
    assert (flights.lease, flights.backstop, flights.backstop_renew) == (3, 6, 2)
    with pytest.raises(ValueError, match="skew_margin"):
        constants.Timing.of(0.5, leases_for_readers=True)


@pytest.mark.parametrize("scope", [*SMALL, *LIVENESS], ids=lambda s: s.name)
def test_the_protocol_holds_every_invariant_in_the_small_scopes(scope) -> None:
    res = check(Model(scope), liveness=not scope.symmetry)
    assert res.complete
    assert not res.violation, "\n".join([res.violation, *res.trace])
    assert res.ok, res.liveness
    assert res.states > 1000  # the scope explored something


# What each mutant breaks ("" for the liveness mutant: a fair cycle).
CAUGHT_BY = {
    "no-token-check": "no_store_after_takeover",
    "no-cancel": "stale_owner_stops",
    "no-skew": "no_stale_near_copy",
    "no-marker": "no_stale_near_copy",
    "no-since": "one_run_per_flight",
    "no-recheck": "",
    "no-deadline-wait": "returns_within_wait_bound",
    "no-loader-timeout": "returns_within_wait_bound",
    "no-restart": "stream_chunks_one_attempt",
    "no-chunk-fence": "follower_reads_own_flight",
    "nostore-stores": "nostore_never_stored",
    "session-renew-creates": "owner_view_within_servers",
    "fence-ignores-session": "no_store_after_takeover",
    "join-keeps-dead-meta": "",
    "watch-no-flight-peek": "follower_notices_within_lease",
    "watch-trusts-stale-epoch": "follower_notices_within_lease",
    "watch-ignores-gap": "follower_notices_within_lease",
    "watch-binds-across-gap": "follower_notices_within_lease",
    "bind-ignores-epoch": "owner_view_within_servers",
    "bind-not-given-up": "stale_owner_stops",
    "no-give-back": "",
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_every_mutant_gives_a_counterexample(mutant: str) -> None:
    assert set(CAUGHT_BY) == set(MUTANTS)
    scope = ALL[MUTANT_SCOPES[mutant]]
    res = check(Model(scope, mutant), liveness=not scope.symmetry)
    assert not res.ok, f"the checker missed mutant {mutant}"
    assert res.violation.startswith(CAUGHT_BY[mutant]), res.violation
    if res.violation:
        assert res.trace, "a violation comes with its trace"


def test_the_session_mutants_scope_of_make_model_holds_unmutated() -> None:
    """join-keeps-dead-meta is caught in sessions-unbacked-2 (a scope of ``make model``,
    not of the suite's): the unmodified model holds every invariant and both liveness
    properties there."""
    scope = ALL[MUTANT_SCOPES["join-keeps-dead-meta"]]
    assert scope not in SMALL and not scope.backstop
    res = check(Model(scope), liveness=True)
    assert res.ok, (res.violation, res.liveness, res.trace)


@pytest.mark.parametrize("name", ["flights-2", "live-2"])
def test_the_recheck_before_the_peek_keeps_every_invariant_too(name: str) -> None:
    """The follower's re-check as it was before 0cfd53e (``--no-peek``: join_flight at once,
    no peek_flight first): the default model has the peek."""
    scope = ALL[name]
    res = check(Model(scope, peek=False), liveness=not scope.symmetry)
    assert res.ok, (res.violation, res.liveness, res.trace)
    assert res.states > 1000


def test_a_caller_past_its_wait_bound_returns_where_the_mutant_waits_on() -> None:
    """no-deadline-wait's trace brings a follower to its deadline; the unmodified model, on
    the same path, returns FlightTimeout there (so the invariant is not vacuous)."""
    res = check(Model(ALL["bound-2"], "no-deadline-wait"))
    assert res.trace[-1] == "tick"
    m = Model(ALL["bound-2"])
    world = m.initial()
    for label in res.trace[:-1]:
        world = next(nxt for lab, _f, nxt, _w in m.successors(world) if lab == label)
    labels = [lab for lab, *_ in m.successors(world)]
    assert "p1 wait bound passes: FlightTimeout" in labels
    assert "tick" not in labels  # it returns before time passes


@pytest.mark.parametrize(
    ("issue", "invariant", "step"),
    [
        ("late-liveness", "no_stale_near_copy", "renews its liveness"),
        ("news-drop", "follower_reads_own_flight", "is lost"),
    ],
)
def test_known_issues_reproduce_in_the_code_before_their_fixes(
    issue: str, invariant: str, step: str
) -> None:
    """The model with the code's behaviour before each bug it found was fixed (docs/protocol.md,
    "The model check"); the default model has the fix, and holds in the same scope (one of
    the small ones, or of ``make model``'s)."""
    assert set(KNOWN_ISSUE_SCOPES) == set(KNOWN_ISSUES)
    res = check(Model(ALL[KNOWN_ISSUE_SCOPES[issue]], known=frozenset({issue})))
    assert res.violation.startswith(invariant), res.violation
    assert any(step in s for s in res.trace)


def test_a_counterexample_prints_as_a_numbered_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mutant", "no-marker"]) == 0
    out = capsys.readouterr().out
    assert "VIOLATED no_stale_near_copy" in out
    assert "        1. p" in out and "returns" in out


def test_help_lists_the_mutants_and_known_issues(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in (*MUTANTS, *KNOWN_ISSUES):
        assert name in out
    assert set(INVARIANTS) >= {"no_store_after_takeover", "no_stale_near_copy"}
