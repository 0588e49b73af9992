"""Durable daemon state: round trip, atomic replace, corrupt files kept aside, stable instance id."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tunerd.records.durable import atomic_write
from tunerd.records.state import DaemonState, EngineRecord, StateStore


def test_save_then_load_round_trips_every_field(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    state = DaemonState(
        base_params={"max_model_len": 4096},
        last_known_good={"max_model_len": 1920, "block_size": 32},
        engine=EngineRecord(pid=4242, pgid=4242, started="2026-11-30T12:00:00.000Z", log="/var/log/e.log"),
    )
    store.save(state)
    loaded, warning = store.load()
    assert warning is None
    assert loaded == state


def test_missing_state_file_gives_fresh_state_without_warning(tmp_path: Path) -> None:
    state, warning = StateStore(tmp_path / "state.json").load()
    assert warning is None
    assert state.last_known_good is None
    assert state.engine is None
    assert len(state.instance_id) == 16


def test_instance_id_is_stable_across_save_and_load(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    state, _ = store.load()
    store.save(state)
    first, _ = store.load()
    store.save(first.model_copy(update={"last_known_good": {"max_num_seqs": 8}}))
    second, _ = StateStore(tmp_path / "state.json").load()
    assert first.instance_id == state.instance_id
    assert second.instance_id == state.instance_id


def test_fresh_states_get_different_instance_ids() -> None:
    assert DaemonState().instance_id != DaemonState().instance_id


def test_save_creates_the_state_folder(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "var" / "lib" / "tunerd" / "state.json")
    store.save(DaemonState())
    assert store.path.exists()


def test_unknown_fields_in_the_state_file_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"instance_id": "abc", "from_a_newer_version": 1}))
    state, warning = StateStore(path).load()
    assert warning is None
    assert state.instance_id == "abc"


@pytest.mark.parametrize(
    "content",
    [b'{"instance_id": "abc", "engine": {', b"\x00\x00\x00\x00", b'{"engine": {"pid": "x"}}', b"[1, 2]"],
    ids=["torn-json", "nul-bytes", "wrong-type", "not-an-object"],
)
def test_corrupt_state_file_is_moved_aside_with_a_warning(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    state, warning = StateStore(path).load()
    aside = tmp_path / "state.json.corrupt"
    assert aside.read_bytes() == content
    assert not path.exists()
    assert warning is not None
    assert str(path) in warning
    assert str(aside) in warning
    assert state.engine is None
    assert state.last_known_good is None


def test_state_file_is_replaced_whole(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    store.save(DaemonState(last_known_good={"max_model_len": 4096, "block_size": 32}))
    store.save(DaemonState(last_known_good={"max_model_len": 512}))
    state, _ = store.load()
    assert state.last_known_good == {"max_model_len": 512}


# -- atomic_write ----------------------------------------------------------------------------------


def test_atomic_write_writes_the_data_with_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "file"
    atomic_write(target, b"hello", mode=0o600)
    assert target.read_bytes() == b"hello"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_atomic_write_replaces_existing_content(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"old content that is longer")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_failed_rename_keeps_old_content_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    def rename_fails(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", rename_fails)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, b"new content")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_write_keeps_old_content_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        if len(data) > 4:
            return real_write(fd, bytes(data)[:4])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        atomic_write(target, b"new content")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_save_keeps_the_previous_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(tmp_path / "state.json")
    store.save(DaemonState(instance_id="before"))

    def rename_fails(src: object, dst: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", rename_fails)
    with pytest.raises(OSError):
        store.save(DaemonState(instance_id="after"))
    monkeypatch.undo()
    state, warning = store.load()
    assert warning is None
    assert state.instance_id == "before"
