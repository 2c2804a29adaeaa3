"""A service started by the launcher does not inherit the test process's Triton interpreter mode."""

from __future__ import annotations

from libs.launch.supervisor import ServiceSpec, Supervisor


def test_child_env_drops_triton_interpret_unless_spec_sets_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MOEMESH_PROBE", "kept")
    sup = Supervisor(tmp_path)
    script = "import os; print('interp=' + os.environ.get('TRITON_INTERPRET', 'unset'), os.environ['MOEMESH_PROBE'])"
    plain = sup.start(ServiceSpec("plain", "tests.libs.launch.print_env", {"SCRIPT": script}))
    forced = sup.start(
        ServiceSpec("forced", "tests.libs.launch.print_env", {"SCRIPT": script, "TRITON_INTERPRET": "1"})
    )
    assert plain.proc.wait(timeout=60) == 0 and forced.proc.wait(timeout=60) == 0
    assert "interp=unset kept" in (tmp_path / "plain.log").read_text()
    assert "interp=1 kept" in (tmp_path / "forced.log").read_text()
