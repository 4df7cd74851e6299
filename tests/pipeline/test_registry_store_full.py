"""A full MLflow store at register (issue 45): the register step exits 200 (retried) with one line naming the full
store and its free space, whether the SQLite tracking store or the artifact store is full. Real tmpfs mounts of a
few hundred KiB in a private mount namespace (`unshare -Urm`), filled to the last byte."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from llmft.components.lib.registry.register_step import RegistryStoreFull, not_registered, registry_fault
from llmft.trainer.errors import EXIT_TRANSIENT


def _unshare_works() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0


SCRIPT = textwrap.dedent(
    """
    import errno, os, sys
    from pathlib import Path
    from mlflow import MlflowClient
    from llmft.components.lib.registry.mlflow_registry import Lineage, Registration, register_adapter
    from llmft.components.lib.registry.register_step import registry_store_faults
    from llmft.components.lib.step_exit import step_outcome

    disk, elsewhere, adapter, full = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    db = (disk if full == "tracking" else elsewhere) / "mlflow.db"
    artifacts = (disk if full == "artifacts" else elsewhere) / "mlartifacts"
    uri = f"sqlite:///{db}"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("e", artifact_location=artifacts.as_uri())
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # the disk, to its last byte
    for size in (1 << 16, 1 << 10, 1):
        try:
            while True:
                os.write(fd, b"\\0" * size)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    os.close(fd)
    lineage = Lineage("run-full", "register-model", "d" * 64, "org/base", checkpoint="step-2")
    reg = Registration("m", "e", Path(adapter), 9.0, lineage, params={"lora": {"r": 8}}, metrics={"eval_loss": 2.0})
    with step_outcome("register-model"), registry_store_faults(client, uri, "e"):
        register_adapter(reg, client=client)
    print("registered")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -Urm` (user + mount namespaces) to mount a tmpfs")
@pytest.mark.parametrize("full", ["tracking", "artifacts"])
def test_a_full_store_at_register_is_exit_200_naming_the_store(tmp_path, adapter_dir, full):
    disk, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    disk.mkdir()
    elsewhere.mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    shell = 'mount -t tmpfs -o size=8m tmpfs "$1" && exec "$0" "$5" "$1" "$2" "$3" "$4"'
    run = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", shell, sys.executable, str(disk), str(elsewhere), str(adapter_dir), full,
         str(tmp_path / "script.py")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert run.returncode == EXIT_TRANSIENT, run.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    if full == "tracking":
        assert errors[0].startswith(f"error: the MLflow tracking store {disk}/mlflow.db is full (database or disk")
    else:
        assert errors[0].startswith(f"error: the MLflow artifact store {(disk / 'mlartifacts').as_uri()}")
        assert "No space left on device" in errors[0] and str(adapter_dir) not in errors[0]
    assert "free of" in errors[0] and "exit 200 is retried" in errors[0]


def test_only_store_faults_are_translated():
    class OperationalError(Exception):
        pass

    full = registry_fault(
        OperationalError("(sqlite3.OperationalError) database or disk is full"), "sqlite:////w/m.db", None
    )
    assert isinstance(full, RegistryStoreFull) and full.exit_code == EXIT_TRANSIENT
    assert str(full).startswith("the MLflow tracking store /w/m.db is full (database or disk is full)")
    server = registry_fault(Exception("INTERNAL_ERROR: database or disk is full"), "http://u:p@mlflow:5000", None)
    assert "the MLflow tracking server http://***@mlflow:5000 is full" in str(server)  # never the password
    assert registry_fault(ValueError("bad parameter"), "sqlite:////w/m.db", None) is None
    assert registry_fault(OSError(13, "Permission denied"), "sqlite:////w/m.db", "file:///a") is None


def test_a_run_without_mlflow_records_why_nothing_was_registered():
    facts = not_registered("m")
    assert (
        facts["registered"] is False and facts["version"] is None and "no MLflow server configured" in facts["reason"]
    )
