"""The session table and reading a request's session (pure)."""

from __future__ import annotations

from cortex.gateway.config.gateway import SessionConfig
from cortex.gateway.routing.placement import SessionHint, SessionTable, session_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, ttl_s: float = 600.0, live_s: float = 30.0, n: int = 100
          ) -> SessionTable:
    return SessionTable(ttl_s, live_s, n, clock)


def test_session_of_reads_the_first_configured_header_then_the_prompt_cache_key() -> None:
    config = SessionConfig()
    assert session_of({"session-id": "s1", "x-session-id": "s2"}, {}, config) == "s1"
    assert session_of({"x-claude-code-session-id": "cc"}, {"prompt_cache_key": "k"},
                      config) == "cc"
    assert session_of({}, {"prompt_cache_key": "k"}, config) == "k"
    assert session_of({}, {"prompt_cache_key": 5}, config) is None
    assert session_of({"session-id": "x" * 257}, {}, config) is None
    assert session_of({"session-id": "a\nb"}, {}, config) is None
    assert session_of({"thread-id": "t"}, {}, SessionConfig(enabled=False)) is None
    assert session_of({"session-id": "s"}, {"prompt_cache_key": "k"},
                      SessionConfig(headers=("X-Agent",), prompt_cache_key=False)) is None
    assert session_of({"x-agent": "a"}, {}, SessionConfig(headers=(" X-Agent ",))) == "a"


def test_a_continued_prompt_is_credited_with_the_last_turns_blocks() -> None:
    t = table(Clock())
    assert t.hint("m", "s", [1, 2, 3]) is None
    t.record("m", "s", "w1", [1, 2, 3])
    assert t.hint("m", "s", [1, 2, 3, 4, 5]) == SessionHint("w1", 3)
    assert t.hint("m", "s", [1, 2, 9, 4]) == SessionHint("w1", 0)  # diverged: a tie-breaker
    assert t.hint("m", "s", [1, 2]) == SessionHint("w1", 0)  # shorter than the last turn
    assert t.hint("other-model", "s", [1, 2, 3]) is None


def test_an_evicted_last_block_ends_the_credit_but_not_the_hint() -> None:
    t = table(Clock())
    t.record("m", "s", "w1", [1, 2, 3])
    t.forget_keys("w2", [3])  # another worker's eviction
    assert t.hint("m", "s", [1, 2, 3, 4]) == SessionHint("w1", 3)
    t.forget_keys("w1", [3])
    assert t.hint("m", "s", [1, 2, 3, 4]) == SessionHint("w1", 0)


def test_live_sessions_per_worker_expire_after_live_s_and_move_with_their_session() -> None:
    clock = Clock()
    t = table(clock)
    t.record("m", "a", "w1", [1])
    t.record("m", "b", "w1", [2])
    t.record("m", "c", "w2", [3])
    assert (t.live("w1"), t.live("w2"), t.live("w3")) == (2, 1, 0)
    assert t.live("w1", besides=("m", "a")) == 1 and t.live("w2", besides=("m", "a")) == 1
    t.record("m", "a", "w2", [1, 4])  # its next turn went elsewhere
    assert (t.live("w1"), t.live("w2")) == (1, 2)
    clock.now += 20
    t.record("m", "b", "w1", [2, 5])
    clock.now += 15  # a and c: 35 s since their last turn; b: 15 s
    assert (t.live("w1"), t.live("w2")) == (1, 0)
    assert t.hint("m", "a", [1, 4]) == SessionHint("w2", 2)  # remembered past live_s


def test_the_table_is_bounded_by_age_and_size() -> None:
    clock = Clock()
    t = table(clock, ttl_s=60.0, live_s=60.0, n=3)
    for i in range(5):
        t.record("m", f"s{i}", "w", [i])
    assert len(t) == 3 and t.evicted == 2 and t.live("w") == 3
    assert t.hint("m", "s0", [0]) is None and t.hint("m", "s4", [4]) is not None
    t.hint("m", "s2", [2])  # reading does not refresh
    clock.now += 60
    assert len(t) == 0 or t.hint("m", "s2", [2]) is None
    assert len(t) == 0 and t.live("w") == 0


def test_forget_worker_and_moved() -> None:
    t = table(Clock())
    t.record("m", "a", "w1", [1, 2])
    t.record("m", "b", "w2", [3])
    t.moved("m", "a", "w3")
    assert t.hint("m", "a", [1, 2]) == SessionHint("w3", 2)
    assert (t.live("w1"), t.live("w3")) == (0, 1)
    t.forget_keys("w3", [2])
    assert t.hint("m", "a", [1, 2]) == SessionHint("w3", 0)
    t.forget_worker("w3")
    assert t.hint("m", "a", [1, 2]) is None and t.live("w3") == 0
    assert t.hint("m", "b", [3]) == SessionHint("w2", 1)
    t.moved("m", "unknown", "w1")
    assert len(t) == 1
