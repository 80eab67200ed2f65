"""cli.files.write_text_atomic: a failed write leaves the earlier file whole and no temporary file behind."""

from __future__ import annotations

import errno
import os
import stat
import threading

import pytest

from rewy_tune.cli import files
from rewy_tune.cli.files import write_text_atomic


def test_writes_a_new_file_and_replaces_an_old_one(tmp_path):
    target = tmp_path / "winners.json"
    write_text_atomic(target, "first\n")
    assert target.read_text() == "first\n"
    write_text_atomic(str(target), "second\n")
    assert target.read_text() == "second\n"
    assert os.listdir(tmp_path) == ["winners.json"]


@pytest.mark.parametrize("fail_in", ["write", "fsync"])
def test_a_write_that_fails_part_way_keeps_the_earlier_file(tmp_path, monkeypatch, fail_in):
    # disk full half way through an export: before, the target was truncated to a partial JSON document
    target = tmp_path / "winners.json"
    target.write_text('{"earlier": "export"}')

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fail_in == "fsync":
        monkeypatch.setattr(files.os, "fsync", disk_full)
    else:
        real_fdopen = os.fdopen

        class HalfWriter:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                self.f.write(text[: len(text) // 2])
                self.f.flush()
                disk_full()

        monkeypatch.setattr(files.os, "fdopen", lambda *a, **k: HalfWriter(real_fdopen(*a, **k)))
    with pytest.raises(OSError) as info:
        write_text_atomic(target, '{"new": "export", "longer": "than the old one"}')
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == '{"earlier": "export"}'
    assert os.listdir(tmp_path) == ["winners.json"]


def test_a_folder_is_refused_and_nothing_is_left(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(IsADirectoryError):
        write_text_atomic(tmp_path / "out", "x")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == []


def test_a_pipe_is_written_in_place_not_replaced(tmp_path):
    # `rewy-tune export /dev/stdout` and FIFOs: renaming over the node would replace it with a regular file
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()))
    reader.start()
    write_text_atomic(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert got == ["through the pipe\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_permissions_are_those_open_would_leave(tmp_path):
    # mkstemp makes its file 0600: renamed over the target, an export would have become unreadable to others
    old_umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "new.json", "x")
        assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o644
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        os.chmod(kept, 0o640)
        write_text_atomic(kept, "new")
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o640 and kept.read_text() == "new"
    finally:
        os.umask(old_umask)


def test_a_symlink_is_written_through_and_kept(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "real.json"]
