"""scripts/install.sh staged into a directory (twice: it must be safe to run again), and the unit file
checked by systemd's own verifier."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import REPO

UNIT = REPO / "systemd" / "tunerd.service"


def unit_settings() -> dict[str, str]:
    settings = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def tunerd_users(root: Path) -> list[str]:
    return [line for line in (root / "etc" / "passwd").read_text().splitlines() if line.startswith("tunerd:")]


def test_unit_has_the_settings_the_daemon_relies_on() -> None:
    unit = unit_settings()
    assert unit["Type"] == "notify"
    assert unit["KillMode"] == "mixed"
    assert unit["RestartPreventExitStatus"] == "78"
    assert unit["Restart"] == "on-failure"
    assert unit["OOMPolicy"] == "continue"
    assert unit["User"] == "tunerd" and unit["StateDirectory"] == "tunerd"
    assert int(unit["TimeoutStopSec"]) > 30 + 10, "above graceful_stop_s + tunerd's SIGKILL wait"
    assert int(unit["WatchdogSec"]) > 0
    assert unit["NoNewPrivileges"] == "yes" and unit["ProtectSystem"] == "strict"
    # What a real systemd showed (tests/system checks each under one):
    assert "SupplementaryGroups" not in unit, "a group missing on the host fails every start (216/GROUP)"
    assert "ExecStartPre" not in unit, (
        "RestartPreventExitStatus= covers the main process only: a restart loop"
    )
    reloads = [
        line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith("ExecReload=")
    ]
    assert len(reloads) == 2 and reloads[0].endswith("/tunerd check-config /etc/tunerd/tunerd.toml")
    assert reloads[1] == "/bin/kill -HUP $MAINPID", "a config the check rejects never reaches the daemon"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    prefix = tmp_path / "opt" / "tunerd"
    (prefix / "venv" / "bin").mkdir(parents=True)
    stub = prefix / "venv" / "bin" / "tunerd"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    unit = tmp_path / "tunerd.service"
    unit.write_text(UNIT.read_text().replace("/opt/tunerd", str(prefix)))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "tunerd.service" not in result.stderr, result.stderr


def test_install_twice_into_a_staging_root_keeps_the_operators_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\n")
    (root / "etc" / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc" / "gshadow").write_text("root:*::\nvideo:*::\n")
    install = [str(REPO / "scripts" / "install.sh"), "--root", str(root), "--engine", "none"]

    first = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    config = root / "etc" / "tunerd" / "tunerd.toml"
    assert config.read_text() == (REPO / "etc" / "tunerd" / "tunerd.toml").read_text()
    assert (root / "etc" / "systemd" / "system" / "tunerd.service").exists()
    assert (root / "opt" / "tunerd" / "venv" / "bin" / "tunerd").exists()
    assert (root / "usr" / "local" / "bin" / "tunerd").readlink() == Path("/opt/tunerd/venv/bin/tunerd")
    [user] = tunerd_users(root)
    assert user.endswith(":tunerd vLLM supervisor:/var/lib/tunerd:/usr/sbin/nologin")
    assert "video:x:44:tunerd" in (root / "etc" / "group").read_text()
    # --engine none: no vLLM to bring `tokenizers`, so the door's extra does (else door.no_tokenizer and no
    # prompt-length admission).
    python = root / "opt" / "tunerd" / "venv" / "bin" / "python"
    door = subprocess.run(
        [str(python), "-c", "from tunerd.door.admission import PromptLimits; import tokenizers"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert door.returncode == 0, door.stderr

    config.write_text(config.read_text().replace("port = 8000", "port = 8123"))
    second = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "port = 8123" in config.read_text(), "the operator's edit survives a second install"
    assert (root / "etc" / "tunerd" / "tunerd.toml.dist").exists()
    assert len(tunerd_users(root)) == 1
    check = subprocess.run(
        [str(root / "opt" / "tunerd" / "venv" / "bin" / "tunerd"), "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
