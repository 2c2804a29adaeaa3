"""The launcher's supervision loop on a real nats-server: it restarts and gives up as the policy says,
reports each step, and publishes LauncherStatus on the bus."""

import asyncio
import sys
from pathlib import Path

import nats

from libs.launch.restart_policy import RestartPolicy
from libs.launch.supervision import SupervisionLoop
from libs.launch.supervisor import ServiceSpec, Supervisor
from proto import decoder, subjects
from proto import messages as m


async def test_the_loop_reports_and_publishes_a_give_up(nats_server: str, tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, RestartPolicy(backoff_s=0.0, max_backoff_s=0.0, max_restarts=1))
    lines: list[str] = []
    loop = SupervisionLoop(sup, nats_server, {}, lines.append, launcher_id="launcher-under-test")
    nc = await nats.connect(nats_server)
    statuses: asyncio.Queue[m.LauncherStatus] = asyncio.Queue()
    dec = decoder(m.LauncherStatus)

    async def on_status(msg) -> None:
        status = dec.decode(msg.data)
        if status.launcher_id == "launcher-under-test":
            await statuses.put(status)

    await nc.subscribe(subjects.LAUNCHER_STATUS, cb=on_status)
    await nc.flush()
    sup.start(ServiceSpec("steady", "", argv=(sys.executable, "-c", "import time; time.sleep(60)")))
    sup.start(ServiceSpec("crashy", "", argv=(sys.executable, "-c", "raise SystemExit(7)")))
    loop.start()
    try:
        async with asyncio.timeout(30):
            while True:
                status = await statuses.get()
                by_name = {s.name: s for s in status.services}
                if by_name["crashy"].status == m.ServiceStatus.GIVEN_UP:
                    break
        assert by_name["crashy"].restarts == 1 and by_name["crashy"].last_exit_code == 7
        assert by_name["steady"].status == m.ServiceStatus.UP and by_name["steady"].restarts == 0
        assert status.interval_ms == 1000
        assert any("crashy exited with code 7; restarting" in line for line in lines), lines
        assert any("crashy exited with code 7; GIVING UP" in line for line in lines), lines
        assert lines[-1] == "services: 1 up; restarting: none; given up: crashy"
    finally:
        loop.stop()
        sup.stop_all(grace_s=5)
        await nc.close()
