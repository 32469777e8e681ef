"""One match type: Match and SourceMatch, and their protobuf translation (cortex.ledger.codec)."""

from __future__ import annotations

from cortex.hashing import Engine, HashDomain
from cortex.ledger.codec import lenient_state, match_from_pb, match_to_pb, pb
from cortex.ledger.match import Match, SourceMatch
from cortex.ledger.model import LedgerState, Source, Tier

DOMAIN = HashDomain("m", 16, Engine.VLLM)
READY = LedgerState.READY


def test_a_match_knows_its_shared_prefix_its_deepest_source_and_each_source() -> None:
    match = Match.of([
        SourceMatch(Source("a"), 3, READY),
        SourceMatch(Source("a", 0, Tier.HOST), 2, READY),
        SourceMatch(Source("pool", 0, Tier.SHARED), 7, READY),
        SourceMatch(Source("stale", 0, Tier.SHARED), 9, LedgerState.STALE),  # not credited
    ], version=4, query_blocks=10, domain=DOMAIN)
    assert match.shared_blocks == 7 and match.deepest == 9
    assert match.blocks_of("a") == 3 and match.blocks_of("a", tier=Tier.HOST) == 2
    assert match.blocks_of("nobody") == 0
    assert match.sources[1].worker_id == "a" and match.sources[1].tier is Tier.HOST


def test_a_match_crosses_the_wire_unchanged_but_for_what_the_wire_does_not_carry() -> None:
    sent = Match.of([
        SourceMatch(Source("a"), 3, READY),
        SourceMatch(Source("a", 0, Tier.HOST), 2, READY),
        SourceMatch(Source("a", 0, Tier.DISK), 0, READY),  # adds nothing: not sent
        SourceMatch(Source("b", 1), 0, LedgerState.SYNCING),
        SourceMatch(Source("c", 0, Tier.HOST), 4, READY),  # an offload source alone
        SourceMatch(Source("pool", 0, Tier.SHARED), 5, READY),  # only as shared_blocks
    ], version=11, query_blocks=8, domain=DOMAIN)
    reply = pb.MatchResponse()
    match_to_pb(sent, reply)
    got = match_from_pb(pb.MatchResponse.FromString(reply.SerializeToString()))
    assert (got.version, got.query_blocks, got.domain, got.shared_blocks) == (
        11, 8, DOMAIN, 5)
    assert set(got.sources) == {
        SourceMatch(Source("a"), 3, READY), SourceMatch(Source("a", 0, Tier.HOST), 2, READY),
        SourceMatch(Source("b", 1), 0, LedgerState.SYNCING),
        SourceMatch(Source("c"), 0, LedgerState.UNSPECIFIED),  # its rank has no device match
        SourceMatch(Source("c", 0, Tier.HOST), 4, READY)}
    assert next(m for m in reply.matches if m.worker_id == "a").matched_tokens == 48


def test_a_match_without_a_domain_sends_only_its_size_and_a_newer_peers_values_are_read() -> None:
    reply = pb.MatchResponse()
    match_to_pb(Match((), 3, 2), reply)
    assert (reply.index_version, reply.query_blocks, len(reply.matches)) == (3, 2, 0)
    assert match_from_pb(reply).domain is None
    assert lenient_state(99) is LedgerState.UNSPECIFIED
    reply.matches.add(worker_id="w", matched_blocks=1, state=99).tiers.add(tier=42, blocks=3)
    (only,) = match_from_pb(reply).sources  # the unknown tier is skipped
    assert only == SourceMatch(Source("w"), 1, LedgerState.UNSPECIFIED)
