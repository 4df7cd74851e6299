"""The train task's log in the KFP UI (issue 44 item 1): the launcher passes on the master's (or TrainJob node 0's)
log, with the trainer's ``progress:`` lines thinned to the newest one of each poll, whatever the step rate."""

from __future__ import annotations

from llmft.components.lib.jobs.pytorchjob_logs import MasterLogFollower, newest_progress_only
from llmft.components.lib.jobs.pytorchjob_spec import JOB_NAME_LABEL, JOB_ROLE_LABEL
from llmft.trainer.progress import Progress


def _progress(step: int, total: int = 100) -> str:
    return Progress(step, total, elapsed_s=step * 2.0, eta_s=(total - step) * 2.0, tokens_per_s=5e4, loss=1.0).line()


def test_only_the_newest_progress_line_of_a_batch_is_kept_and_every_other_line_stays():
    lines = [
        "[llmft] lora: 1,000 trainable",
        _progress(1),
        "step=1 loss=2",
        _progress(2),
        "eval_loss=1.5",
        _progress(3),
    ]
    assert newest_progress_only(lines) == [
        "[llmft] lora: 1,000 trainable",
        "step=1 loss=2",
        "eval_loss=1.5",
        _progress(3),
    ]
    assert newest_progress_only(["no progress here"]) == ["no progress here"]
    assert newest_progress_only([]) == []


def test_the_launcher_prints_at_most_one_progress_line_per_poll_with_total_and_eta(fake_cluster, fake_core_api):
    labels = {JOB_NAME_LABEL: "job", JOB_ROLE_LABEL: "master"}
    fake_core_api.add_pod("team-a", "job-master-0", labels)
    printed: list[str] = []
    follow = MasterLogFollower(fake_cluster, "job", "team-a", printed.append)
    fake_core_api.append_log(
        "team-a", "job-master-0", "\n".join(_progress(s) for s in range(1, 60)) + "\nstep=59 loss=1\n"
    )
    follow()
    fake_core_api.append_log("team-a", "job-master-0", "\n".join(_progress(s) for s in range(60, 101)) + "\n")
    follow()
    progress = [line for line in printed if "progress: " in line]
    assert progress == [f"[job-master-0] {_progress(59)}", f"[job-master-0] {_progress(100)}"]
    assert "step 100/100 (100%)" in progress[-1] and "ETA 0s" in progress[-1]
    assert "[job-master-0] step=59 loss=1" in printed
