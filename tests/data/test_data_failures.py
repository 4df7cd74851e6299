"""Data and CLI side: nothing lost, nothing silent, bounded inputs, one-line errors.

Each test drives the real `llmft` command (a subprocess, or `llmft.cli.main` where a hub lookup
must be caught) and checks what the user sees (exit code, one line on stderr) and what is kept on
disk. docs/failure-modes.md has one row per test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import chat, read_jsonl, write_jsonl

from llmft.cli import main
from llmft.trainer.errors import EXIT_INTERRUPTED, EXIT_TRANSIENT
from llmft.trainer.io import OWNER_FILE, is_complete, owner_kind


def llmft(*args: str, cwd: Path | None = None, timeout: int = 180, env: dict | None = None):
    script = Path(sys.executable).parent / "llmft"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "llmft"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or os.environ.copy()
    )


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`llmft ARGS` through `llmft.cli.main` in this process (no interpreter start-up), as a CompletedProcess."""
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["llmft", *args], code, out.out, out.err)


def assert_one_line_error(run, code: int, *needles: str) -> str:
    assert run.returncode == code, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def good_rows(n: int) -> list[dict]:
    return [chat(f"Question {i}?", f"Answer {i}.") for i in range(n)]


def _bare_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny tokenizer without its chat template (so --chat-template is used)."""
    out = tmp_path / "bare-tokenizer"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    for leftover in out.glob("chat_template.*"):
        leftover.unlink()
    return out


# ----------------------------------------------------------------------------- item 1: nothing lost


@pytest.mark.slow
def test_prepare_refuses_a_folder_it_did_not_write_unless_forced(tmp_path):
    src = write_jsonl(tmp_path / "data.jsonl", good_rows(20))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    run = llmft("data", "prepare", "--input", str(src), "--output", str(precious))
    assert_one_line_error(run, 1, str(precious), "--force")
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert not list(tmp_path.glob(".precious.*")), "nothing written beside it either"

    forced = llmft("data", "prepare", "--input", str(src), "--output", str(precious), "--force")
    assert forced.returncode == 0, forced.stderr
    assert not (precious / "thesis.tex").exists() and owner_kind(precious) == "prepared-dataset"
    again = llmft("data", "prepare", "--input", str(src), "--output", str(precious))  # ours now: replaced freely
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
def test_output_that_is_or_holds_the_input_is_refused_even_with_force(tmp_path):
    folder = tmp_path / "data"
    src = write_jsonl(folder / "rows.jsonl", good_rows(20))
    before = src.read_bytes()
    for output in (src, folder):
        run = llmft("data", "prepare", "--input", str(src), "--output", str(output), "--force")
        assert_one_line_error(run, 1, "would replace the input")
        assert src.read_bytes() == before
    run = llmft("data", "prepare", "--input", str(folder), "--output", str(folder), "--force")
    assert_one_line_error(run, 1, "would replace the input")
    assert sorted(p.name for p in folder.iterdir()) == ["rows.jsonl"]


def test_tokenize_and_tiny_model_refuse_a_foreign_output(tmp_path, prepared_sample, tiny_model_dir, capsys):
    foreign = tmp_path / "shards"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    tokenize = ["data", "tokenize", "--input", str(prepared_sample), "--model", str(tiny_model_dir)]
    run = in_process(capsys, *tokenize, "--output", str(foreign))
    assert_one_line_error(run, 1, str(foreign), "not written by llmft as tokenized-dataset")
    run = in_process(capsys, *tokenize, "--output", str(prepared_sample), "--force")
    assert_one_line_error(run, 1, "would replace the input")
    assert is_complete(prepared_sample) and (prepared_sample / "train.jsonl").is_file()

    run = in_process(capsys, "dev", "tiny-model", "--output", str(foreign))
    assert_one_line_error(run, 1, "not written by llmft as tiny-model")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    forced = in_process(capsys, "dev", "tiny-model", "--output", str(foreign), "--force")
    assert forced.returncode == 0, forced.stderr
    assert owner_kind(foreign) == "tiny-model" and not (foreign / "notes.txt").exists()


@pytest.mark.slow
def test_output_dot_is_refused_with_one_line(tmp_path):
    src = write_jsonl(tmp_path / "in" / "data.jsonl", good_rows(20))
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("keep")
    for extra in ((), ("--force",)):
        run = llmft("data", "prepare", "--input", str(src), "--output", ".", *extra, cwd=work)
        assert_one_line_error(run, 1, "current directory")
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt"]


# ----------------------------------------------------------------------------- items 7, 8: bounded inputs


@pytest.mark.slow
def test_a_row_above_max_row_bytes_is_rejected_by_size_in_prepare(tmp_path):
    rows = [json.dumps(r) for r in good_rows(150)]
    huge = json.dumps(chat("Summarize this.", "x" * (9 << 20)))  # 9 MiB on one line, default cap 8 MiB
    src = tmp_path / "data.jsonl"
    src.write_text("\n".join([*rows[:100], huge, *rows[100:]]) + "\n")
    run = llmft("data", "prepare", "--input", str(src), "--output", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    (reject,) = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert (reject["line"], reject["reason"]) == (101, "row_too_large")
    assert f"{len(huge):,} bytes" in reject["message"] and "--max-row-bytes" in reject["fix"]
    assert len(reject["raw"]) <= 210  # a snippet, not the row
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["accepted"] == 150 and report["max_row_bytes"] == 8 << 20


def test_tokenize_drops_a_huge_document_by_characters_before_tokenizing(tmp_path, tiny_model_dir, monkeypatch):
    from llmft.trainer.data.tokenize import tokenize_dataset
    from llmft.trainer.errors import DataError

    prepared = tmp_path / "prep"
    write_jsonl(prepared / "train.jsonl", [*good_rows(3), chat("Q?", "word " * 200_000)])
    import llmft.trainer.data.encode as encode

    tokenized: list[int] = []
    real_tokenize_docs = encode._tokenize_docs

    def spy(*args):  # (tokenizer, [plan,] docs): docs are (line, kind, text, spans)
        tokenized.extend(len(doc[2]) for doc in args[-1])
        return real_tokenize_docs(*args)

    monkeypatch.setattr(encode, "_tokenize_docs", spy)
    manifest = tokenize_dataset(
        prepared, str(tiny_model_dir), tmp_path / "out", max_length=64, num_proc=1, max_drop_fraction=0.5
    )
    stats = manifest["splits"]["train"]
    assert stats["documents"] == 3 and stats["dropped"] == {"too_long": 1}
    assert "characters: more than --max-length 64 tokens can hold" in stats["dropped_examples"][0]["detail"]
    assert len(tokenized) == 3 and max(tokenized) < 1000, "the huge document reached the tokenizer"
    with pytest.raises(DataError, match=r"train\.jsonl:4: document has 1,000,\d+ characters"):
        tokenize_dataset(prepared, str(tiny_model_dir), tmp_path / "err", max_length=64, truncation="error")


@pytest.mark.slow
def test_tokenize_fails_when_too_many_rows_are_dropped_and_counts_the_reasons(tmp_path, tiny_model_dir, capsys):
    prepared = tmp_path / "prep"
    long_answer = " ".join(["the model trains the loss curve quickly."] * 30)
    write_jsonl(prepared / "train.jsonl", [chat(f"Q{i}?", long_answer) for i in range(19)] + good_rows(1))
    args = ["data", "tokenize", "--input", str(prepared), "--model", str(tiny_model_dir)]
    args += ["--output", str(tmp_path / "out"), "--max-length", "64", "--num-proc", "1"]
    line = assert_one_line_error(llmft(*args), 1, "19 of 20 rows dropped (95.00%)", "too_long 19")
    assert "--max-drop-fraction 1.00%" in line and "train.jsonl:1: too_long" in line
    assert not (tmp_path / "out").exists()
    allowed = in_process(capsys, *args, "--max-drop-fraction", "1")
    assert allowed.returncode == 0, allowed.stderr
    again = in_process(capsys, *args)  # a cache hit is no way around the guard
    assert_one_line_error(again, 1, "19 of 20 rows dropped")


# ----------------------------------------------------------------------------- item 9: conversation structure

STRICT_TEMPLATE = (  # the rule Llama 2 / Mistral templates enforce, verbatim in spirit
    "{%- if messages[0]['role'] == 'system' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'system' %}{{ raise_exception('system message only first') }}{%- endif %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)


@pytest.mark.parametrize(
    "roles, reason",
    [
        (("user", "assistant"), None),
        (("system", "user", "assistant", "user", "assistant"), None),
        (("assistant", "user", "assistant"), "assistant_first"),
        (("user", "user", "assistant"), "roles_not_alternating"),
        (("user", "assistant", "assistant"), "roles_not_alternating"),
        (("user", "assistant", "system"), "misplaced_system"),
        (("system", "user", "system", "assistant"), "misplaced_system"),
        (("user", "assistant", "user"), "last_turn_not_assistant"),
    ],
)
def test_prepare_accepts_exactly_the_role_orders_a_strict_chat_template_renders(
    tmp_path, tiny_model_dir, roles, reason
):
    from transformers import AutoTokenizer

    from llmft.trainer.data.prepare import prepare_dataset

    row = {"messages": [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(roles)]}
    src = write_jsonl(tmp_path / "d.jsonl", [*good_rows(4), row])
    report = prepare_dataset(str(src), tmp_path / "out", max_reject_fraction=1.0, val_fraction=0.0)
    assert report["reject_reasons"] == ({reason: 1} if reason else {})
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if reason is None:
        assert tok.apply_chat_template(row["messages"], chat_template=STRICT_TEMPLATE, tokenize=False)
    elif reason != "last_turn_not_assistant":  # renders, but nothing answers the last turn: stricter than Jinja
        with pytest.raises(Exception, match="alternate|only first"):
            tok.apply_chat_template(row["messages"], chat_template=STRICT_TEMPLATE, tokenize=False)


# ----------------------------------------------------------------------------- item 10: one-line errors


@pytest.mark.slow
def test_corrupt_parquet_in_an_input_folder_is_one_line_exit_1(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(5)], "completion": ["c"] * 5}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 this is not parquet at all")
    run = llmft("data", "prepare", "--input", str(folder), "--output", str(tmp_path / "out"))
    assert_one_line_error(run, 1, "b.parquet: not a readable Parquet file", "ArrowInvalid")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_non_utf8_csv_names_its_line(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(b"prompt,completion\nhello,world\nq2,caf\xe9 au lait\nq3,fine\n")
    run = llmft("data", "prepare", "--input", str(path), "--output", str(tmp_path / "out"))
    assert_one_line_error(run, 1, f"{path}:3: not UTF-8", "re-save the file as UTF-8")


def test_missing_file_with_an_unknown_suffix_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys):
    import llmft.trainer.data.sources as sources

    def no_hub(*_args, **_kwargs):
        raise AssertionError("a local file name was looked up on the hub")

    monkeypatch.setattr(sources, "load_hub_dataset", no_hub)
    monkeypatch.chdir(tmp_path)
    assert main(["data", "prepare", "--input", "nope.txt", "--output", "out"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.txt: no such file or folder" in err


@pytest.mark.slow
def test_invalid_jinja_chat_template_is_one_line(tmp_path, tiny_model_dir, prepared_sample):
    bare = _bare_tokenizer(tiny_model_dir, tmp_path)
    run = llmft(
        "data", "tokenize", "--input", str(prepared_sample), "--model", str(bare), "--output", str(tmp_path / "out"),
        "--chat-template", "{% for message in messages %}{{ message['content'] }",
    )  # fmt: skip
    assert_one_line_error(run, 1, "--chat-template (fallback:inline) is not valid Jinja: line 1")


def _unshare_works() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -Urm` (user + mount namespaces) to mount a tmpfs")
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_full_or_read_only_disk_exits_200_with_one_line(tmp_path, fault):
    """A real tmpfs of 64 KiB (full) or remounted read-only, in a private mount namespace."""
    src = write_jsonl(tmp_path / "data.jsonl", good_rows(2000))  # ~120 KB of output: more than the tmpfs holds
    disk = tmp_path / "disk"
    disk.mkdir()
    script = Path(sys.executable).parent / "llmft"
    remount = 'mount -o remount,ro "$1" && ' if fault == "read-only" else ""
    shell = (
        f'mount -t tmpfs -o size=64k tmpfs "$1" && {remount}'
        f'"{script}" data prepare --input "$2" --output "$1/out"; rc=$?; ls -A "$1"; exit $rc'
    )
    run = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", shell, "sh", str(disk), str(src)], capture_output=True, text=True, timeout=180
    )
    needle = "No space left on device" if fault == "full" else "Read-only file system"
    assert_one_line_error(run, EXIT_TRANSIENT, needle, "exit 200 is retried")
    assert run.stdout.strip() == "", f"left behind on the disk: {run.stdout!r}"


def test_cli_maps_every_failure_to_its_exit_code_and_one_line(monkeypatch, capsys):
    from llmft.cli import run_command
    from llmft.trainer.errors import EXIT_INTERNAL

    def raising(exc):
        def func(_args):
            raise exc

        return func

    cases = [
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted"),
        (OSError(28, "No space left on device", "/data/out/train.jsonl"), EXIT_TRANSIENT, "/data/out/train.jsonl"),
        (ZeroDivisionError("division by zero"), EXIT_INTERNAL, "internal error: ZeroDivisionError"),
    ]
    for exc, code, needle in cases:
        assert run_command(raising(exc), None) == code
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err
    monkeypatch.setenv("LLMFT_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        run_command(raising(ZeroDivisionError("boom")), None)


@pytest.mark.slow
def test_help_and_readme_list_every_exit_code(repo_root):
    from llmft.trainer.errors import EXIT_CODE_MEANINGS

    out = subprocess.run([sys.executable, "-m", "llmft", "--help"], capture_output=True, text=True, check=True).stdout
    readme = (repo_root / "README.md").read_text()
    for code in EXIT_CODE_MEANINGS:
        assert f"\n  {code:>3}  " in out, f"exit code {code} missing from llmft --help"
        assert f"| `{code}` |" in readme, f"exit code {code} missing from the README's exit-code table"
    assert "LLMFT_DEBUG=1" in out and "LLMFT_DEBUG=1" in readme


# ----------------------------------------------------------------------------- item 12: files and processes


def test_tiny_model_weights_are_readable_by_other_users(tmp_path):
    import stat

    from llmft.trainer.tiny_model import build_tiny_model

    old = os.umask(0o022)
    try:
        out = build_tiny_model(tmp_path / "tiny")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644, modes  # safetensors itself creates 0600
    assert set(modes.values()) == {0o644}, modes


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


SLOW_CHATML = (  # chatml, plus a busy loop per conversation: a run lasts long enough to be stopped mid-way
    "{%- for _ in range(1000) %}{%- for _ in range(300) %}{%- endfor %}{%- endfor %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
)


def _start_slow_tokenize(tmp_path, tiny_model_dir, prepared_sample, **popen):
    """`llmft data tokenize` with SLOW_CHATML, returned once its temp dir and pool workers exist."""
    bare = _bare_tokenizer(tiny_model_dir, tmp_path)
    script = Path(sys.executable).parent / "llmft"
    command = [str(script), "data", "tokenize", "--input", str(prepared_sample), "--model", str(bare)]
    command += ["--output", str(tmp_path / "out"), "--num-proc", "2", "--max-length", "256"]
    proc = subprocess.Popen([*command, "--chat-template", SLOW_CHATML], **popen)
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (len(workers) < 2 or not list(tmp_path.glob(".out.*.tmp"))):
        workers = _descendants(proc.pid)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    return proc, command, workers


def _kill_all(proc, workers) -> None:
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


def _wait_gone(workers, seconds: float = 20) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    return [pid for pid in workers if _alive(pid)]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_tokenize_with_one_line_and_nothing_left(tmp_path, tiny_model_dir, prepared_sample):
    proc, _command, workers = _start_slow_tokenize(
        tmp_path, tiny_model_dir, prepared_sample, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.poll() is None and len(workers) >= 2, "tokenize ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends an evicted or preempted pod
        out, err = proc.communicate(timeout=120)
        assert _wait_gone(workers) == []
    finally:
        _kill_all(proc, workers)
    run = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_one_line_error(run, 143, "stopped by SIGTERM; nothing was written")
    assert not list(tmp_path.glob(".out*")) and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_tokenize_leaves_no_workers_and_the_next_run_removes_its_temp_dir(
    tmp_path, tiny_model_dir, prepared_sample
):
    out = tmp_path / "out"
    proc, command, workers = _start_slow_tokenize(
        tmp_path, tiny_model_dir, prepared_sample, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.poll() is None and len(workers) >= 2, "tokenize ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        orphans = _wait_gone(workers)
        assert not orphans, f"pool workers outlived their killed parent: {orphans}"
    finally:
        _kill_all(proc, workers)
    (stale,) = tmp_path.glob(".out.*.tmp")
    assert json.loads((stale / OWNER_FILE).read_text())["pid"] == proc.pid

    foreign = tmp_path / ".out.someone-else.tmp"  # not ours: never touched
    foreign.mkdir()
    rerun = llmft(*command[1:], "--chat-template", "chatml")  # same --output, a quick template
    assert rerun.returncode == 0, rerun.stderr
    assert not stale.exists() and foreign.is_dir() and is_complete(out)
    assert sorted(p.name for p in tmp_path.glob(".out.*")) == [foreign.name]


def test_failure_modes_doc_names_only_tests_that_exist(repo_root):
    """A row whose test was renamed (or never written) describes behaviour nothing checks: the `ulimit -f` row
    said exit 200 after the code and its test had moved to exit 1."""
    import re

    doc = (repo_root / "docs" / "failure-modes.md").read_text()
    defined = set()
    for path in (repo_root / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    assert sorted(set(re.findall(r"`(test_\w+)`", doc)) - defined) == []


def test_failure_modes_doc_has_a_row_per_test(repo_root):
    import re

    doc = (repo_root / "docs" / "failure-modes.md").read_text()
    files = [
        repo_root / "tests" / "data" / "test_data_failures.py",
        repo_root / "tests" / "data" / "test_data_signals.py",
        repo_root / "tests" / "data" / "test_data_bad_inputs.py",
        repo_root / "tests" / "trainer" / "test_corrupt_checkpoints.py",
        repo_root / "tests" / "pipeline" / "test_pipeline_failure_modes.py",
        repo_root / "tests" / "katib" / "test_sweep_output.py",
        repo_root / "tests" / "trainer" / "test_config_limits.py",
        repo_root / "tests" / "data" / "test_template_limits.py",
        repo_root / "tests" / "pipeline" / "test_local_run_failure.py",
        repo_root / "tests" / "pipeline" / "test_local_run_operator.py",
        repo_root / "tests" / "pipeline" / "test_promote_decision.py",
        repo_root / "tests" / "pipeline" / "test_registry_store_full.py",
        repo_root / "tests" / "pipeline" / "test_eval_disk_full.py",
        repo_root / "tests" / "core" / "test_cli_inputs.py",
        repo_root / "tests" / "data" / "test_data_text_inputs.py",
        repo_root / "tests" / "core" / "test_probe_failures.py",
        repo_root / "tests" / "pipeline" / "test_probe_plan.py",
        repo_root / "tests" / "trainer" / "test_damaged_base.py",
        repo_root / "tests" / "core" / "test_output_lock.py",
    ]
    tests = {name for path in files for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    tests -= {"test_failure_modes_doc_has_a_row_per_test", "test_failure_modes_doc_names_only_tests_that_exist"}
    missing = sorted(name for name in tests if f"`{name}`" not in doc)
    assert not missing, f"docs/failure-modes.md has no row for {missing}"
