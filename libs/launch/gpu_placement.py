"""Which GPUs each worker process sees (`moemesh up --prefill-gpus 0,1,2,3 --decode-gpus 4,5,6,7`): a kind's
list split over its workers in order, ep_size GPUs each, given to the worker as CUDA_VISIBLE_DEVICES."""

# A worker's EP rank processes inherit its CUDA_VISIBLE_DEVICES and rank r runs on the r-th GPU of it
# (libs.ep.rank: cuda:r), so every rank of a group sees its peers, as NCCL, DeepEP and Mooncake's
# nvlink_intra IPC expect (vLLM and SGLang keep one visible set per engine the same way). Pure code.

from __future__ import annotations

from collections.abc import Sequence

VISIBLE = "CUDA_VISIBLE_DEVICES"


def parse_gpus(text: str, flag: str) -> list[int]:
    """'0,1,2,3' -> [0, 1, 2, 3]; "" -> []; ValueError naming the flag for anything else or a repeat."""
    if not text.strip():
        return []
    try:
        ids = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes GPU ids separated by commas (e.g. 0,1,2,3), got {text!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{flag}: GPU ids must be distinct and >= 0, got {text!r}")
    return ids


def split_gpus(gpus: Sequence[int], workers: Sequence[str], per_worker: int, flag: str) -> dict[str, str]:
    """{worker: its CUDA_VISIBLE_DEVICES}: workers in order, `per_worker` (ep_size) GPUs each; {} without GPUs."""
    if not gpus:
        return {}
    need = len(workers) * per_worker
    if len(gpus) != need:
        raise ValueError(
            f"{flag} names {len(gpus)} GPUs; {len(workers)} worker(s) x ep_size {per_worker} need {need}"
        )
    return {w: ",".join(map(str, gpus[i * per_worker : (i + 1) * per_worker])) for i, w in enumerate(workers)}


def worker_gpus(
    prefill: tuple[Sequence[int], Sequence[str], int], decode: tuple[Sequence[int], Sequence[str], int]
) -> dict[str, str]:
    """Both kinds' splits ((gpus, workers, ep_size) each); a GPU given to both kinds is a ValueError."""
    both = set(prefill[0]) & set(decode[0])
    if both:
        raise ValueError(f"GPU(s) {sorted(both)} given to both --prefill-gpus and --decode-gpus")
    return split_gpus(*prefill, "--prefill-gpus") | split_gpus(*decode, "--decode-gpus")
