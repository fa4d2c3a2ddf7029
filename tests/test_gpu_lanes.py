"""tools/gpu_lanes.sh: device jobs dealt to GPUs as they come free, "alone:" jobs by themselves."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_lanes.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_jobs_share_the_gpus_and_alone_jobs_run_by_themselves(tmp_path):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(
        "# a comment\n"
        "\n"
        "echo start-a $CUDA_VISIBLE_DEVICES; sleep 3; echo end-a\n"
        "echo start-b $CUDA_VISIBLE_DEVICES; sleep 0.2\n"
        "echo start-c $CUDA_VISIBLE_DEVICES\n"
        "alone: echo start-d $CUDA_VISIBLE_DEVICES\n"
        "exit 3\n"
    )
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPUS="2")
    subprocess.run(["bash", str(SCRIPT), str(jobs)], check=True, env=env, cwd=tmp_path,
                   timeout=60)
    logs = {int(re.search(r"job-(\d+)", p.name).group(1)): p.read_text()
            for p in out.glob("job-*.log")}
    assert sorted(logs) == [1, 2, 3, 4, 5]
    gpu = {n: re.search(r"start-\w (\d)", text).group(1) for n, text in logs.items() if n < 5}
    assert gpu[1] != gpu[2]  # two jobs at once, one per GPU
    assert gpu[3] == gpu[2]  # the next job takes the GPU that came free first
    lanes = (out / "lanes.log").read_text().splitlines()
    order = [line.split(": ", 1)[1] for line in lanes]
    # the "alone" job starts only after every earlier job is done
    start_d = next(i for i, x in enumerate(order) if x.startswith("job 4 on"))
    for n in (1, 2, 3):
        assert order.index(next(x for x in order if x.startswith(f"job {n} done"))) < start_d
    assert "job 5 done, rc=3" in order and order[-1] == "all jobs done"
