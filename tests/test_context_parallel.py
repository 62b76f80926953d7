"""Context parallelism over two CPU ranks (gloo): rank 0's engine batches requests while rank 1 follows its model
calls, each request equal to the plain single-process pipeline; a killed follower fails the requests cleanly.

The ranks are two processes with torchrun's environment, started here (tests/context_parallel_ranks.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.parallel import PACKING_OFF
from diffusers_stepbatch.testing import tiny_flux_pipeline

from .ports import free_port

RANKS_SCRIPT = Path(__file__).with_name("context_parallel_ranks.py")
TOLERANCE = 1e-4
# NOTE: families whose denoiser runs split over the ranks (diffusers' plan, or the model layer's: Z-Image, LTX-2,
# HunyuanVideo 1.5)
SPLIT_FAMILIES = ["flux", "flux2", "qwenimage", "wan2.1", "wan2.2", "z-image", "ltx2", "ltx2.3", "hunyuan-video-1.5",
                  "hunyuan-video-1.5-cfg"]
# families whose sizes share calls in the model's own forward (per-image lists), so nothing is packed
OWN_MIXED_SIZES = {"z-image"}
# families whose packed calls run split (their plan splits only the forward's own inputs: parallel/packed.py)
PACKED_SPLIT = {"flux", "flux2"}
# families whose denoiser has no plan: rank 0 runs them alone, and says why
ALONE_FAMILIES = {"sd": "UNet2DConditionModel has no context-parallel plan"}
FAMILIES = [*SPLIT_FAMILIES, *ALONE_FAMILIES]
TIME_LIMIT_S = 300


def start_ranks(*args: str, world_size: int = 2) -> list[subprocess.Popen]:
    """`world_size` processes of the ranks script, each with the environment torchrun gives its workers."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        processes.append(subprocess.Popen([sys.executable, str(RANKS_SCRIPT), *args], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return processes


def wait_ranks(processes: list[subprocess.Popen], timeout: float = TIME_LIMIT_S) -> list[str]:
    """Each rank's output, after all exit (killed past `timeout`)."""
    deadline = time.monotonic() + timeout
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail(f"the ranks ran past {timeout} s:\n{process.communicate()[0][-4000:]}")
    return logs


def _read(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    out = tmp_path_factory.mktemp("context-parallel")
    processes = start_ranks("families", str(out), *FAMILIES)
    logs = wait_ranks(processes)
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-6000:]
    return {name: (_read(out, name, 0), _read(out, name, 1)) for name in [*FAMILIES, "checks"]}


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_requests_of_different_sizes_equal_the_plain_pipeline_under_ulysses(families, family):
    leader, follower = families[family]
    assert max(leader["differences"]) <= TOLERANCE, leader["differences"]
    assert len({tuple(shape) for shape in leader["shapes"]}) >= 3, leader["shapes"]
    assert leader["parallel"]["split"] and not leader["parallel"]["alone"], leader["parallel"]
    # every call rank 0 made on a split model, rank 1 made too
    assert follower["calls_followed"] == leader["parallel"]["calls_relayed"] > 0
    if family in PACKED_SPLIT:  # rows of several sizes shared packed calls, each rank holding a share of each
        assert leader["mixed"]["calls"] > 0 and leader["mixed"]["sizes_per_call"] > 1, leader["mixed"]
        assert PACKING_OFF not in str(leader["splits"])
        return
    assert leader["mixed"]["calls"] == 0
    if family in OWN_MIXED_SIZES:  # different sizes shared split calls: fewer calls than the requests' steps
        assert leader["parallel"]["calls_relayed"] < leader["steps"], leader
    else:  # these sizes don't pack under context parallelism: each size's call runs split; stats() says why
        assert leader["splits"].get(f"denoise: {PACKING_OFF}", 0) > 0, leader["splits"]


@pytest.mark.parametrize("family", sorted(ALONE_FAMILIES))
def test_a_model_without_a_plan_runs_on_rank_0_alone_and_says_why(families, family):
    leader, follower = families[family]
    assert max(leader["differences"]) <= TOLERANCE, leader["differences"]
    assert leader["parallel"]["split"] == []
    assert ALONE_FAMILIES[family] in leader["parallel"]["alone"]["unet"]
    assert leader["parallel"]["calls_relayed"] == follower["calls_followed"] == 0


@pytest.mark.parametrize("family", ["flux", "wan2.1"])
def test_per_request_state_is_refused_in_the_caller_under_context_parallelism(families, family):
    refused = families[family][0]["refused"]
    assert "teacache= can't run under context parallelism" in refused["teacache"], refused
    assert "adapters= (per-request LoRA) can't run under context parallelism" in refused["adapters"], refused


def test_wan22_splits_both_experts(families):
    leader, _ = families["wan2.2"]
    assert leader["parallel"]["split"] == ["transformer", "transformer_2"]


def test_a_killed_follower_fails_the_requests_with_a_clear_error(tmp_path):
    processes = start_ranks("kill", str(tmp_path))
    leader, follower = processes
    deadline = time.monotonic() + 120
    while not (tmp_path / "mid-run").exists():
        assert leader.poll() is None, leader.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "rank 0 never reached step 3"
        time.sleep(0.05)
    os.kill(int((tmp_path / "follower.pid").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    log = wait_ranks([leader], timeout=120)[0]
    follower.wait()
    assert leader.returncode == 0, log[-6000:]
    assert time.monotonic() - killed < 60
    seen = _read(tmp_path, "kill", 0)
    assert all(outcome.startswith("RanksLost: a context-parallel follower rank is gone")
               for outcome in seen["outcomes"]), seen["outcomes"]
    # after that, a call fails at once rather than waiting on the dead rank
    assert seen["later"].startswith("RanksLost") and seen["later_seconds"] < 5.0, seen
    assert seen["lost"]


def test_ring_attention_on_the_cpu_is_refused_on_every_rank(families):
    for seen in families["checks"]:
        assert "needs an attention backend that returns the log-sum-exp" in seen["ring"]


def test_parallel_outside_torchrun_says_how_to_launch(monkeypatch):
    from diffusers import ContextParallelConfig

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        StepBatched(tiny_flux_pipeline(), parallel=ContextParallelConfig(ulysses_degree=2))


def test_parallel_takes_only_a_context_parallel_config():
    with pytest.raises(ValueError, match="must be a diffusers ContextParallelConfig"):
        StepBatched(tiny_flux_pipeline(), parallel={"ulysses_degree": 2})


def test_teacache_with_parallel_is_refused_before_any_rank_starts():
    from diffusers import ContextParallelConfig

    from diffusers_stepbatch import TeaCacheConfig

    with pytest.raises(ValueError, match="teacache= can't run under context parallelism"):
        StepBatched(tiny_flux_pipeline(), teacache=TeaCacheConfig(threshold=0.2),
                    parallel=ContextParallelConfig(ulysses_degree=2))
    assert not torch.distributed.is_initialized()


def test_the_server_under_torchrun_answers_the_openai_client_and_stops_every_rank(tmp_path):
    import concurrent.futures

    import numpy as np

    from diffusers_stepbatch.toy import load_pipeline

    from .serve_helpers import TOY_CALL, ServerProcess, decode_b64, pixels

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port())]
    # NOTE: TMPDIR: torchrun leaves a torchelastic_* log folder in the temporary directory
    server = ServerProcess("--model", "toy", "--context-parallel", "ulysses=2", launcher=torchrun,
                           env={"TMPDIR": str(tmp_path)}).start()
    prompt = "a red circle at the top left on a white background"
    try:
        client = server.client()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda size: client.images.generate(
                model="toy-shapes", prompt=prompt, size=size, response_format="b64_json", extra_body={"seed": 7}),
                ["64x64", "96x48"]))
    finally:
        server.stop(timeout=60)  # NOTE: torchrun itself exits 1 on SIGTERM, whatever its ranks did
    log = server.log()
    # the follower made rank 0's calls until rank 0 closed, rather than dying on torchrun's SIGTERM
    assert "could not tell the context-parallel followers to stop" not in log
    assert not _processes_with(f"--port {server.port}")
    plain = load_pipeline()
    for result, (width, height) in zip(results, [(64, 64), (96, 48)]):
        want = plain(prompt, height=height, width=width, generator=torch.Generator().manual_seed(7),
                     **TOY_CALL).images[0]
        # PNG is lossless: only fp32 differences <= 1e-4 before uint8 rounding may flip a level
        assert np.abs(pixels(decode_b64(result.data[0].b64_json)) - pixels(want)).max() <= 1


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("text, degrees", [("ulysses=2", {"ulysses_degree": 2}), ("ring=4", {"ring_degree": 4}),
                                           ("ulysses=2, ring=2", {"ulysses_degree": 2, "ring_degree": 2})])
def test_context_parallel_flag_reads_as_the_config_degrees(text, degrees):
    from diffusers_stepbatch.serve.config import parse_context_parallel

    assert parse_context_parallel(text) == degrees


@pytest.mark.parametrize("text", ["ulysses", "tp=2", "ulysses=0", "ulysses=1", "ulysses=2,ulysses=2"])
def test_a_bad_context_parallel_flag_is_a_startup_error(text):
    from diffusers_stepbatch.serve import ServeConfig

    with pytest.raises(ValueError, match="context_parallel="):
        ServeConfig(context_parallel=text)


@pytest.mark.parametrize("option", [dict(teacache=0.4), dict(lora_dir="/tmp"), dict(offload="model"),
                                    dict(lora_modules={"a": "/tmp/a"})])
def test_per_request_state_options_are_refused_with_context_parallel(option):
    from diffusers_stepbatch.serve import ServeConfig

    with pytest.raises(ValueError, match="can't run under context_parallel"):
        ServeConfig(context_parallel="ulysses=2", **option)
