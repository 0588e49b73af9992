"""tunerd.service under a real systemd (PID 1 of a systemd-nspawn container), driven as an operator would.

One scenario in order, on one container: install.sh, start, look, reload, break things, upgrade, stop.
Each check sets up what it needs from whatever state the one before left (`ensure_running`).
"""

from __future__ import annotations

import json
from datetime import datetime

from tests.system.service import (
    CHECKOUT,
    CONFIG,
    DROP_IN,
    FAKE_VLLM,
    JOURNAL,
    MODEL,
    OPERATOR,
    OUTSIDER,
    PROBE,
    UNIT,
    Installed,
    Service,
)

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "HF_HOME")


def engine_cmdline(service: Service, pid: int) -> list[str]:
    [proc] = [p for p in service.procs() if p["pid"] == pid]
    return proc["cmdline"]


def test_install_sh_installs_tunerd_alone_on_a_host_without_a_render_group(installed: Installed) -> None:
    box = installed.service.box
    assert installed.render_before.returncode == 2, "the container has no render group"
    out = installed.first_install.stdout
    assert "unit verified: /etc/systemd/system/tunerd.service" in out
    assert "enabled tunerd.service" in out
    assert "systemctl start tunerd" in out and "usermod -aG tunerd" in out, "a first install's next steps"
    assert box.run(["systemctl", "is-enabled", UNIT]).stdout.strip() == "enabled"
    # --engine none: the fake vLLM is the engine; no vLLM came with tunerd.
    assert box.run(["/opt/tunerd/venv/bin/python", "-c", "import vllm"], check=False).returncode != 0
    assert box.run(["readlink", "/usr/local/bin/tunerd"]).stdout.strip() == "/opt/tunerd/venv/bin/tunerd"
    # The GPU device groups that exist (video) reach the user; the one that does not is not asked for.
    assert "video" in box.run(["id", "-nG", "tunerd"]).stdout.split()
    assert box.run(["systemctl", "show", UNIT, "-P", "SupplementaryGroups"]).stdout.strip() == ""


def test_start_reaches_active_running_through_ready_and_status_names_the_engine(installed: Installed) -> None:
    service = installed.service
    assert installed.start.returncode == 0, installed.start.stderr + service.diagnostics()
    after = installed.after_start
    # Type=notify: `systemctl start` returned once the daemon said READY=1 — after its set-up, which
    # journaled daemon.started, not at its exec (as Type=simple would).
    assert (after["ActiveState"], after["SubState"]) == ("active", "running")
    assert service.box.run(["systemctl", "show", UNIT, "-P", "Type"]).stdout.strip() == "notify"
    active_since = service.box.run(
        ["systemctl", "show", UNIT, "-P", "ActiveEnterTimestamp", "--timestamp=us+utc"]
    ).stdout.split()
    active = datetime.fromisoformat(f"{active_since[1]}T{active_since[2]}+00:00")
    [started] = [r for r in service.records() if r["event"] == "daemon.started"][:1]
    assert active >= datetime.fromisoformat(started["time"].replace("Z", "+00:00")), (active, started)
    engine_pid = service.wait_running()
    main_pid = service.main_pid()
    [engine] = [p for p in service.procs() if p["pid"] == engine_pid]
    assert engine["cmdline"][:2] == ["/usr/bin/python3", FAKE_VLLM]
    assert engine["ppid"] == main_pid and engine["marker"], "tunerd's child, with its marker"
    assert engine["uid"] == int(service.box.run(["id", "-u", "tunerd"]).stdout)

    def status() -> dict | None:  # `tunerd status` is one loop step behind STATUS= at most
        document = json.loads(service.tunerd("status", "--json").stdout)
        return document if document["engine"]["state"] == "RUNNING" else None

    document = service.wait(status, "tunerd status: RUNNING")
    assert document["engine"]["pid"] == engine_pid and document["daemon"]["pid"] == main_pid
    assert int(service.show()["NRestarts"]) == 0, "no restart on the way up (no render group: no 216/GROUP)"


def test_the_engines_caches_all_point_under_the_units_cache_directory(service: Service) -> None:
    engine_pid = service.ensure_running()
    env = service.environ(engine_pid)
    assert env["CACHE_DIRECTORY"] == "/var/cache/tunerd"
    for key in CACHE_VARIABLES:
        assert env[key].startswith("/var/cache/tunerd/"), (key, env.get(key))
    # Writable by the engine inside the unit's sandbox (ProtectSystem=strict: the rest of / is not),
    # and /var/cache/tunerd is not the private /tmp that every restart of the service throws away.
    probe = " && ".join(f'mkdir -p "{env[key]}" && touch "{env[key]}/.tier"' for key in CACHE_VARIABLES)
    service.as_unit_user(engine_pid, ["/bin/sh", "-c", probe])
    denied = service.as_unit_user(engine_pid, ["touch", "/opt/tunerd/.tier"], check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    for key in CACHE_VARIABLES:
        assert service.box.path(f"{env[key]}/.tier").exists(), f"{key} is on the persistent disk, not a /tmp"


def test_status_and_journal_for_root_and_a_tunerd_group_operator_not_for_others(service: Service) -> None:
    engine_pid = service.ensure_running()
    for user in (None, OPERATOR):
        status = service.tunerd("status", user=user)
        assert "RUNNING" in status.stdout, status.stdout
        assert json.loads(service.tunerd("status", "--json", user=user).stdout)["engine"]["pid"] == engine_pid
        journal = service.tunerd("journal", "-n", "50", user=user)
        assert "engine.ready" in journal.stdout
    # The operator may command it too (the socket is 0660, group tunerd): a restart gives a new engine.
    restart = service.tunerd("restart", "--reason", "system tier", user=OPERATOR)
    assert "restart requested" in restart.stdout
    service.wait_running(other_than=engine_pid)
    # Someone outside the group can neither read the journal nor command the daemon (the read-only
    # status endpoint is open to every local user).
    outsider = json.loads(service.tunerd("status", "--json", user=OUTSIDER).stdout)
    assert outsider["daemon"]["pid"] == service.main_pid()
    journal = service.tunerd("journal", user=OUTSIDER, check=False)
    assert journal.returncode == 1 and "Permission denied" in journal.stderr
    command = service.tunerd("restart", user=OUTSIDER, check=False)
    assert command.returncode == 4 and "permission denied" in command.stderr
    # journalctl: the operator (systemd-journal) sees tunerd's lines, the outsider does not.
    assert "engine.state" in service.journal(None, user=OPERATOR)
    assert "engine.state" not in service.journal(None, user=OUTSIDER)


def test_reload_with_a_good_config_restarts_vllm_under_the_same_daemon(service: Service) -> None:
    engine_pid = service.ensure_running()
    main_pid = service.main_pid()
    seq = service.last_seq()
    service.write_config(service.config_text(engine__params={"max_num_seqs": 8}))
    service.systemctl("reload", UNIT)
    reloaded = service.wait_record(lambda r: r["event"] == "config.reloaded", seq, "config.reloaded")
    assert reloaded["engine_changed"] is True
    new_pid = service.wait_running(other_than=engine_pid)
    assert service.main_pid() == main_pid, "the same tunerd: vLLM restarted, not the service"
    argv = engine_cmdline(service, new_pid)
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert service.survivors(service.engine_group(engine_pid)) == []


def test_reload_with_a_bad_config_fails_visibly_keeps_the_old_one_and_status_still_works(
    service: Service,
) -> None:
    engine_pid = service.ensure_running()
    main_pid = service.main_pid()
    seq = service.last_seq()
    cursor = service.journal_cursor()
    service.write_config(service.config_text() + "\n[timeouts\nbroken = \n")  # not even TOML
    reload = service.systemctl("reload", UNIT, check=False)
    assert reload.returncode != 0, "systemctl reload reports the rejected config"
    show = service.show()
    assert (show["ActiveState"], show["SubState"]) == ("active", "running")
    assert int(show["MainPID"]) == main_pid
    assert service.status_text() == f"engine RUNNING (pid {engine_pid})", "the old config goes on"
    assert "(syntax)" in service.journal(cursor), "the check's reason is in the journal"
    assert not [r for r in service.records() if r["seq"] > seq and r["event"].startswith("config.")]
    # Looking at the running daemon does not depend on the file on disk (defect 4).
    for user in (None, OPERATOR):
        status = service.tunerd("status", "--json", user=user)
        assert json.loads(status.stdout)["engine"]["pid"] == engine_pid
        assert "the config does not load" in status.stderr
        journal = service.tunerd("journal", "-n", "5", user=user)
        assert journal.stdout.strip() and f"reading {JOURNAL}" in journal.stderr
    service.write_config(service.config_text())
    service.systemctl("reload", UNIT)
    assert service.wait_running() == engine_pid, "the good config again: nothing in [engine] changed"


def test_journalctl_priority_err_shows_the_errors_tunerd_logged(service: Service) -> None:
    service.ensure_running()
    main_pid = service.main_pid()
    cursor = service.journal_cursor()
    seq = service.last_seq()
    # SIGHUP straight to the daemon (bypassing ExecReload's check): it rejects the file and logs an error.
    service.write_config(service.config_text(timeouts={"graceful_stop_sec": 1.0}))
    service.box.run(["kill", "-HUP", str(main_pid)])
    service.wait_record(lambda r: r["event"] == "config.reload_failed", seq, "config.reload_failed")
    # A file that parses but does not validate: `tunerd status` uses the sections that still do.
    status = service.tunerd("status", "--json", user=OPERATOR)
    assert json.loads(status.stdout)["daemon"]["pid"] == main_pid
    assert "graceful_stop_sec: unknown key" in status.stderr
    assert "the default [paths] and its [export]" in status.stderr  # the operator's file has no [paths]
    errors = service.wait(
        lambda: service.journal(cursor, "-p", "err").strip(), "an error in journalctl -p err"
    )
    assert "config.reload_failed" in errors and "graceful_stop_sec" in errors
    assert '"level": "info"' not in errors
    [entry] = [e for e in service.journal_entries(cursor) if "config.reload_failed" in e["MESSAGE"]]
    assert entry["PRIORITY"] == "3" and entry["MESSAGE"].startswith("{"), "the prefix is gone, JSON stays"
    service.write_config(service.config_text())
    service.systemctl("reload", UNIT)
    reloaded = service.wait(
        lambda: [e for e in service.journal_entries(cursor) if "config.reloaded" in e["MESSAGE"]],
        "config.reloaded in the journal",
    )
    assert [e["PRIORITY"] for e in reloaded] == ["6"]


def test_a_killed_engine_core_is_restarted_and_status_never_names_a_dead_pid(service: Service) -> None:
    engine_pid = service.ensure_running()
    main_pid = service.main_pid()
    seq = service.last_seq()
    group = service.engine_group(engine_pid)
    [core] = [p for p in group if p["comm"] == "VLLM::EngineCor"]
    service.box.run(["kill", "-9", str(core["pid"])])
    seen: list[str] = []

    def serving_again() -> bool:
        text = service.status_text()
        seen.append(text)
        return text.startswith("engine RUNNING") and f"(pid {engine_pid})" not in text

    service.wait(serving_again, "a new engine after the engine core was killed", every=0.05)
    failed = service.wait_record(lambda r: r["event"] == "engine.failed", seq, "engine.failed")
    assert failed["failure"]["kind"] == "engine_dead"
    backoff = [text for text in seen if text.startswith("engine BACKOFF")]
    assert backoff, f"STATUS= during the 3 s backoff was seen: {sorted(set(seen))}"
    assert not [text for text in backoff if "pid" in text], sorted(set(backoff))
    assert service.main_pid() == main_pid
    assert service.survivors(group) == [], "nothing of the old engine's group is left"


def test_a_fatal_status_names_its_failure_kind_once(service: Service) -> None:
    service.ensure_running()
    service.write_config(service.config_text(engine={"model": f"{MODEL}-missing"}))
    service.systemctl("reload", UNIT)
    fatal = service.wait(
        lambda: (text := service.status_text()).startswith("engine FATAL") and text, "FATAL", timeout=120
    )
    assert "model_not_found" in fatal and fatal.count("model_not_found") == 1, fatal
    assert service.show()["ActiveState"] == "active", "FATAL: the daemon stays up and says why"
    service.write_config(service.config_text())
    service.systemctl("reload", UNIT)  # a reload leaves FATAL
    service.wait_running()


def test_kill_9_of_the_daemon_restarts_it_on_last_known_good_and_leaves_no_engine(service: Service) -> None:
    engine_pid = service.ensure_running()
    main_pid = service.main_pid()
    restarts = int(service.show()["NRestarts"])

    def promoted() -> dict | None:  # what it runs with has served known_good_after_s: last-known-good
        engine = json.loads(service.tunerd("status", "--json").stdout)["engine"]
        return engine["known_good"] if engine["known_good"] == engine["params"] else None

    known_good = service.wait(promoted, "the running parameters promoted to last-known-good")
    group = service.engine_group(engine_pid)
    assert len(group) >= 3, group  # API server, engine core, worker
    cursor = service.journal_cursor()
    seq = service.last_seq()
    service.box.run(["kill", "-9", str(main_pid)])
    new_pid = service.wait_running(other_than=engine_pid)
    assert service.main_pid() != main_pid
    assert int(service.show()["NRestarts"]) == restarts + 1
    assert service.survivors(group) == [], "systemd killed the old engine's whole group"
    started = service.wait_record(lambda r: r["event"] == "daemon.started", seq, "daemon.started")
    assert "last-known-good" in started["why"]
    assert started["params"] == known_good
    argv = engine_cmdline(service, new_pid)
    assert argv[argv.index("--max-model-len") + 1] == str(known_good["max_model_len"])
    assert "status=9/KILL" in service.journal(cursor)


def test_the_watchdog_kills_and_restarts_a_stuck_daemon(service: Service) -> None:
    engine_pid = service.ensure_running()
    main_pid = service.main_pid()
    restarts = int(service.show()["NRestarts"])
    group = service.engine_group(engine_pid)
    cursor = service.journal_cursor()
    service.box.run(["kill", "-STOP", str(main_pid)])  # the loop stops pinging WATCHDOG=1
    service.wait_running(other_than=engine_pid, timeout=120)
    assert service.main_pid() != main_pid
    assert int(service.show()["NRestarts"]) == restarts + 1
    log = service.journal(cursor)
    assert "Watchdog timeout" in log and "Failed with result 'watchdog'" in log, log
    assert service.survivors(group) == []
    assert not [p for p in service.procs() if p["pid"] == main_pid], "the stuck daemon is gone"


def test_drop_page_cache_fadvise_works_as_the_units_user_a_full_drop_says_why_not(service: Service) -> None:
    engine_pid = service.ensure_running()
    weights = f"{MODEL}/weights.bin"
    service.box.run(["sync", weights])  # dirty pages are not dropped: written out first
    service.box.run(f"cat {weights} >/dev/null")  # into the page cache
    before = service.box.json(["python3", PROBE, "resident", weights])[weights]
    assert before > 0
    script = (
        "import json; from tunerd.supervise.preflight import drop_page_cache, fadvise_model_files;"
        f"print(json.dumps({{'fadvise': fadvise_model_files({MODEL!r}), 'drop': drop_page_cache()}}))"
    )
    # As the unit's user, inside the service's own mount namespace (ProtectSystem=strict and the rest).
    python = ["/opt/tunerd/venv/bin/python", "-c", script]
    result = json.loads(service.as_unit_user(engine_pid, python).stdout)
    assert result["fadvise"]["files"] == 1 and result["fadvise"]["errors"] == []
    assert service.box.json(["python3", PROBE, "resident", weights])[weights] == 0, "the model's pages went"
    assert result["drop"] in ("Permission denied", "Read-only file system"), result


def test_a_second_install_keeps_the_operators_edits_and_says_to_restart(
    service: Service, installed: Installed
) -> None:
    service.ensure_running()
    main_pid = service.main_pid()
    config = service.current_config()
    second = service.box.run(f"cd {CHECKOUT} && scripts/install.sh --engine none", check=False, timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"kept your {CONFIG}; the shipped version is in {CONFIG}.dist" in second.stdout
    assert "still running the code it was started with" in second.stdout
    assert "systemctl restart tunerd" in second.stdout
    assert f"diff -u {CONFIG} {CONFIG}.dist" in second.stdout
    assert service.current_config() == config, "the operator's file is untouched"
    shipped = service.box.path(f"{CHECKOUT}/etc/tunerd/tunerd.toml").read_text()
    assert service.box.path(f"{CONFIG}.dist").read_text() == shipped
    assert service.box.path(DROP_IN).exists(), "drop-ins stay"
    assert service.main_pid() == main_pid, "install.sh does not restart a running service behind one's back"
    assert installed.first_install.stdout.count("kept your") == 0


def test_stop_leaves_nothing_even_an_engine_that_ignores_sigterm(service: Service) -> None:
    engine_pid = service.ensure_running()
    service.write_config(service.config_text(engine__env={"FAKE_VLLM_IGNORE_SIGTERM": "1"}))
    service.systemctl("reload", UNIT)
    engine_pid = service.wait_running(other_than=engine_pid)
    assert service.environ(engine_pid).get("FAKE_VLLM_IGNORE_SIGTERM") == "1"
    group = service.engine_group(engine_pid)
    main_pid = service.main_pid()
    seq = service.last_seq()
    service.systemctl("stop", UNIT)
    show = service.show()
    # Result=success: tunerd stopped vLLM itself (SIGKILL after graceful_stop_s) and exited 0 well within
    # TimeoutStopSec; systemd had no SIGKILL of its own to send ("timeout" otherwise).
    assert (show["ActiveState"], show["Result"]) == ("inactive", "success"), show
    assert service.survivors(group) == [] and not [p for p in service.procs() if p["pid"] == main_pid]
    stopped = [r for r in service.records() if r["seq"] > seq and r["event"] == "engine.stopped"]
    assert stopped and stopped[-1]["sigkill"] is True, stopped
    assert [r["event"] for r in service.records() if r["seq"] > seq][-1] == "daemon.stopped"
    leftover = [p for p in service.procs() if p["marker"] is not None]
    assert leftover == [], "no process with tunerd's marker anywhere"


def test_a_bad_config_at_start_fails_once_with_78_and_does_not_restart_loop(service: Service) -> None:
    if service.show()["ActiveState"] == "active":
        service.systemctl("stop", UNIT)
    cursor = service.journal_cursor()
    service.write_config(service.config_text(timeouts={"graceful_stop_sec": 1.0}))
    start = service.systemctl("start", UNIT, check=False)
    assert start.returncode != 0
    show = service.show()
    # Straight to failed: an automatic restart would show SubState=auto-restart for RestartSec first.
    assert (show["ActiveState"], show["SubState"], show["Result"]) == ("failed", "failed", "exit-code"), show
    assert (show["ExecMainCode"], show["ExecMainStatus"]) == ("1", "78"), show  # CLD_EXITED, EX_CONFIG
    assert show["NRestarts"] == "0", show  # a manual start counts from 0; an automatic restart would count
    log = service.journal(cursor)
    assert "timeouts.graceful_stop_sec: unknown key" in log
    # The why at err priority (a `<3>` prefix), not only systemd's "Failed to start": the README's advice.
    assert "timeouts.graceful_stop_sec: unknown key" in service.journal(cursor, "-p", "err")
    assert log.count("status=78/CONFIG") == 1 and "Scheduled restart job" not in log, log
    service.write_config(service.config_text())
    service.systemctl("reset-failed", UNIT)
    service.systemctl("start", UNIT)
    service.wait_running()
