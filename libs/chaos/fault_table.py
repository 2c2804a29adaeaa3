"""One row of the fault table: what was killed, how many requests completed with the undisturbed
greedy text, how many migrated, failed cleanly, hung or came back wrong, leaked pages after, how many
streams had already finished when it struck, and how the supervisor brought the killed service back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from libs.chaos.load import Outcome


@dataclass
class FaultResult:
    killed: str
    requests: int
    completed: int  # finished with exactly the undisturbed run's text and token count
    migrated: int  # choices the gateway re-submitted (its migrations counter)
    errors: int  # ended with a clean error event or status
    wrong: int  # finished, but not with the undisturbed text (must be 0)
    hung: int  # still running at the client deadline (must be 0)
    leaked_pages: int  # request pages left on live workers once traffic stopped (must be 0)
    max_seconds: float
    error_samples: list[str]
    finished_before_strike: int = -1  # streams already over when the fault struck (want 0: all running)
    restarts: int = -1  # restarts of the killed service by the launcher's supervisor (want 1)
    back_s: float = -1.0  # seconds from the SIGKILL until the killed service served again

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(
    killed: str,
    outcomes: Sequence[Outcome],
    want: Sequence[list[int]] | None,
    max_tokens: int,
    migrated: int,
    leaked: int,
) -> FaultResult:
    """`want`: each prompt's greedy token ids from the Engine alone; None compares lengths only (on a GPU,
    where bf16 results depend on the batch a request shares, and random weights turn that into other
    tokens)."""
    if want is not None and len(want) != len(outcomes):
        raise ValueError(f"{len(want)} expected outputs for {len(outcomes)} requests")
    right = [
        o.completion_tokens == max_tokens and (want is None or o.token_ids == want[i])
        for i, o in enumerate(outcomes)
    ]
    completed = sum(o.ok and r for o, r in zip(outcomes, right, strict=True))
    wrong = sum(o.ok and not r for o, r in zip(outcomes, right, strict=True))
    errors = [o.error for o in outcomes if o.error is not None and not o.hung]
    return FaultResult(
        killed=killed, requests=len(outcomes), completed=completed, migrated=migrated, errors=len(errors),
        wrong=wrong, hung=sum(o.hung for o in outcomes), leaked_pages=leaked,
        max_seconds=round(max((o.seconds for o in outcomes), default=0.0), 3),
        error_samples=sorted(set(errors))[:5],
    )  # fmt: skip
