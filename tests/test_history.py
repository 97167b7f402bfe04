"""The history proposer: exact proposals on hand-built histories, eviction, memory, and agreement with
a brute-force reference (longest suffix match, then the majority continuation) on random histories.
"""

import random
import sys
from array import array

import pytest

from tlt_trainers.proposers.rollout_history import HistoryMatch, RolloutHistory, _Node


def reference_propose(sequences, context, max_tokens, min_match, max_match, context_hits=8):
    """Brute force: rescan every source for the longest suffix at every token. The context counts its
    ``context_hits`` most recent occurrences."""
    ctx = list(context)
    proposed, fracs, match_length = [], [], None
    while True:
        best = None
        for n in range(min(max_match, len(ctx)), min_match - 1, -1):
            suffix = ctx[len(ctx) - n :]
            counts, ctx_counts = {}, {}
            for seq in sequences:
                for i in range(n, len(seq)):
                    if seq[i - n : i] == suffix:
                        counts[seq[i]] = counts.get(seq[i], 0) + 1
            hits = [i for i in range(n, len(ctx)) if ctx[i - n : i] == suffix]  # the context, one more source
            for i in hits[::-1][:context_hits]:
                counts[ctx[i]] = counts.get(ctx[i], 0) + 1
                ctx_counts[ctx[i]] = ctx_counts.get(ctx[i], 0) + 1
            if counts:
                token = max(counts, key=lambda t: (counts[t], ctx_counts.get(t, 0), -t))
                best = n, token, counts[token] / sum(counts.values())
                break
        if match_length is None:
            match_length = best[0] if best else 0
        if best is None or len(proposed) >= max_tokens:
            break
        proposed.append(best[1])
        fracs.append(best[2])
        ctx.append(best[1])
    return proposed, match_length, fracs


def deep_size(index):
    """What the index really holds, by walking it with sys.getsizeof."""
    seen, total = set(), 0

    def visit(obj):
        nonlocal total
        if id(obj) in seen or (type(obj) is int and -5 <= obj <= 256):
            return
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, _Node):
            for o in (obj.children, obj.counts):
                if o is not None:
                    visit(o)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                visit(k)
                visit(v)
        elif hasattr(obj, "__slots__"):
            for name in obj.__slots__:
                visit(getattr(obj, name))

    visit(index._groups)
    visit(index._seqs)
    return total


def test_sibling_continues_the_same_suffix():
    index = RolloutHistory()
    index.add("g", [1, 2, 3, 4, 5, 6])
    prop = index.propose("g", [9, 2, 3], 10)
    assert prop == HistoryMatch([4, 5, 6], 2, 1.0, [1.0, 1.0, 1.0])  # stops where the sibling ends


def test_longest_match_first_then_the_most_frequent_continuation():
    index = RolloutHistory()
    for seq in ([1, 2, 3, 7], [1, 2, 3, 7], [5, 2, 3, 8], [6, 2, 3, 8], [4, 2, 3, 8]):
        index.add("g", seq)
    prop = index.propose("g", [9, 2, 3], 1)
    assert (prop.tokens, prop.match_length, prop.confidence) == ([8], 2, pytest.approx(3 / 5))
    prop = index.propose("g", [1, 2, 3], 1)  # the 3-token match outranks the more frequent 8
    assert (prop.tokens, prop.match_length, prop.confidence) == ([7], 3, 1.0)


def test_confidence_decays_along_the_chain():
    index = RolloutHistory()
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [0, 2, 3, 4, 6]):
        index.add("g", seq)
    prop = index.propose("g", [7, 2, 3], 2)
    assert prop.tokens == [4, 5]
    assert prop.token_confidence == [1.0, pytest.approx(2 / 3)]
    assert prop.confidence == pytest.approx(2 / 3)
    assert prop.token_support == [3, 2]  # occurrences behind each proposed token


def test_support_counts_the_occurrences_behind_each_token():
    index = RolloutHistory(search_context=False)
    index.add("g", [1, 2, 3, 4])
    single = index.propose("g", [2, 3], 1)
    for _ in range(3):
        index.add("g", [1, 2, 3, 4])
    agreed = index.propose("g", [2, 3], 1)
    assert single.token_confidence == agreed.token_confidence == [1.0]  # the share cannot tell them apart
    assert (single.token_support, agreed.token_support) == ([1], [4])


def test_own_context_lookup():
    index = RolloutHistory()  # no history at all: the prompt's numbers are restated
    prop = index.propose("g", [10, 11, 12, 13, 99, 10, 11], 2)
    assert (prop.tokens, prop.match_length) == ([12, 13], 2)
    # A loop in the row's own tail continues through the proposed tokens.
    assert index.propose("g", [5, 6, 5, 6], 5).tokens == [5, 6, 5, 6, 5]
    assert RolloutHistory(search_context=False).propose("g", [5, 6, 5, 6], 5).tokens == []


def test_own_context_counts_its_most_recent_occurrences():
    ctx = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 4, 6, 1, 2]  # 3 thrice, 4 twice but lately
    assert RolloutHistory().propose("g", ctx, 1).tokens == [3]
    assert RolloutHistory(max_context_hits=2).propose("g", ctx, 1).tokens == [4]
    assert RolloutHistory(max_context_hits=2).propose("g", ctx, 1).confidence == 1.0


def test_tie_goes_to_the_rows_own_context():
    index = RolloutHistory()
    index.add("g", [1, 2, 8])
    assert index.propose("g", [1, 2, 9, 1, 2], 1).tokens == [9]
    assert index.propose("g", [0, 2, 9, 1, 2], 1).tokens == [8]  # no tie: the history's 2-match wins


def test_no_match_is_an_empty_proposal():
    index = RolloutHistory()
    index.add("g", [1, 2, 3, 4])
    for ctx in ([], [4], [3, 1], [2, 3, 4]):  # [2, 3, 4] occurs, but nothing follows it
        assert index.propose("g", ctx, 4) == HistoryMatch([], 0, 0.0, [])


def test_min_match_is_respected():
    index = RolloutHistory(min_match=3)
    index.add("g", [1, 2, 3, 4, 5])
    assert index.propose("g", [9, 3, 4], 3).tokens == []
    assert index.propose("g", [2, 3, 4], 3).tokens == [5]


def test_max_match_caps_the_reported_match():
    index = RolloutHistory(max_match=3)
    index.add("g", list(range(10)))
    prop = index.propose("g", list(range(6)), 2)
    assert (prop.tokens, prop.match_length) == ([6, 7], 3)


def test_max_tokens_is_respected():
    index = RolloutHistory()
    index.add("g", list(range(20)))
    for n in (0, 1, 3, 7):
        prop = index.propose("g", [0, 1], n)
        assert prop.tokens == list(range(2, 2 + n))
        assert prop.match_length == 2  # reported even when nothing is asked for


def test_keys_are_isolated():
    index = RolloutHistory()
    index.add("a", [1, 2, 3])
    index.add(("b", 7), [1, 2, 4])
    assert index.propose("a", [1, 2], 1).tokens == [3]
    assert index.propose(("b", 7), [1, 2], 1).tokens == [4]
    assert index.propose("c", [1, 2], 1).tokens == []


def test_eviction_by_steps_frees_memory():
    index = RolloutHistory(keep_steps=2)
    empty = index.nbytes()
    index.add("g", [1, 2, 3] + list(range(300, 400)))
    index.new_step()
    index.add("g", [1, 2, 4] + list(range(500, 600)))
    assert index.num_tokens == 206
    assert index.propose("g", [1, 2], 1).tokens == [3]  # tie between steps: the smaller id
    full = index.nbytes()
    index.new_step()  # the first step's sequence is now 2 steps old
    assert index.num_tokens == 103
    assert index.propose("g", [1, 2], 1).tokens == [4]
    assert index.propose("g", [300, 301], 1).tokens == []
    assert empty < index.nbytes() < full
    index.new_step()
    assert index.num_tokens == 0 and index.propose("g", [1, 2], 1).tokens == []
    assert index.nbytes() == deep_size(index) < full / 10  # only the emptied registries' own allocations
    assert not index._groups  # the group's trie is gone too


def test_discard_forgets_only_the_sequences_with_that_prefix():
    index = RolloutHistory(search_context=False)
    index.add("g", [1, 2, 3, 7, 8])  # the replayed row's own answer
    index.add("g", [1, 2, 4, 5, 6])  # a sibling
    index.add("h", [1, 2, 3, 9, 9])  # another prompt
    before = index.nbytes()
    assert index.discard("g", [1, 2, 3]) == 1
    assert index.num_tokens == 10 and index.nbytes() < before
    assert index.propose("g", [1, 2], 3).tokens == [4, 5, 6]  # only the sibling is left
    assert index.propose("h", [2, 3], 2).tokens == [9, 9]
    assert index.discard("g", [1, 2, 3]) == 0


def test_eviction_by_max_tokens_keeps_memory_bounded():
    index = RolloutHistory(max_tokens=250)
    sizes = []
    for i in range(20):
        index.add(i % 3, [i, i + 1] + [1000 + 10 * i + j for j in range(98)])
        assert index.num_tokens <= 250
        sizes.append(index.nbytes())
    assert index.num_tokens == 200  # the two newest sequences
    assert index.propose(19 % 3, [19, 20], 1).tokens == [1190]
    assert index.propose(17 % 3, [17, 18], 1).tokens == []  # the oldest went first
    assert max(sizes[5:]) <= 1.05 * min(sizes[5:])  # flat once full
    index.add("big", list(range(1000)))  # longer than the bound: its tail is kept
    assert index.num_tokens == 250
    assert index.propose("big", [998], 1).tokens == []
    assert index.propose("big", [997, 998], 1).tokens == [999]
    index.clear()
    assert index.num_tokens == 0 and index.nbytes() == RolloutHistory().nbytes()


def test_nbytes_is_honest():
    rng = random.Random(0)
    index = RolloutHistory(max_tokens=6000)
    base = [rng.randrange(2000) for _ in range(400)]
    for step in range(4):
        for g in range(3):
            for _ in range(6):
                seq = [t if rng.random() > 0.1 else rng.randrange(2000) for t in base]
                index.add(g, seq)
        if step < 3:
            index.new_step()
        assert index.nbytes() == pytest.approx(deep_size(index), rel=0.15)


def test_propose_many_equals_propose():
    rng = random.Random(1)
    index = RolloutHistory()
    for g in range(3):
        for _ in range(4):
            index.add(g, [rng.randrange(5) for _ in range(60)])
    keys = [rng.randrange(4) for _ in range(10)]
    contexts = [[rng.randrange(5) for _ in range(rng.randrange(30))] for _ in range(10)]
    limits = [rng.randrange(6) for _ in range(10)]
    assert index.propose_many(keys, contexts, limits) == [index.propose(*row) for row in zip(keys, contexts, limits)]
    assert index.propose_many(keys, contexts, 3) == [index.propose(k, c, 3) for k, c in zip(keys, contexts)]


@pytest.mark.parametrize("min_match,max_match,hits", [(1, 4, 16), (2, 3, 1), (2, 6, 2), (3, 3, 16)])
def test_matches_brute_force_reference(min_match, max_match, hits):
    rng = random.Random(min_match * 10 + max_match)
    index = RolloutHistory(max_tokens=300, min_match=min_match, max_match=max_match, keep_steps=2,
                           max_context_hits=hits)
    live = []  # (key, step, tokens) in insertion order, evicted like the index does
    step = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.1:
            step += 1
            index.new_step()
            live = [s for s in live if s[1] > step - 2]
        elif op < 0.5:
            key = rng.randrange(3)
            seq = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
            index.add(key, seq)
            if len(seq) > min_match:
                live.append((key, step, seq))
                while sum(len(s[2]) for s in live) > 300:
                    live.pop(0)
            assert index.num_tokens == sum(len(s[2]) for s in live)
        else:
            key = rng.randrange(4)
            context = [rng.randrange(4) for _ in range(rng.randrange(25))]
            n = rng.randrange(8)
            prop = index.propose(key, context, n)
            want, want_len, want_fracs = reference_propose(
                [s[2] for s in live if s[0] == key], context, n, min_match, max_match, hits
            )
            assert (prop.tokens, prop.match_length) == (want, want_len)
            assert prop.token_confidence == pytest.approx(want_fracs)
    while live:  # evicting everything leaves an empty index behind
        step += 1
        index.new_step()
        live = [s for s in live if s[1] > step - 2]
    assert index.num_tokens == 0 and not index._groups


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        RolloutHistory(max_tokens=-1)
    with pytest.raises(ValueError, match="min_match must be >= 1"):
        RolloutHistory(min_match=0)
    with pytest.raises(ValueError, match=r"min_match \(5\) must be <= max_match \(4\)"):
        RolloutHistory(min_match=5, max_match=4)
    with pytest.raises(ValueError, match="keep_steps must be >= 1"):
        RolloutHistory(keep_steps=0)
    with pytest.raises(ValueError, match="max_context_hits must be >= 1"):
        RolloutHistory(max_context_hits=0)
    index = RolloutHistory()
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        index.propose("g", [1, 2], -1)
    with pytest.raises(ValueError, match="strip padding"):
        index.add("g", [1, 2, -100])
    with pytest.raises(ValueError, match="token ids"):
        index.propose("g", [1.5, 2], 1)
    with pytest.raises(ValueError, match="3 keys for 2 contexts"):
        index.propose_many([1, 2, 3], [[1], [2]], 1)
    assert index.propose("g", array("I", [1, 2]), 1).tokens == []  # any sequence of ints will do
