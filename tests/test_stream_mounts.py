"""A streaming cache on a network filesystem (issue 54 item 10): found in the mount table, the default folder
refused there with the fix, a folder the user chose used with one warning.

The table is parsed by a pure function (any table's text); this machine's own ``/proc/self/mountinfo`` is read
once. The loader's answer on a network filesystem is checked with a table that says the test's folder is one:
the process reads ``mounts.MOUNTINFO``, a file, and the test gives it that file (no filesystem is mounted).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from dali_pipes import StreamOptions
from dali_pipes.loading.stream_setup import cache_folder
from dali_pipes.staging import mounts
from dali_pipes.staging.mounts import filesystem_type, is_network, network_filesystem

TABLE = """\
21 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
22 21 0:40 / /home rw,relatime shared:2 - nfs4 filer:/export/home rw,vers=4.2
23 22 0:41 / /home/alice/scratch rw - ext4 /dev/nvme0n1 rw
24 21 0:42 / /lus rw - lustre 10.0.0.1@o2ib:/fs rw
25 21 0:43 / /mnt/my\\040bucket rw,nosuid - fuse.s3fs s3fs rw,user_id=0
26 21 0:44 / /dev/shm rw - tmpfs tmpfs rw
27 21 0:45 / /var/lib/containers rw - fuse.fuse-overlayfs fuse-overlayfs rw
28 21 0:46 / /data rw - ext4 /dev/sdb rw
29 21 0:47 / /data rw - cifs //server/share rw
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/alice/.cache/dali-pipes/stream/ds", ("/home", "nfs4")),
        ("/home/alice/scratch/cache", ("/home/alice/scratch", "ext4")),  # a local disk mounted inside the NFS home
        ("/homework/cache", ("/", "ext4")),  # /home is no prefix of /homework: whole names only
        ("/lus/project/cache", ("/lus", "lustre")),
        ("/mnt/my bucket/cache", ("/mnt/my bucket", "fuse.s3fs")),  # mountinfo's \040 is a space
        ("/dev/shm/cache", ("/dev/shm", "tmpfs")),
        ("/data/cache", ("/data", "cifs")),  # mounted last over /data: it hides the ext4 one
    ],
)
def test_the_mount_holding_a_path_is_the_deepest_one_above_it(path, expected):
    assert filesystem_type(path, TABLE) == expected


@pytest.mark.parametrize(
    ("fstype", "network"),
    [
        *[(kind, True) for kind in ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "9p")],
        *[(kind, True) for kind in ("fuse.s3fs", "fuse.gcsfuse", "fuse.sshfs", "fuse.rclone", "fuse.juicefs")],
        *[(kind, False) for kind in ("ext4", "xfs", "btrfs", "zfs", "tmpfs", "overlay", "fuse.fuse-overlayfs")],
    ],
)
def test_which_filesystems_are_network_ones(fstype, network):
    assert is_network(fstype) is network


def test_this_machine_s_table_is_read_and_its_temporary_folders_are_local(tmp_path):
    table = Path(mounts.MOUNTINFO).read_text() if os.path.exists(mounts.MOUNTINFO) else pytest.skip("no mountinfo")
    point, fstype = filesystem_type(tmp_path.resolve(), table)
    assert tmp_path.resolve().is_relative_to(point) and fstype  # a mount found above it, with its type
    assert filesystem_type("/", table) is not None
    assert network_filesystem(tmp_path / "not-yet-made") is None  # the test's folders are on a local disk here


@pytest.fixture
def on_nfs(tmp_path, monkeypatch) -> Path:
    """A mount table in which ``tmp_path/nfs`` is an NFS mount; the cache base (``~/.cache``) inside it."""
    table = Path(mounts.MOUNTINFO).read_text() if os.path.exists(mounts.MOUNTINFO) else ""
    shared = (tmp_path / "nfs").resolve()
    fake = tmp_path / "mountinfo"
    fake.write_text(table + f"99 1 0:99 / {shared} rw - nfs4 filer:/export rw\n")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(fake))
    monkeypatch.delenv("DALI_PIPES_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared / ".cache"))
    return shared


def test_the_default_folder_on_a_network_filesystem_is_refused_with_the_fix(on_nfs, tmp_path):
    with pytest.raises(ValueError) as refused:
        cache_folder(tmp_path / "ds", StreamOptions(cache_limit=1 << 20))
    message = str(refused.value)
    assert message.startswith(f"{on_nfs / '.cache' / 'dali-pipes'}: the default cache folder of streaming is on a")
    assert "network filesystem (nfs4)" in message and "StreamOptions(folder=...)" in message
    assert "$DALI_PIPES_CACHE" in message and "\n" not in message


@pytest.mark.parametrize("how", ["folder", "environment"])
def test_a_chosen_folder_on_a_network_filesystem_is_used_with_one_warning(on_nfs, tmp_path, monkeypatch, caplog, how):
    stream = StreamOptions(cache_limit=1 << 20, folder=on_nfs / "cache" if how == "folder" else None)
    if how == "environment":
        monkeypatch.setenv("DALI_PIPES_CACHE", str(on_nfs / "cache"))
    caplog.set_level(logging.WARNING, logger="dali_pipes")
    folders = [cache_folder(tmp_path / "ds", stream) for _ in range(2)]  # two loaders of the dataset: one warning
    assert folders[0] == folders[1] and folders[0].is_relative_to(on_nfs / "cache")
    warned = [r.getMessage() for r in caplog.records if "network filesystem" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"stream cache {folders[0]} is on a network filesystem (nfs4)")
