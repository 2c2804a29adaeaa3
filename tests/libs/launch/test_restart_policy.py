import pytest

from libs.launch import restart_policy as rp
from libs.launch.restart_policy import RestartPolicy, ServiceRecord, State

POLICY = RestartPolicy(backoff_s=1.0, backoff_factor=2.0, max_backoff_s=5.0, max_restarts=3, window_s=60.0)


def crash(rec: ServiceRecord, now: float, code: int = 1) -> ServiceRecord:
    return rp.on_exit(rec, POLICY, now, code)


def test_first_exit_restarts_after_the_base_backoff() -> None:
    rec = crash(ServiceRecord(), now=10.0, code=-9)
    assert rec.state is State.RESTARTING and rec.restart_at == 11.0 and rec.last_exit_code == -9
    assert not rp.due(rec, 10.99) and rp.due(rec, 11.0)
    up = rp.on_restarted(rec, 11.0)
    assert up.state is State.UP and up.restarts == 1 and up.restart_at is None


def test_backoff_doubles_within_the_window_and_is_capped() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0, max_restarts=10, window_s=100.0)
    rec, delays, now = ServiceRecord(), [], 0.0
    for _ in range(5):
        rec = rp.on_exit(rec, policy, now, 1)
        delays.append(rec.restart_at - now)  # type: ignore[operator]
        now = rec.restart_at  # type: ignore[assignment]
        rec = rp.on_restarted(rec, now)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert rec.restarts == 5


def test_more_exits_than_the_limit_within_the_window_gives_up() -> None:
    rec, now = ServiceRecord(), 0.0
    for i in range(POLICY.max_restarts):
        rec = crash(rec, now)
        assert rec.state is State.RESTARTING, i
        now = rec.restart_at  # type: ignore[assignment]
        rec = rp.on_restarted(rec, now)
    rec = crash(rec, now, code=2)
    assert rec.state is State.GIVEN_UP and rec.restarts == POLICY.max_restarts and rec.restart_at is None
    assert not rp.due(rec, now + 1000)
    assert rp.on_exit(rec, POLICY, now + 1, 1) == rec  # a given-up service stays given up
    line = rp.describe_exit("prefill-0", rec, POLICY, now)
    assert "GIVING UP" in line and "exited with code 2" in line and "prefill-0" in line


def test_exits_older_than_the_window_are_forgotten() -> None:
    rec, now = ServiceRecord(), 0.0
    for _ in range(POLICY.max_restarts):  # at the limit ...
        rec = rp.on_restarted(crash(rec, now), now)
        now += 1
    rec = crash(rec, now + POLICY.window_s)  # ... but a minute later: a fresh start, the first backoff
    assert rec.state is State.RESTARTING and len(rec.exits) == 1
    assert rec.restart_at == now + POLICY.window_s + POLICY.backoff_s


def test_zero_restarts_allowed_gives_up_at_the_first_exit() -> None:
    rec = rp.on_exit(ServiceRecord(), RestartPolicy(max_restarts=0), 0.0, -11)
    assert rec.state is State.GIVEN_UP
    assert "killed by signal 11" in rp.describe_exit("x", rec, RestartPolicy(max_restarts=0), 0.0)


def test_a_stopped_or_restarting_service_ignores_further_exits() -> None:
    stopped = rp.on_stopped(ServiceRecord(), 1.0)
    assert rp.on_exit(stopped, POLICY, 2.0, 0) == stopped and not rp.due(stopped, 99.0)
    restarting = crash(ServiceRecord(), 1.0)
    assert rp.on_exit(restarting, POLICY, 1.5, 1) == restarting


@pytest.mark.parametrize(
    "kwargs", [{"backoff_s": -1}, {"backoff_s": 5, "max_backoff_s": 1}, {"backoff_factor": 0.5},
               {"max_restarts": -1}, {"window_s": 0}],
)  # fmt: skip
def test_invalid_policies_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
