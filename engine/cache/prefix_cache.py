"""Prefix cache: a new request starts from the saved state of the longest prefix it shares with earlier ones.

What a prefix of N tokens leaves behind is of two kinds:
  - DSA layers: latents and pooled indexer keys in cache pages. A full page depends on nothing but the
    tokens up to its end, so full pages are shared between requests (reference-counted, read-only) and
    indexed by a hash chain over page-sized token blocks: a block's key is (parent block, its tokens),
    so equal keys mean equal prefixes. An image's tokens are keyed by the image's content (`seq.prompt_keys`):
    the same image matches, a different image of the same size does not.
  - KDA layers: the recurrent and short-conv state, which exist only at the position the request has
    reached (and the indexer's open pool, the keys of a pool not complete yet). These are saved as
    snapshots at chosen positions, attached to the chain block they follow with the tokens past it.
A hit restores the deepest snapshot the prompt matches: its chain pages are shared, the page the
position falls in is copied into the request's own page (copy-on-write: the request writes the rest of
it), the slot state is loaded, and only the tokens after the snapshot are computed. The last prompt
token always runs, since its logits give the first output token.

Snapshots are taken where later requests will branch off: one token before the prompt's end (an
identical prompt, n > 1 samples, the next turn of a conversation whose template re-renders the last
assistant header), where the prompt left the cached chain (a shared system prompt), where a waiting
request with the same prefix asks for one (it waits for this request to get there rather than compute
the prefix again), and where a finished request stopped (the next turn continues its output). The
scheduler ends prefill chunks at those positions, except one token before the prompt's end: there the chunk
runs on through the last token when the step has room, and each layer saves the request's state into the
snapshot row between the step's prompt spans and its one-token rows (`StepSaves`), so the first output token
does not wait a step of its own for the snapshot.

Memory: cached pages live in the page pool (the engine adds the budget's share of pages to it);
snapshots in a fixed set of device rows. Both are evicted least recently used first: to host RAM when a
host tier is configured, else dropped; dropping a block drops everything cached below it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.cache.paged_latents import PagedLatents
from engine.cache.slots import RequestSlots
from engine.cache.state_rows import PageRows, StateRows, StepSaves, page_bytes, state_bytes
from engine.config import ModelConfig
from engine.sequence import Sequence

# A tier's budget buys snapshots and pages in this ratio: one conversation state per 1,024 tokens
# of cached latents at the default page size, between what a long shared system prompt and what many
# short conversations need.
PAGES_PER_SNAPSHOT = 16


@dataclass(frozen=True)
class TierSize:
    snapshots: int
    pages: int

    @classmethod
    def of(cls, budget_bytes: int, cfg: ModelConfig, page_size: int, dtype: torch.dtype,
           max_pages: int, fp8: bool = False) -> "TierSize":
        """What `budget_bytes` holds: PAGES_PER_SNAPSHOT pages per snapshot, at most `max_pages` pages, the
        rest of the budget in snapshots (pages in fp8 with `fp8`)."""
        page, state = page_bytes(cfg, page_size, dtype, fp8), state_bytes(cfg, page_size, dtype, fp8)
        pages = min(PAGES_PER_SNAPSHOT * (budget_bytes // (state + PAGES_PER_SNAPSHOT * page)), max_pages)
        return cls(max(budget_bytes - pages * page, 0) // state, pages)


@dataclass(eq=False)
class Block:
    """One full page of a cached token chain, on the device (`page`) or in host RAM (`host_row`)."""

    tokens: tuple[int, ...]
    parent: "Block | None"
    depth: int  # pages from the start of the sequence through this one
    page: int | None = None
    host_row: int | None = None
    children: dict[tuple[int, ...], "Block"] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], "Snapshot"] = field(default_factory=dict)
    alive: bool = True


@dataclass(eq=False)
class Snapshot:
    """Request state after `block`'s pages and then `tail` (fewer than a page of tokens)."""

    block: Block
    tail: tuple[int, ...]
    row: int
    on_host: bool = False


@dataclass
class PrefixHit:
    """What a prompt finds: the snapshot to restore (None: start from zero) and the chain it matched."""

    position: int = 0  # tokens restored
    snapshot: Snapshot | None = None
    blocks: list[Block] = field(default_factory=list)  # matched chain blocks, possibly past the snapshot

    @property
    def matched(self) -> int:
        """Pages of the prompt found in the chain."""
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    requests: int = 0  # requests looked up
    hits: int = 0  # of those, requests that restored a prefix
    hit_tokens: int = 0  # prompt tokens restored instead of computed
    prompt_tokens: int = 0  # prompt tokens of the looked-up requests
    evicted_pages: int = 0  # pages that left the device tier (to host RAM or dropped)
    evicted_snapshots: int = 0
    device_pages: int = 0  # pages the cache holds now
    device_snapshots: int = 0
    host_pages: int = 0
    host_snapshots: int = 0

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


@dataclass
class _Progress:
    """A running request's place in the chain: its pages are registered up to `block`; `stops` are the
    positions where it must pause for a snapshot."""

    block: Block
    stops: set[int] = field(default_factory=set)


class _Rows:
    """Free rows of a store and its occupants in least-recently-used order."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.free = list(range(count - 1, -1, -1))
        self.lru: OrderedDict[object, None] = OrderedDict()

    def touch(self, item: object) -> None:
        self.lru[item] = None
        self.lru.move_to_end(item)


class PrefixCache:
    def __init__(self, cfg: ModelConfig, slots: RequestSlots, cache: PagedLatents, device_snapshots: int,
                 host: TierSize = TierSize(0, 0)) -> None:
        self.slots, self.cache, self.page_size = slots, cache, cache.page_size
        dev, dtype, fp8 = cache.latents.device, cache.dtype, cache.fp8
        pin = dev.type == "cuda"
        self.states = StateRows(cfg, device_snapshots, self.page_size, dev, dtype, fp8=fp8)
        self.host_states = StateRows(cfg, host.snapshots, self.page_size, torch.device("cpu"), dtype, pin, fp8)
        self.host_pages = PageRows(cfg, host.pages, self.page_size, torch.device("cpu"), dtype, pin, fp8)
        self._states, self._host_states = _Rows(device_snapshots), _Rows(host.snapshots)
        self._pages, self._host_pages = _Rows(0), _Rows(host.pages)  # device pages come from the page pool
        self.root = Block((), None, 0)
        self._progress: dict[Sequence, _Progress] = {}
        self._saving: dict[Sequence, int] = {}  # requests this step saves before their last token: their rows
        self._stats = PrefixCacheStats()

    # --- lookup and admission --------------------------------------------------------------------

    def lookup(self, prompt: list[int]) -> PrefixHit:
        """The deepest snapshot the prompt (its `prompt_keys`) matches, ending at most at its second-to-last
        token."""
        size, limit = self.page_size, len(prompt) - 1
        hit, node = PrefixHit(), self.root
        while True:
            start = node.depth * size
            for tail, snap in node.snapshots.items():
                end = start + len(tail)
                if hit.position < end <= limit and tuple(prompt[start:end]) == tail:
                    hit.position, hit.snapshot = end, snap
            child = node.children.get(tuple(prompt[start:start + size])) if start + size <= len(prompt) else None
            if child is None:
                return hit
            hit.blocks.append(child)
            node = child

    def admit(self, seq: Sequence, hit: PrefixHit, slot: int, num_pages: int) -> list[int] | None:
        """The request's pages (the hit's chain pages, then new ones), its slot restored to the hit; None
        (and nothing changed) when the pool cannot free enough pages."""
        depth = hit.snapshot.block.depth if hit.snapshot else 0
        chain = hit.blocks[:depth]
        resident = [b.page for b in chain if b.page is not None]
        self.cache.share(resident)  # held from here on: never evicted to make room below
        new_count = num_pages - len(resident)
        if not self._make_room(new_count, keep=set(chain)):
            self.cache.release(resident)
            return None
        new = self.cache.allocate(new_count)
        pages = [self._promote(b, new.pop(0)) if b.page is None else b.page for b in chain] + new
        if hit.snapshot is not None:
            snap = hit.snapshot
            store = self.host_states if snap.on_host else self.states
            store.load(snap.row, self.slots, slot, self.cache, pages[depth] if snap.tail else None)
            (self._host_states if snap.on_host else self._states).touch(snap)
        # Matched blocks past the snapshot may have been evicted just now (never the claimed ones, kept above).
        self._touch_chain(next((b for b in reversed(hit.blocks) if b.alive), self.root))
        seq.num_computed = seq.cached_prompt_tokens = hit.position
        self._progress[seq] = _Progress(chain[-1] if chain else self.root, self._stops(seq, hit))
        prompt_len = len(seq.prompt_token_ids)
        self._stats.requests += 1
        self._stats.hits += hit.position > 0
        self._stats.hit_tokens += hit.position
        self._stats.prompt_tokens += prompt_len
        return pages

    def _stops(self, seq: Sequence, hit: PrefixHit) -> set[int]:
        """Where this request's prefill pauses for a snapshot: where it leaves the cached chain (others
        will too) and one token before the prompt's end."""
        last = len(seq.prompt_token_ids) - 1
        branch = hit.matched * self.page_size
        return {p for p in (branch, last) if self.page_size <= p <= last and p > hit.position}

    def wait_for(self, seq: Sequence, hit: PrefixHit, running: list[Sequence]) -> Sequence | None:
        """A running request still prefilling a longer part of this prompt than the cache holds: it gets a
        stop where the prompts part (this one waits for that snapshot instead of computing the prefix
        again). None when there is none worth waiting for."""
        prompt = seq.prompt_keys
        for other in running:
            progress = self._progress.get(other)
            if progress is None or other.num_computed >= len(other.prompt_token_ids):
                continue
            shared = min(_common_prefix(prompt, other.prompt_keys, self.page_size), len(prompt) - 1)
            if shared >= hit.position + self.page_size and shared > other.num_computed:
                progress.stops.add(shared)
                return other
        return None

    def chunk_limit(self, seq: Sequence) -> int | None:
        """Tokens this request may run before its next snapshot stop (None: no stop ahead)."""
        progress = self._progress.get(seq)
        ahead = [s for s in progress.stops if s > seq.num_computed] if progress else []
        return min(ahead) - seq.num_computed if ahead else None

    def through_last(self, seq: Sequence, tokens: int, budget: int) -> int:
        """Tokens to run of a chunk of `tokens` planned within `budget`: one more when the chunk stops one token
        before the prompt's end (a snapshot stop) and runs at least two, the budget holds the last token and a
        snapshot row is free; the state before the last token is then saved partway through the step
        (`step_saves`). A request planned again in the same step is planned afresh."""
        self._free_row(self._saving.pop(seq, None))
        last = len(seq.prompt_token_ids) - 1
        if (tokens < 2 or tokens >= budget or seq.num_computed + tokens != last or seq.num_tokens != last + 1
                or seq.params.prompt_logprobs is not None):
            return tokens
        row = self._state_row()
        if row is None:
            return tokens
        self._saving[seq] = row
        return tokens + 1

    def step_saves(self, device: torch.device) -> StepSaves | None:
        """The saves the step's layers make (None: none this step); the rows are recorded at `commit`."""
        if not self._saving:
            return None
        seqs = list(self._saving)
        return StepSaves(self.states, set(seqs), torch.tensor([seq.slot for seq in seqs], device=device),
                         torch.tensor([self._saving[seq] for seq in seqs], device=device))

    # --- after steps --------------------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """After a step: register the request's newly completed pages, snapshot if it reached a stop (or its
        state was saved before its last token this step)."""
        progress = self._progress.get(seq)
        if progress is None:
            return
        saved = self._saving.pop(seq, None)
        if saved is not None:
            self._record(seq, progress, seq.num_computed - 1, saved_row=saved)
        at_stop = seq.num_computed in progress.stops
        progress.stops = {s for s in progress.stops if s > seq.num_computed}
        self._record(seq, progress, seq.num_computed, at_stop)

    def finish(self, seq: Sequence, keep_state: bool) -> None:
        """The request leaves: with `keep_state` (it finished normally, so its slot holds the state at
        `num_computed`) its pages are registered and that state kept for a next turn."""
        self._free_row(self._saving.pop(seq, None))  # planned for a step that never ran
        progress = self._progress.pop(seq, None)
        if progress is not None and keep_state:
            self._record(seq, progress, seq.num_computed, True)

    def _record(self, seq: Sequence, progress: _Progress, position: int, snapshot: bool = False,
                saved_row: int | None = None) -> None:
        """Register the request's pages up to `position`; snapshot there from its slot (`snapshot`) or from
        the row its state was saved into during the step (`saved_row`)."""
        size, node = self.page_size, progress.block
        full = position // size
        keep = snapshot or saved_row is not None
        if not node.alive or (full <= node.depth and not keep):
            self._free_row(saved_row)
            return  # nothing new, or its chain was evicted under it (later pages could never be found)
        tokens = seq.key_ids
        while node.depth < full:
            i = node.depth
            node = self._register(node, tuple(tokens[i * size:(i + 1) * size]), seq.pages[i])
        progress.block = node
        self._touch_chain(node)
        if keep and position >= size:
            tail = tuple(tokens[full * size:position])
            self._snapshot(node, tail, seq.slot, seq.pages[full] if tail else None, saved_row)
        else:
            self._free_row(saved_row)

    def _free_row(self, row: int | None) -> None:
        """A snapshot row planned for a save that took no snapshot goes back (None: there was none)."""
        if row is not None:
            self._states.free.append(row)

    def _register(self, parent: Block, tokens: tuple[int, ...], page: int) -> Block:
        block = parent.children.get(tokens)
        if block is None:
            block = parent.children[tokens] = Block(tokens, parent, parent.depth + 1, page)
            self.cache.share([page])
            self._pages.touch(block)
        elif block.page is None:  # in host RAM: this request's page holds the same tokens' state
            self._free_host_page(block)
            block.page = page
            self.cache.share([page])
            self._pages.touch(block)
        return block

    def _snapshot(self, block: Block, tail: tuple[int, ...], slot: int, page: int | None,
                  saved_row: int | None = None) -> None:
        if tail in block.snapshots:
            snap = block.snapshots[tail]
            (self._host_states if snap.on_host else self._states).touch(snap)
            self._free_row(saved_row)
            return
        if saved_row is None:
            row = self._state_row()
            if row is None:
                return
            self.states.save(row, self.slots, slot, self.cache, page)
        else:  # the layers saved the slot's state; the page (its first tokens are the tail) is saved now
            row = saved_row
            if page is not None:
                self.states.page.save(row, self.cache, page)
        snap = block.snapshots[tail] = Snapshot(block, tail, row)
        self._states.touch(snap)

    # --- memory -------------------------------------------------------------------------------------

    def _touch_chain(self, block: Block) -> None:
        """Mark a chain used, deepest block first, so a block is always more recent than its descendants and
        eviction takes leaves before the blocks they hang from."""
        while block.parent is not None:
            (self._pages if block.page is not None else self._host_pages).touch(block)
            block = block.parent

    def _promote(self, block: Block, page: int) -> int:
        """A host block's page back on the device, in `page` (the request's; the cache holds it too)."""
        self.host_pages.load(block.host_row, self.cache, page)
        self._free_host_page(block)
        block.page = page
        self.cache.share([page])
        self._pages.touch(block)
        return page

    def _free_host_page(self, block: Block) -> None:
        del self._host_pages.lru[block]
        self._host_pages.free.append(block.host_row)
        block.host_row = None

    def _make_room(self, count: int, keep: set[Block]) -> bool:
        missing = count - self.cache.free_pages
        if missing <= 0:
            return True
        victims = [b for b in self._pages.lru if self.cache.holders(b.page) == 1]  # held by the cache alone
        if len(victims) < missing:
            return False
        for block in victims:
            if self.cache.free_pages >= count:
                break
            if block.alive and block.page is not None:
                self._evict_page(block, keep)
        return self.cache.free_pages >= count

    def _evict_page(self, block: Block, keep: set[Block]) -> None:
        """Move a block's page to host RAM if there is a host tier, else drop the block (and its subtree)."""
        self._stats.evicted_pages += 1
        if not self._host_pages.free and self._host_pages.lru:
            oldest = next((b for b in self._host_pages.lru if b not in keep), None)
            if oldest is not None:
                self._drop(oldest)
        if not block.alive:  # it hung below the host block just dropped
            return
        if not self._host_pages.free:
            self._drop(block)
            return
        row = self._host_pages.free.pop()
        self.host_pages.save(row, self.cache, block.page)
        del self._pages.lru[block]
        self.cache.release([block.page])
        block.page, block.host_row = None, row
        self._host_pages.touch(block)

    def _drop(self, block: Block) -> None:
        """Forget a block, everything cached below it and the snapshots that follow them."""
        for child in list(block.children.values()):
            self._drop(child)
        for snap in list(block.snapshots.values()):
            self._drop_snapshot(snap)
        del block.parent.children[block.tokens]
        if block.page is not None:
            del self._pages.lru[block]
            self.cache.release([block.page])
        if block.host_row is not None:
            self._free_host_page(block)
        block.page, block.alive = None, False

    def _drop_snapshot(self, snap: Snapshot) -> None:
        rows = self._host_states if snap.on_host else self._states
        del rows.lru[snap]
        rows.free.append(snap.row)
        del snap.block.snapshots[snap.tail]

    def _state_row(self) -> int | None:
        """A free device snapshot row, moving the least recently used snapshot to host RAM (or dropping it)."""
        if not self._states.free and self._states.lru:
            snap = next(iter(self._states.lru))
            self._stats.evicted_snapshots += 1
            if self._host_states.count:
                self._demote_snapshot(snap)
            else:
                self._drop_snapshot(snap)
        return self._states.free.pop() if self._states.free else None

    def _demote_snapshot(self, snap: Snapshot) -> None:
        if not self._host_states.free:
            self._drop_snapshot(next(iter(self._host_states.lru)))
        host_row = self._host_states.free.pop()
        self.states.copy_row(snap.row, self.host_states, host_row)
        del self._states.lru[snap]
        self._states.free.append(snap.row)
        snap.row, snap.on_host = host_row, True
        self._host_states.touch(snap)

    def stats(self) -> PrefixCacheStats:
        s = self._stats
        return PrefixCacheStats(s.requests, s.hits, s.hit_tokens, s.prompt_tokens, s.evicted_pages,
                                s.evicted_snapshots, len(self._pages.lru), len(self._states.lru),
                                len(self._host_pages.lru), len(self._host_states.lru))


def _common_prefix(a: list[int], b: list[int], step: int) -> int:
    """Length of the common prefix of two token lists (compared a block at a time, then token by token)."""
    n, i = min(len(a), len(b)), 0
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
