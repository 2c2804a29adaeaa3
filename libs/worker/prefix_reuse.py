"""PD prefix reuse: a decode worker that still caches a prompt's prefix receives only the rest of its KV.
Decode side (`reserve_for`, engine thread): reserve the pages after the longest cached whole-page prefix,
its length in the KvHandle's `cached_tokens`; prefill side (`pages_to_send`): send the pages from there on."""

# A ReserveKv without the prompt (`decode_prefix_reuse` off, or a scheduler that does not send it) reserves
# every page.

from __future__ import annotations

from collections.abc import Sequence

from libs.engine.protocol import EngineLike
from proto import messages as m


def reserve_for(engine: EngineLike, msg: m.ReserveKv) -> tuple[int, list[int]]:
    """(cached tokens, pages to receive) for a ReserveKv; ValueError on an inconsistent message."""
    if not msg.prompt_ids:
        return 0, engine.reserve(msg.request_id, msg.num_tokens)
    if len(msg.prompt_ids) != msg.num_tokens:
        raise ValueError(
            f"ReserveKv for {msg.request_id!r}: {len(msg.prompt_ids)} prompt ids but num_tokens {msg.num_tokens}"
        )
    return engine.reserve_cached(msg.request_id, msg.prompt_ids)


def pages_to_send(page_ids: Sequence[int], handle: m.KvHandle, page_size: int) -> list[int]:
    """The prefill side's pages (covering the whole prompt) that the decode side does not hold yet."""
    return list(page_ids[first_page_to_send(len(page_ids), handle, page_size) :])


def first_page_to_send(num_pages: int, handle: m.KvHandle, page_size: int) -> int:
    """Index of the prompt's first page (of num_pages) the decode side needs; page i goes into the
    handle's page i - first. ValueError when the handle does not fit the prompt."""
    if handle.cached_tokens < 0 or handle.cached_tokens % page_size:
        raise ValueError(
            f"handle {handle.handle_id}: cached_tokens {handle.cached_tokens} is not a whole number of "
            f"{page_size}-token pages"
        )
    skip = handle.cached_tokens // page_size
    if skip >= num_pages and num_pages:
        raise ValueError(
            f"handle {handle.handle_id}: the decode side caches {handle.cached_tokens} tokens, the whole "
            f"prompt of {num_pages} pages; at least its last token must be sent"
        )
    if len(handle.page_ids) < num_pages - skip:
        raise ValueError(
            f"handle {handle.handle_id} has {len(handle.page_ids)} pages, the prompt needs {num_pages - skip}"
        )
    return skip
