"""Volume ownership (issue 29.4): the plan step's writability check (llmft/components/lib/plan/volume_access.py)
and the uid every writer of the volume runs as.

fsGroup is not applied on NFS, CephFS or EFS-type volumes, so a fresh volume's root stays root:root 0755;
the real check below runs as a uid that does not own such a folder (a child process that drops root with
os.setuid, or, when the tests do not run as root, a folder without write permission)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from llmft.components.images import IMAGE_UID
from llmft.components.lib.contracts.schema import DataLayout
from llmft.components.lib.plan.volume_access import (
    PERMISSIONS_FILE,
    PROBE_PREFIX,
    check_volume_writable,
    written_folders,
)
from llmft.trainer.errors import EXIT_USER_ERROR, ConfigError

OTHER_UID = 65534  # nobody: owns nothing here
CHILD = textwrap.dedent(
    """
    import os, sys
    from llmft.components.lib.plan.build import DataLayout
    from llmft.components.lib.plan.volume_access import check_volume_writable
    from llmft.trainer.errors import ConfigError
    uid = int(sys.argv[2])
    if os.geteuid() == 0:  # after the imports: the interpreter's own files may be readable by root only
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
    try:
        check_volume_writable(DataLayout(sys.argv[1]))
    except ConfigError as exc:
        print(exc)
        sys.exit(exc.exit_code)
    print("writable")
    """
)


@pytest.fixture
def volume() -> Path:
    """A fresh volume's root as NFS shows it: owned by someone else (root), 0755 - or, for a non-root
    test run, our own folder without write permission. Under /tmp (pytest's own folders are 0700)."""
    parent = Path(tempfile.mkdtemp(prefix="llmft-nfs-"))
    parent.chmod(0o755)  # the child's uid must reach it
    root = parent / "data"
    root.mkdir(mode=0o755)
    if os.geteuid() != 0:
        root.chmod(0o555)
    yield root
    for folder in (root, *root.iterdir()):
        folder.chmod(0o755)
    shutil.rmtree(parent)


def _check_as_other_user(root: Path) -> subprocess.CompletedProcess:
    uid = OTHER_UID if os.geteuid() == 0 else os.geteuid()
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(uid)], capture_output=True, text=True, timeout=120, cwd="/"
    )


def _let_write(path: Path) -> None:
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        path.chmod(0o755)


@pytest.mark.slow
def test_a_root_owned_volume_root_fails_the_plan_step_naming_path_uid_and_fix(volume):
    result = _check_as_other_user(volume)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    (line,) = result.stdout.splitlines()
    uid = OTHER_UID if os.geteuid() == 0 else os.geteuid()
    assert line.startswith(f"{volume} is not writable by uid {uid} ")
    assert "mode 0755" in line or "mode 0555" in line
    assert PERMISSIONS_FILE in line and f"uid {IMAGE_UID}" in line and "Permission denied" in line
    _let_write(volume)
    result = _check_as_other_user(volume)
    assert (result.returncode, result.stdout.strip()) == (0, "writable"), result.stderr
    assert not [p for p in volume.iterdir() if p.name.startswith(PROBE_PREFIX)], "the probe is removed"


@pytest.mark.slow
def test_a_folder_below_the_root_that_the_uid_cannot_write_is_named(volume):
    _let_write(volume)
    runs = volume / "runs"
    runs.mkdir(mode=0o755)
    if os.geteuid() != 0:
        runs.chmod(0o555)
    result = _check_as_other_user(volume)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert result.stdout.startswith(f"{runs} is not writable"), result.stdout


def test_the_check_probes_every_top_level_folder_of_the_layout(tmp_path, monkeypatch):
    layout = DataLayout(str(tmp_path))
    folders = written_folders(layout)
    for expected in ("hf-cache", "datasets", "tokenized", "runs", "sweeps", "models", "merged"):
        assert str(tmp_path / expected) in folders
    probed = []

    def refuse(prefix, dir):  # noqa: A002 - tempfile.mkstemp's own keyword
        probed.append(str(dir))
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(ConfigError, match=rf"^{tmp_path} is not writable by uid \d+ .*Permission denied") as caught:
        check_volume_writable(layout)
    assert probed == [str(tmp_path)], "a folder that does not exist yet is probed where it will be created"
    assert "\n" not in str(caught.value)


def test_a_volume_that_is_not_mounted_is_named_and_nothing_above_it_is_probed(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/absent does not exist: the volume is not mounted there"):
        check_volume_writable(DataLayout(str(tmp_path / "absent")))
    assert list(tmp_path.iterdir()) == []


def test_both_images_run_as_the_uid_the_pods_and_the_permissions_job_use(repo_root):
    for dockerfile in ("Dockerfile.pipeline", "Dockerfile.trainer"):
        text = (repo_root / "docker" / dockerfile).read_text()
        assert f"--uid {IMAGE_UID}" in text and f"USER {IMAGE_UID}\n" in text, dockerfile
    from llmft.components.lib.jobs.pytorchjob_spec import JobSpec

    assert JobSpec.__dataclass_fields__["run_as_user"].default == IMAGE_UID


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("trainjob", r"forbidden \(HTTP 403\).*Apply deploy/cluster-role\.yaml"),  # the runtime preflight first
        ("pytorchjob", r"^/data does not exist: the volume is not mounted there"),  # then the volume check
    ],
)
def test_the_plan_step_on_a_cluster_runs_the_runtime_and_volume_preflights(backend, expected, monkeypatch, tmp_path):
    """plan_run itself (llmft/components/plan.py), as a KFP task pod runs it, against fakes at the client boundary."""
    from kfp import dsl
    from plan_helpers import CLUSTER, parameters
    from trainer_v2_sim import FakeTrainerCoreApi, FakeTrainerCustomApi

    from llmft.components.lib import cluster as cluster_module
    from llmft.components.lib.plan.checks import compiled_settings
    from llmft.components.plan import plan_run

    if backend == "pytorchjob" and os.path.exists("/data"):
        pytest.skip("this machine has a /data: the unmounted case cannot be played here")
    for key, value in CLUSTER.items():
        monkeypatch.setenv(key, value)
    custom = FakeTrainerCustomApi()
    custom.forbidden = {"clustertrainingruntimes"}
    fake = cluster_module.Cluster("team-a", custom_api=custom, core_api=FakeTrainerCoreApi())
    monkeypatch.setattr(cluster_module, "Cluster", lambda *args, **kwargs: fake)
    values = parameters(training_backend=backend)
    artifact = dsl.Artifact(uri=str(tmp_path / "plan"))
    with pytest.raises(ConfigError, match=expected):
        plan_run.python_func(
            plan=artifact, **values, run_id="r1", compiled=compiled_settings("llm-finetune-hpo", values)
        )
    assert not os.path.exists(artifact.path), "no plan.json after a failed preflight"
