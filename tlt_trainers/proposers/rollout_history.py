"""History drafting: propose draft tokens by matching the current suffix against earlier rollouts.

GRPO samples several answers per prompt and revisits the same prompts step after step, so rollouts
repeat themselves: shared reasoning scaffolds, restated numbers, closing formulas. A row's own
context repeats too (an answer restates the prompt's numbers; a degenerate tail loops). Looking the
current suffix up in what was already generated costs no neural compute. A proposal is a point mass
(q = one-hot), which the engine's rejection sampling verifies exactly, so a bad proposal costs
speed, never correctness.

The rule (SuffixDecoding-style): find the longest suffix of the context, at most ``max_match`` and at
least ``min_match`` tokens, that occurs followed by a token in the sources (the sequences added under
the row's key, and the row's own context); propose the most frequent token that followed it; append
it and match again; stop at ``max_tokens`` or when the match falls below ``min_match``.

Data structure, and why. Each key (a GRPO group) owns a context trie over reversed contexts (as in
PPM compression): the path root -> x[p-1] -> x[p-2] -> ... leads to the node of the context that
precedes position p, and the node counts the tokens that followed that context. A lookup walks at
most ``max_match`` dict lookups from the root whatever the history's size, and an insertion walks as
many (O(len * max_match), no rebuilds). An n-gram table keyed by the last n tokens stores every
context length of every position (up to ``max_match - min_match + 1`` entries a token); here a context
that occurred once is a single leaf that points into the stored tokens, expanded into nodes only when a
second occurrence shares it, so memory follows the repeated content rather than the history's length.
Scanning the raw tokens (``bytes.find``) needs 4 bytes a token but time in proportion to the history,
several times a token: too slow for a group's history, right for the row's own context (a few thousand
tokens, nothing to keep up to date between calls). Measured sizes and times: docs/adaptive_engine.md.

There is no global pool across keys: a lookup is only as cheap as the sources it searches, cross-
prompt matches are mostly generic phrasing that the model drafter already predicts, and a caller
who wants a shared pool can add sequences under a shared key.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

_TYPECODE = "I"  # 4-byte unsigned token ids: the stored history and the own-context search buffer
_WIDTH = array(_TYPECODE).itemsize
_POS_BITS = 32  # a leaf is uid << _POS_BITS | pos: one int instead of a tuple
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass
class HistoryMatch:
    """Draft tokens proposed from history for one row: a point mass at each position."""

    tokens: list[int]  # proposed continuation of the context, 0..max_tokens tokens
    match_length: int  # length of the context's suffix that matched (0 when under min_match)
    confidence: float  # product of token_confidence: share of the history that agrees with the chain (0 if empty)
    token_confidence: list[float] = field(default_factory=list)  # per token: count(chosen) / count(all) at its match
    # per token: count(chosen), the occurrences that back it (one sibling's say-so is weaker than four agreeing)
    token_support: list[int] = field(default_factory=list, compare=False)


class _Node:
    """A context that occurred at least twice (one whose occurrences were evicted down to one stays a node)."""

    __slots__ = ("children", "counts", "total")

    def __init__(self) -> None:
        # Keyed by the token before this context; a value is a _Node or a leaf int (one occurrence).
        self.children: dict[int, _Node | int] | None = None
        # Tokens that followed this context: None below min_match (never proposed from), the token
        # itself while a single token followed every occurrence (the common case deep in the trie;
        # saves a dict), else {token: count}.
        self.counts: int | dict[int, int] | None = None
        self.total = 0  # occurrences of this context in the history (the sum of counts)


@dataclass(slots=True)
class _Seq:
    key: Hashable
    step: int
    tokens: array


def _dict_bytes_table(n: int) -> list[int]:
    """sys.getsizeof of an int-keyed dict grown to 0..n-1 entries (CPython over-allocates in steps)."""
    d: dict[int, int] = {}
    sizes = []
    for k in range(n):
        sizes.append(sys.getsizeof(d))
        d[k + 1000] = k
    return sizes


_DICT_BYTES = _dict_bytes_table(1025)
_NODE_BYTES = sys.getsizeof(_Node())
_INT_BYTES = sys.getsizeof(1 << 40)  # a leaf, or a key outside CPython's small-int cache
# A stored sequence: its record, its array's header, its uid key and the registry's dict entry (~40 B).
_SEQ_BYTES = sys.getsizeof(_Seq(0, 0, array(_TYPECODE))) + sys.getsizeof(array(_TYPECODE)) + _INT_BYTES + 40


def _dict_bytes(n: int) -> int:
    if n < len(_DICT_BYTES):
        return _DICT_BYTES[n]
    return _DICT_BYTES[-1] + (n - len(_DICT_BYTES) + 1) * 40  # ~24 B an entry plus the index, at 2/3 load


def _as_tokens(tokens: Sequence[int], what: str) -> array:
    try:
        return array(_TYPECODE, tokens)
    except (OverflowError, TypeError) as err:
        raise ValueError(
            f"{what} must be a sequence of token ids in [0, 2**{8 * _WIDTH}) (a list of ints; use "
            f"tensor.tolist() and strip padding first): {err}"
        ) from None


class RolloutHistory:
    """Proposes draft tokens by suffix matching against earlier sequences of the same key.

    Args:
        max_tokens: at most this many history tokens are kept; the oldest sequences are evicted first.
            Memory per token grows with how much the rollouts repeat each other, see ``nbytes``.
        max_match: longest suffix that is matched (longer contexts are not told apart).
        min_match: shortest suffix that may propose a token.
        keep_steps: sequences are kept for this many RL steps, the current one included (see ``new_step``).
        search_context: also match against the row's own context (prompt lookup).
        max_context_hits: the own context counts only its most recent occurrences of the matched suffix,
            at most this many. Counting all of them would cost a Python step per occurrence, and a row
            stuck in a loop (the long tail's classic) has one every few tokens.
    """

    def __init__(
        self,
        max_tokens: int = 1_000_000,
        max_match: int = 16,
        min_match: int = 2,
        keep_steps: int = 4,
        search_context: bool = True,
        max_context_hits: int = 8,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 keeps no history), got {max_tokens}")
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if min_match > max_match:
            raise ValueError(f"min_match ({min_match}) must be <= max_match ({max_match})")
        if max_context_hits < 1:
            raise ValueError(
                f"max_context_hits must be >= 1 (search_context=False turns the search off), got {max_context_hits}"
            )
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1 (1 keeps only the current step), got {keep_steps}")
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.min_match = min_match
        self.keep_steps = keep_steps
        self.search_context = search_context
        self.max_context_hits = max_context_hits
        self.clear()

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Forget all history (the step counter too)."""
        self._groups: dict[Hashable, _Node] = {}
        self._seqs: dict[int, _Seq] = {}  # insertion order = age: the first is the oldest
        self._next_uid = 0
        self._step = 0
        self._num_tokens = 0
        self._bytes = 0  # trie + stored tokens, kept up to date by every mutation

    @property
    def num_tokens(self) -> int:
        """Tokens of history held (the sum of the stored sequences' lengths)."""
        return self._num_tokens

    def nbytes(self) -> int:
        """Estimated bytes held: trie nodes, their dicts and ints, and the stored token arrays.

        Tracked incrementally from CPython's object sizes (O(1) to read); it ignores allocator
        overhead and the slack that dicts keep after deletions.
        """
        return self._bytes + sys.getsizeof(self._groups) + sys.getsizeof(self._seqs)

    # ------------------------------------------------------------------ updates

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Index a finished rollout (or a prompt) under ``key``; O(len(tokens) * max_match).

        Add ``prompt + completion`` to let a row's first tokens match its siblings' (the context then
        ends with the prompt), or the completion alone to store less. A sequence longer than
        ``max_tokens`` keeps its last ``max_tokens`` tokens.
        """
        toks = _as_tokens(tokens, "tokens")
        if len(toks) > self.max_tokens:
            toks = toks[len(toks) - self.max_tokens :]
        if len(toks) <= self.min_match:
            return  # no context of min_match tokens with a token after it
        while self._seqs and self._num_tokens + len(toks) > self.max_tokens:
            self._evict(next(iter(self._seqs)))
        uid = self._next_uid
        self._next_uid += 1
        self._seqs[uid] = _Seq(key, self._step, toks)
        self._num_tokens += len(toks)
        self._bytes += _SEQ_BYTES + _WIDTH * len(toks)
        root = self._groups.get(key)
        if root is None:
            root = self._groups[key] = _Node()
            self._bytes += _NODE_BYTES
        for pos in range(self.min_match, len(toks)):
            self._insert(root, uid, toks, pos)

    def discard(self, key: Hashable, prefix: Sequence[int]) -> int:
        """Forget the sequences of ``key`` that begin with ``prefix``; returns how many.

        For replaying a row whose answer is already indexed (a benchmark continuing a finished rollout): left in,
        the row would find its own future in the history, which no real rollout can.
        """
        head = _as_tokens(prefix, "prefix")
        doomed = [uid for uid, seq in self._seqs.items() if seq.key == key and seq.tokens[: len(head)] == head]
        for uid in doomed:
            self._evict(uid)
        return len(doomed)

    def new_step(self) -> None:
        """Mark an RL step boundary: sequences added ``keep_steps`` or more steps ago are evicted."""
        self._step += 1
        oldest_kept = self._step - self.keep_steps + 1
        while self._seqs:
            uid = next(iter(self._seqs))
            if self._seqs[uid].step >= oldest_kept:
                break
            self._evict(uid)

    def _evict(self, uid: int) -> None:
        seq = self._seqs[uid]
        root = self._groups[seq.key]
        for pos in range(self.min_match, len(seq.tokens)):
            self._remove(root, uid, seq.tokens, pos)
        del self._seqs[uid]
        self._num_tokens -= len(seq.tokens)
        self._bytes -= _SEQ_BYTES + _WIDTH * len(seq.tokens)
        if root.total == 0:
            del self._groups[seq.key]
            self._bytes -= _NODE_BYTES

    def _insert(self, root: _Node, uid: int, toks: array, pos: int) -> None:
        """Count the occurrence of toks[:pos]'s contexts (up to max_match long) followed by toks[pos]."""
        nxt = toks[pos]
        node = root
        node.total += 1
        depth = 0
        limit = min(self.max_match, pos)
        while depth < limit:
            t = toks[pos - depth - 1]
            depth += 1
            children = node.children
            if children is None:
                children = node.children = {}
                self._bytes += _DICT_BYTES[0]
            child = children.get(t)
            if child is None:  # first occurrence of this context: one leaf, no nodes below
                self._bytes += _dict_bytes(len(children) + 1) - _dict_bytes(len(children)) + _INT_BYTES
                if t > 256:
                    self._bytes += _INT_BYTES
                children[t] = uid << _POS_BITS | pos
                return
            if type(child) is int:  # second occurrence: expand the leaf into a node holding it
                child = children[t] = self._expand(child, depth)
            child.total += 1
            if depth >= self.min_match:
                counts = child.counts
                if type(counts) is int:
                    if counts != nxt:
                        child.counts = {counts: child.total - 1, nxt: 1}
                        self._bytes += _DICT_BYTES[2] + (counts > 256) * _INT_BYTES + (nxt > 256) * _INT_BYTES
                else:
                    n = len(counts)
                    if nxt not in counts:
                        self._bytes += _dict_bytes(n + 1) - _dict_bytes(n) + (nxt > 256) * _INT_BYTES
                    counts[nxt] = counts.get(nxt, 0) + 1
            node = child

    def _expand(self, leaf: int, depth: int) -> _Node:
        """A node at ``depth`` for the single occurrence a leaf stood for, with the leaf one level down."""
        uid, pos = leaf >> _POS_BITS, leaf & _POS_MASK
        toks = self._seqs[uid].tokens
        node = _Node()
        node.total = 1
        self._bytes += _NODE_BYTES - _INT_BYTES
        if depth >= self.min_match:
            node.counts = toks[pos]
        if depth < min(self.max_match, pos):
            t = toks[pos - depth - 1]
            node.children = {t: leaf}
            self._bytes += _DICT_BYTES[1] + _INT_BYTES + (t > 256) * _INT_BYTES
        return node

    def _remove(self, root: _Node, uid: int, toks: array, pos: int) -> None:
        """Undo ``_insert(root, uid, toks, pos)``."""
        nxt = toks[pos]
        node = root
        node.total -= 1
        depth = 0
        limit = min(self.max_match, pos)
        while depth < limit:
            t = toks[pos - depth - 1]
            depth += 1
            children = node.children
            child = children[t]
            if type(child) is int or child.total == 1:  # only this occurrence lies below: drop it all
                del children[t]
                self._bytes -= _dict_bytes(len(children) + 1) - _dict_bytes(len(children)) + (t > 256) * _INT_BYTES
                self._bytes -= self._subtree_bytes(child)
                if not children:
                    node.children = None
                    self._bytes -= _DICT_BYTES[0]
                return
            child.total -= 1
            if depth >= self.min_match and type(child.counts) is dict:
                counts = child.counts
                counts[nxt] -= 1
                if counts[nxt] == 0:
                    del counts[nxt]
                    self._bytes -= _dict_bytes(len(counts) + 1) - _dict_bytes(len(counts)) + (nxt > 256) * _INT_BYTES
                    if len(counts) == 1:
                        (only,) = counts
                        child.counts = only
                        self._bytes -= _DICT_BYTES[1] + (only > 256) * _INT_BYTES
            node = child

    def _subtree_bytes(self, child: _Node | int) -> int:
        """Bytes of a subtree that holds a single occurrence (a chain at most max_match long)."""
        total = 0
        while type(child) is not int:
            total += _NODE_BYTES
            if type(child.counts) is dict:
                total += _dict_bytes(len(child.counts)) + sum((t > 256) * _INT_BYTES for t in child.counts)
            if child.children is None:
                return total
            ((t, child),) = child.children.items()
            total += _DICT_BYTES[1] + (t > 256) * _INT_BYTES
        return total + _INT_BYTES

    # ------------------------------------------------------------------ proposals

    def propose(self, key: Hashable, context: Sequence[int], max_tokens: int) -> HistoryMatch:
        """Propose up to ``max_tokens`` tokens continuing ``context`` (the row's prompt + tokens so far).

        A key with no history leaves the row's own context as the only source. ``match_length`` is
        reported even for ``max_tokens=0``: a cheap signal of how well history covers the row.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        toks = _as_tokens(context, "context")
        buf = bytearray(toks) if self.search_context else None
        root = self._groups.get(key)
        proposed: list[int] = []
        token_conf: list[float] = []
        token_support: list[int] = []
        match_length = 0
        while True:
            length, token, frac, support = self._predict(root, toks, buf)
            if not proposed:
                match_length = length
            if length == 0 or len(proposed) >= max_tokens:
                break
            proposed.append(token)
            token_conf.append(frac)
            token_support.append(support)
            toks.append(token)
            if buf is not None:
                buf += token.to_bytes(_WIDTH, sys.byteorder)
            if len(proposed) >= max_tokens:
                break
        confidence = 0.0
        if proposed:
            confidence = 1.0
            for c in token_conf:
                confidence *= c
        return HistoryMatch(proposed, match_length, confidence, token_conf, token_support)

    def propose_many(
        self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]], max_tokens: int | Sequence[int]
    ) -> list[HistoryMatch]:
        """``propose`` for each row; ``max_tokens`` is one limit for all rows or one per row."""
        if len(keys) != len(contexts):
            raise ValueError(f"got {len(keys)} keys for {len(contexts)} contexts")
        limits = [max_tokens] * len(keys) if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != len(keys):
            raise ValueError(f"got {len(limits)} max_tokens for {len(keys)} rows")
        return [self.propose(k, c, n) for k, c, n in zip(keys, contexts, limits)]

    def _predict(self, root: _Node | None, toks: array, buf: bytearray | None) -> tuple[int, int, float, int]:
        """(match length, most frequent next token, its share, its count) for the current suffix; (0, -1, 0, 0)
        if none."""
        size = len(toks)
        min_match = self.min_match
        limit = min(self.max_match, size)
        # History: walk the reversed context down the key's trie.
        hist_len, hist_node, hist_leaf_token = 0, None, -1
        node, depth = root, 0
        while node is not None and depth < limit and node.children is not None:
            child = node.children.get(toks[size - depth - 1])
            if child is None:
                break
            depth += 1
            if type(child) is int:  # a single occurrence: compare the rest of the context directly
                uid, pos = child >> _POS_BITS, child & _POS_MASK
                seq = self._seqs[uid].tokens
                stop = min(limit, pos)
                while depth < stop and seq[pos - depth - 1] == toks[size - depth - 1]:
                    depth += 1
                if depth >= min_match:
                    hist_len, hist_node, hist_leaf_token = depth, None, seq[pos]
                break
            node = child
            if depth >= min_match:
                hist_len, hist_node = depth, node
        # Own context: the longest suffix (>= hist_len) that occurs earlier with a token after it.
        ctx_len = 0
        if buf is not None:
            lo, hi = max(min_match, hist_len), min(self.max_match, size - 1)
            if lo <= hi and _rfind_suffix(buf, lo, size) >= 0:
                ctx_len = lo
                while ctx_len < hi:  # binary search: occurring is monotone in the suffix length
                    mid = (ctx_len + hi + 1) // 2
                    if _rfind_suffix(buf, mid, size) >= 0:
                        ctx_len = mid
                    else:
                        hi = mid - 1
        length = max(hist_len, ctx_len)
        if length == 0:
            return 0, -1, 0.0, 0
        counts: dict[int, int] = {}
        if hist_len == length:
            if hist_node is None:
                counts[hist_leaf_token] = 1
            elif type(hist_node.counts) is int:
                counts[hist_node.counts] = hist_node.total
            else:
                counts.update(hist_node.counts)
        ctx_counts: dict[int, int] = {}
        if ctx_len == length:
            end = (size - 1) * _WIDTH
            for _ in range(self.max_context_hits):  # the most recent occurrences first
                i = _rfind_suffix(buf, length, size, end)
                if i < 0:
                    break
                t = toks[i // _WIDTH + length]
                ctx_counts[t] = ctx_counts.get(t, 0) + 1
                counts[t] = counts.get(t, 0) + 1
                end = i + (length * _WIDTH) - 1  # the next one starts before this one
        # Most frequent; ties go to the row's own context (its own path), then to the smaller id.
        best = max(counts, key=lambda t: (counts[t], ctx_counts.get(t, 0), -t))
        return length, best, counts[best] / sum(counts.values()), counts[best]


def _rfind_suffix(buf: bytearray, length: int, size: int, end: int = -1) -> int:
    """Byte offset of the last occurrence, ending at or before byte ``end``, of the last ``length`` tokens
    of ``buf`` (``size`` tokens), or -1. By default ``end`` leaves out the last token, so a token follows
    every occurrence found. Matches that straddle token boundaries are skipped."""
    pattern = buf[(size - length) * _WIDTH :]
    if end < 0:
        end = (size - 1) * _WIDTH
    i = buf.rfind(pattern, 0, end)
    while i > 0 and i % _WIDTH:
        i = buf.rfind(pattern, 0, i + len(pattern) - 1)
    return i
