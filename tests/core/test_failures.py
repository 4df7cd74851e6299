"""The one mapping from what ended a command to its exit code and line (llmft/trainer/failures.py), shared by
`llmft <group>` and every trainer rank; and the one URL redactor every line passes through."""

from __future__ import annotations

import errno
import os

import pytest

from llmft import cli
from llmft.trainer.__main__ import TRAINER
from llmft.trainer.errors import EXIT_INTERNAL, EXIT_TRANSIENT, EXIT_USER_ERROR, ConfigError
from llmft.trainer.failures import Teller, describe_failure, extras_providing, missing_package
from llmft.trainer.mlflow_settings import redact_credentials


@pytest.mark.parametrize("teller", [Teller(), TRAINER, cli.group_teller("data")], ids=["plain", "trainer", "cli"])
def test_an_io_error_of_any_kind_is_transient_and_names_the_file(teller):
    """EIO from a flaky network volume (not a full disk, not a bad path) is retried: exit 200, one line."""
    code, message = describe_failure(OSError(errno.EIO, os.strerror(errno.EIO), "/data/runs/a/metrics.jsonl"), teller)
    assert code == EXIT_TRANSIENT
    assert message.startswith("/data/runs/a/metrics.jsonl: Input/output error (OSError, errno 5). An I/O fault")
    assert "\n" not in message and "exit 200 is retried" in message
    assert ("resumes from its newest complete checkpoint" in message) == (teller is TRAINER)


def test_an_unexpected_exception_is_a_bug_and_a_user_error_keeps_its_lines():
    code, message = describe_failure(ZeroDivisionError("division\nby zero"))
    assert code == EXIT_INTERNAL and message.startswith("internal error: ZeroDivisionError: division by zero.")
    assert describe_failure(ConfigError("c.yaml:\n  lora.r: 4 -> 8\n")) == (
        EXIT_USER_ERROR,
        "c.yaml:\n  lora.r: 4 -> 8",
    )


@pytest.mark.parametrize(
    "module, extra",
    [("kfp", "executor"), ("optuna", "katib"), ("transformers", "trainer"), ("peft", "trainer"),
     ("pyarrow", "trainer"), ("langfuse", "observe"), ("kfp.kubernetes", "pipeline"),
     ("kubeflow_katib_api.models", "katib"), ("mlflow", "observe")],
)  # fmt: skip
def test_a_missing_package_is_bad_input_naming_the_extra_that_brings_it(module, extra):
    """Read from the installed metadata (setup.cfg's extras): exit 1, never "internal error ... This is a bug"."""
    code, message = describe_failure(ModuleNotFoundError(f"No module named {module!r}", name=module))
    assert code == EXIT_USER_ERROR
    assert message == (
        f"this command needs the Python package {module!r}, which is not installed here; install the extra it comes "
        f"with: pip install 'kfp-llm-finetune[{extra}]'"
    )


def test_a_commands_own_extras_win_where_several_bring_the_package():
    assert extras_providing("kfp") == ["executor", "pipeline"]
    assert extras_providing("mlflow") == ["observe", "pipeline"]  # mlflow-skinny, mlflow: both import as mlflow
    assert extras_providing("kubernetes_validate") == ["dev"] and extras_providing("yaml") == []
    # kubeflow-katib-api imports as kubeflow_katib_api (0.19: the module llmft/katib imports), not kubeflow.katib
    assert extras_providing("kubeflow_katib_api.models") == ["katib"]
    assert missing_package(ModuleNotFoundError(name="pytest")) == (
        "this command needs the Python package 'pytest', which is not installed here; install the extra it comes "
        "with: pip install 'kfp-llm-finetune[dev]'"
    )
    line = missing_package(ModuleNotFoundError(name="mlflow"), Teller(extras=("pipeline",)))
    assert line is not None and line.endswith("[pipeline]'")
    line = missing_package(ModuleNotFoundError(name="kfp"), cli.group_teller("sweep"))
    assert line is not None and line.startswith("llmft sweep needs the Python package 'kfp'")
    assert line.endswith("pip install 'kfp-llm-finetune[pipeline]'")
    unknown = missing_package(ModuleNotFoundError(name="no_such_package"), cli.group_teller("sweep"))
    assert unknown is not None and unknown.endswith("pip install 'kfp-llm-finetune[pipeline,katib]'")
    torch_line = describe_failure(ModuleNotFoundError(name="torch"), TRAINER)[1]
    assert torch_line.startswith("the trainer needs the Python package 'torch'") and "make install" in torch_line


def test_a_missing_module_of_llmft_itself_stays_a_bug():
    assert describe_failure(ModuleNotFoundError(name="llmft.commands.gone"))[0] == EXIT_INTERNAL
    assert missing_package(ImportError("cannot import name 'x' from 'kfp'", name="kfp")) is None


@pytest.mark.parametrize(
    "url, shown",
    [
        ("http://bob:PASSWORD@host:8888/pipeline", "http://***@host:8888/pipeline"),
        ("https://ghp_TOKEN@github.example/x", "https://***@github.example/x"),  # a token alone, no password
        ("https://bob:p@ss@host/", "https://***@host/"),  # a password holding @
        ("see http://bob:pw@a/ and https://c/?next=x@y", "see http://***@a/ and https://c/?next=x@y"),
        ("http://host:5000/path@x", "http://host:5000/path@x"),  # an @ after the authority is no credential
    ],
)
def test_the_one_redactor_hides_every_userinfo(url, shown):
    assert redact_credentials(url) == shown


def test_no_failure_line_shows_a_credential():
    code, message = describe_failure(OSError(errno.EIO, "Input/output error", "https://bob:SECRET@store/b/k"))
    assert code == EXIT_TRANSIENT and "SECRET" not in message and "https://***@store/b/k" in message
    assert "SECRET" not in describe_failure(ConfigError("--host http://bob:SECRET@h: refused"))[1]


PLAIN, TRAINER_NOTE = Teller(), "; the run resumes from its newest complete checkpoint"


@pytest.mark.parametrize(
    "exc, teller, expected",
    [
        (
            OSError(errno.EIO, "Input/output error", "/d/f"),
            PLAIN,
            (200, "/d/f: Input/output error (OSError, errno 5). An I/O fault (full or read-only disk, permissions, "
                  "network storage): fix it and re-run; exit 200 is retried by the pipeline"),
        ),
        (
            OSError(errno.EIO, "Input/output error"),
            TRAINER,
            (200, "Input/output error (OSError, errno 5). An I/O fault (full or read-only disk, permissions, network "
                  "storage): fix it and re-run; exit 200 is retried by the pipeline" + TRAINER_NOTE),
        ),
        (PermissionError(), PLAIN, (200, "PermissionError (PermissionError, errno None). An I/O fault (full or "
                                          "read-only disk, permissions, network storage): fix it and re-run; exit 200 "
                                          "is retried by the pipeline")),
        (KeyboardInterrupt(), PLAIN, (130, "interrupted (Ctrl-C)")),
        (KeyboardInterrupt("stopped\nby SIGTERM"), PLAIN, (130, "stopped by SIGTERM")),
        (
            ValueError("bad\n value"),
            PLAIN,
            (3, "internal error: ValueError: bad value. This is a bug; re-run with LLMFT_DEBUG=1 for the traceback and "
                "report it"),
        ),
    ],
)  # fmt: skip
def test_each_kind_of_failure_is_told_in_exactly_these_words(exc, teller, expected):
    """The lines docs/failure-modes.md quotes: every branch of the one mapping, word for word."""
    assert describe_failure(exc, teller) == expected


def test_a_full_disk_names_what_was_written_and_a_short_path_is_bad_input():
    code, message = describe_failure(OSError(errno.ENOSPC, "No space left on device", "/d/f"), TRAINER)
    assert code == 200 and message.startswith("/d/f: No space left on device (errno 28, ENOSPC) writing the run's")
    assert message.endswith(TRAINER_NOTE) and "\n" not in message
    assert describe_failure(OSError(errno.EFBIG, "File too large", "/d/f"))[0] == 1  # ulimit -f: a retry hits it
    code, message = describe_failure(OSError(errno.ENAMETOOLONG, "File name too long", "/d/" + "x" * 300))
    assert code == 1 and "file name too long" in message


@pytest.mark.parametrize(
    "world, exc, code",
    [
        ("2", RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5011"), 200),
        ("2", RuntimeError("Connection reset by peer"), 200),
        ("2", RuntimeError("shape mismatch"), 3),
        ("1", RuntimeError("Connection reset by peer"), 3),  # one rank has no peer to lose
        ("", RuntimeError("Connection reset by peer"), 3),
    ],
)
def test_a_lost_peer_rank_is_transient_only_in_a_multi_rank_run(monkeypatch, world, exc, code):
    import torch.distributed  # noqa: F401 - the check looks for torch already loaded

    monkeypatch.setenv("WORLD_SIZE", world)
    got, message = describe_failure(exc, TRAINER)
    assert got == code
    assert message.startswith("lost a peer rank (RuntimeError: ") == (code == 200)


def test_a_dist_error_of_any_text_is_a_lost_peer(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert describe_failure(dist.DistError("store timed out"), TRAINER)[0] == 200


def test_a_lost_peer_and_a_signal_stop_are_told_word_for_word(monkeypatch):
    import torch.distributed  # noqa: F401 - the check looks for torch already loaded

    from llmft.trainer.errors import SignalStop

    monkeypatch.setenv("WORLD_SIZE", "2")
    long = "Connection reset by peer " + "x" * 400
    code, message = describe_failure(RuntimeError(long), TRAINER)
    assert (code, message) == (
        200,
        f"lost a peer rank (RuntimeError: {long[:300]}): another node or rank died without a checkpoint (OOM kill, "
        "lost node, crash); exit 200 so this pod restarts too and every rank resumes together from the newest "
        "complete checkpoint",
    )
    monkeypatch.delenv("WORLD_SIZE")
    assert describe_failure(RuntimeError("Connection reset by peer"), TRAINER)[0] == 3  # no WORLD_SIZE: one rank
    assert describe_failure(SignalStop(15, "stopped by SIGTERM"), TRAINER) == (143, "stopped by SIGTERM")


def test_extras_are_read_from_any_requirement_spelling(monkeypatch):
    from llmft.trainer import failures

    requirements = [
        'Foo_Bar>=1; extra == "x"',
        "PyYAML>=6; extra == 'y'",
        'kfp-kubernetes>=2.16; extra == "pipeline"',
        'top-pkg; extra == "z"',
        "numpy>=1.26",  # the base install: no extra
        'kfp-llm-finetune[trainer]; extra == "dev"',
    ]
    monkeypatch.setattr(failures.importlib.metadata, "requires", lambda name: requirements)
    assert extras_providing("foo_bar") == ["x"] and extras_providing("yaml") == ["y"]
    assert extras_providing("kfp.kubernetes") == ["pipeline"] and extras_providing("kfp") == []
    assert extras_providing("top_pkg.sub") == ["z"] and extras_providing("numpy") == []
    assert failures._preferred(["dev", "x"], ()) == ["x"] and failures._preferred(["dev"], ()) == ["dev"]
    assert failures._preferred(["x", "y"], ("y",)) == ["y"]
    assert missing_package(ModuleNotFoundError(name="other.mod")) == (
        "this command needs the Python package 'other.mod', which is not installed here; install it: pip install other"
    )

    def absent(name):
        raise failures.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(failures.importlib.metadata, "requires", absent)
    assert extras_providing("kfp") == []  # a source tree without installed metadata
