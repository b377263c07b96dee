"""Shared fixtures: tiny random HF targets (real transformers models, made on the fly); the session's
torch threads; the check that no process a test started outlives the session."""

from __future__ import annotations

import getpass
import os
import tempfile
import time
import uuid
from pathlib import Path

# Triton's CPU interpreter for tests/kernels. It must be on before triton is first imported (its own
# library functions are decorated then), and transformers imports triton, so it is set here, for the
# whole session. Harmless elsewhere: on CPU nothing but tests/kernels launches a Triton kernel (the
# kernels' dispatch defaults to the torch reference there). TRITON_INTERPRET=0 runs them compiled on CUDA.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread in every process the tests start (stages, dvc, torchrun ranks inherit it; torch reads it when
# imported): `make test` keeps both cores busy with two workers, and a stage with torch's default 2 threads beside
# the other worker's test was seen 1.6x slower than alone (the smoke `dvc repro` ran past its 900 s timeout).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# F.linear everywhere (drelay/models/cpu_linear.py): tests compare exact arithmetic, not this machine's timings
os.environ.setdefault("DRELAY_FEW_ROW_LINEAR_MAX_ROWS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from drelay.models.target import Target  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# drelay.models.target.cache_root: the SmolLM2 tokenizer parsed out of its GGUF (~15 s) once for the whole run,
# shared by both xdist workers and every stage process (they inherit it), kept out of the user's ~/.cache.
os.environ.setdefault("DRELAY_CACHE", str(Path(tempfile.gettempdir()) / f"drelay-test-cache-{getpass.getuser()}"))

# Tiny models gain nothing from intra-op threads; on a busy 2-core CPU they oversubscribe it (seen
# ~100x slower). One thread for the whole session (subprocesses the tests start set their own).
torch.set_num_threads(1)

# Every process this session starts inherits this variable (subprocess environments are copies of
# os.environ), so one it leaves behind is recognised even after it was reparented to init.
SESSION_MARK = "DRELAY_PYTEST_SESSION"
os.environ[SESSION_MARK] = uuid.uuid4().hex
SESSION_START = time.time()


def make_tiny_target(vocab_size: int = 96, dtype: torch.dtype = torch.float64, seed: int = 0,
                     num_layers: int = 6, init: float = 0.3, max_positions: int = 512) -> Target:
    """A random 6-layer Llama. A large init std makes its greedy continuations varied, not one
    repeated token, so acceptance lengths and stop tokens land everywhere in a block."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=True,
                      initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Target(LlamaForCausalLM(cfg).to(dtype), name=f"tiny-llama-{vocab_size}-{seed}")


@pytest.fixture
def one_thread():
    """One torch thread during the test (already the whole session's setting, see above; kept for
    tests that set other counts in between). `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_target() -> Target:
    return make_tiny_target()


# The files that take most of the suite's time, longest first (a run on 2 cores, 2026-12-03: the smoke `dvc repro`
# file ~430 s of test time, kill-and-resume ~80 s, the other long ones 20-60 s). `make test` runs two
# pytest-xdist workers with --dist loadfile --no-loadscope-reorder, which hands out files in this order: the
# smoke pipeline takes one worker from the start, the other works down the long files, and the short ones fill
# both at the end.
LONG_FIRST = ("tests/pipelines/test_dvc_pipeline.py", "tests/decoding/test_generate.py", "tests/test_cli.py",
              "tests/training/test_distributed.py", "tests/pipelines/test_resume.py", "tests/training/test_joint.py",
              "tests/test_dvc_deps.py", "tests/training/test_distill.py",
              "tests/pipelines/test_registry.py")


def pytest_terminal_summary(terminalreporter):
    """Names the serving files not collected without sglang (tests/serving/conftest.py). Here, in the root
    conftest, because under xdist only the controller prints, and it never loads tests/serving's conftest."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        from tests.serving.conftest import NEEDS_SGLANG, NO_SGLANG

        terminalreporter.write_line(f"tests/serving/{{{','.join(NEEDS_SGLANG)}}} not collected: {NO_SGLANG}")


def pytest_collection_modifyitems(config, items):
    """The long files first (see LONG_FIRST), the rest in their own order. Tests marked `gpu` need CUDA;
    without it they are reported as skipped, never silently passed."""
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)
    items.sort(key=rank)  # stable: each file keeps its order
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mirror():
    """The offline data copies (benchmarks/, train_prompts/): `shared/` beside the repo clone."""
    path = Path(__file__).resolve().parents[1].parent / "shared"  # <repo>/../shared
    if not (path / "benchmarks").is_dir():  # CI has it beside the clone: its absence is a failure
        pytest.fail(f"offline data mirror not found at {path} (shared/ must sit beside the repo)")
    return path


def leftover_processes(basetemp: str, grace: float = 5.0) -> list:
    """Processes this session started that are still alive after `grace` seconds: descendants of
    this pytest process, and orphans (reparented to init) that carry this session's SESSION_MARK in
    their environment or its temp dir on their command line. Zombies are dead and not counted."""
    import psutil

    me = psutil.Process()
    token = os.environ[SESSION_MARK]
    found = {p.pid: p for p in me.children(recursive=True)}
    for proc in psutil.process_iter(["pid", "create_time", "cmdline"]):
        if proc.pid == me.pid or proc.pid in found or (proc.info["create_time"] or 0) < SESSION_START - 1:
            continue
        try:
            ours = (basetemp in " ".join(proc.info["cmdline"] or ())
                    or proc.environ().get(SESSION_MARK) == token)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if ours:
            found[proc.pid] = proc
    _, alive = psutil.wait_procs(list(found.values()), timeout=grace)
    leftover = []
    for proc in alive:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                leftover.append(proc)
        except psutil.NoSuchProcess:
            pass
    return leftover


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind(tmp_path_factory):
    """Fails the session (an error at the last test's teardown, after every other fixture's) when a
    process a test or a stage started is still running: a Prefect server, a stage, a `sleep`. The
    leftovers are listed and then killed, so the machine is clean either way."""
    basetemp = str(tmp_path_factory.getbasetemp())
    yield
    leftover = leftover_processes(basetemp)
    if not leftover:
        return
    lines = []
    for proc in leftover:
        try:
            lines.append(f"  pid {proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:300]}")
            proc.kill()
        except Exception:  # noqa: BLE001 - it may exit while we look at it
            pass
    pytest.fail(f"{len(leftover)} process(es) started by this test session still running at its end "
                f"(now killed):\n" + "\n".join(lines), pytrace=False)
