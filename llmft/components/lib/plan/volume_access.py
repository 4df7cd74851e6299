"""Who writes the shared volume, and the plan step's check that this run can.

Both images run as :data:`~llmft.components.images.IMAGE_UID` (1000). The training pods set
``fsGroup`` to it, but the kubelet changes a volume's group only for volume types that support
ownership management: NFS, CephFS and EFS-type volumes are mounted as the server has them, and a
fresh volume's root there is typically ``root:root 0755``, which uid 1000 cannot write. KFP task
pods get no pod security context at all (``kfp.kubernetes.set_security_context`` sets only the
container's runAsUser/runAsGroup/runAsNonRoot, honoured from KFP 2.16: ``backend/src/v2/driver/k8s.go``
749-785 at 2.17.0, which also drops every capability; 2.4/2.5 drop the field, ``backend/src/v2/compiler/
visitor.go`` 175 ``AllowUnknownFields``), so no pipeline task can chown the volume: that is a one-time
step with root and CAP_CHOWN, ``deploy/volume-permissions.yaml``. docs/cluster-guide.md (Volume
ownership) says why and what to do where it cannot run.

:func:`check_volume_writable` probes every top-level folder the run writes (or, where it does not
exist yet, the folder it will be created in) by creating and removing a file as this pod's uid, and
fails with one line naming the path, the uid, the owner and mode, and the fix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmft.components.images import IMAGE_UID
from llmft.trainer.errors import ConfigError

PERMISSIONS_FILE = "deploy/volume-permissions.yaml"
"""The one-time Job that makes the volume's root owned by IMAGE_UID."""
PROBE_PREFIX = ".llmft-write-check-"


def written_folders(layout) -> list[str]:
    """The top-level folders of the volume this pipeline writes (from DataLayout's own paths)."""
    leaves = [
        layout.prepared("_"),
        layout.tokenized("_"),
        layout.run_dir("_"),
        layout.sweep_dir("_"),
        os.path.dirname(layout.promoted("_", "_")),
        os.path.dirname(layout.merged("_", "_")),
    ]
    return [layout.hf_home, *dict.fromkeys(os.path.dirname(p) for p in leaves)]


def _nearest_existing(path: Path, root: Path) -> Path:
    """``path`` or its nearest existing ancestor, never above ``root`` (the volume's mount)."""
    while not path.exists() and path != root and root in path.parents:
        path = path.parent
    return path


def not_writable(path: str, root: str) -> str | None:
    """Why this process cannot create a file where ``path`` (or, if absent, its nearest existing
    ancestor up to ``root``) is, or None when it can. Creates and removes one empty probe file."""
    target = _nearest_existing(Path(path), Path(root))
    if not target.is_dir():
        return f"{target} does not exist: the volume is not mounted there"
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=target)
    except OSError as exc:
        st = target.stat() if target.exists() else None
        owner = f"owner {st.st_uid}:{st.st_gid}, mode {st.st_mode & 0o7777:04o}" if st else "missing"
        return f"{target} is not writable by uid {os.getuid()} (gid {os.getgid()}): {owner} ({exc.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def check_volume_writable(layout) -> None:
    """ConfigError (one line) for the first folder of the run this pod's uid cannot write."""
    for folder in written_folders(layout):
        why = not_writable(folder, layout.root)
        if why is None:
            continue
        uid_note = "" if os.getuid() == IMAGE_UID else f" (this pod runs as uid {os.getuid()}, not {IMAGE_UID})"
        raise ConfigError(
            f"{why}. Every step and training pod writes the volume as uid {IMAGE_UID}{uid_note}: make its root "
            f"writable once with the Job in {PERMISSIONS_FILE} (kubectl apply -k deploy/), or give the storage "
            f"class's volumes uid/gid {IMAGE_UID} (docs/cluster-guide.md, Volume ownership)"
        )
