"""schemathesis against the gateway's OpenAPI document: generated (valid and invalid) bodies for every
operation never get a 5xx, and the gateway still serves afterwards. Bounded and seeded, so it is small
and the same on every run; the scripted mesh double answers as the scheduler and decode worker would."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from tests.services.gateway.conftest import MODEL, StartGateway, base_url
from tests.services.gateway.fake_mesh import FakeMesh

CLI = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")


@pytest.mark.skipif(CLI is None, reason="schemathesis is not installed (the dev extra has it)")
async def test_no_server_error_for_generated_requests(
    start_gateway: StartGateway, fake_mesh: FakeMesh, tmp_path: Path
) -> None:
    gw = await start_gateway(request_timeout_s=20)
    url = base_url(gw)
    proc = await asyncio.create_subprocess_exec(
        str(CLI), "run", f"{url}/openapi.json", "--url", url, "--checks", "not_a_server_error",
        "--max-examples", "25", "--seed", "7", "--generation-deterministic", "--workers", "1",
        "--phases", "examples,coverage,fuzzing", "--request-timeout", "20", "--no-color",
        "--report-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "No issues found" in text and "Tested: 5" in text, text[-2000:]
    assert len(fake_mesh.submits) >= 20  # valid bodies went all the way to the mesh, not only refusals
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:  # no crash: it still serves
        assert (await h.get("/health")).status_code == 200
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
