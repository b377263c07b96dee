"""SGLang in-process on CPU for tests/serving (run in .venv-sglang: `make test-serving`).

`sglang_runtime` skips, with the reason, when sglang is not importable (the main .venv never has it);
otherwise it sets up, once per session, what SGLang's model code reads on a CPU host: published server
args, a single-process gloo group, and the shims of tests/serving/cpu_stubs.py."""

from __future__ import annotations

import importlib.util
import socket

import pytest

from tests.serving import cpu_stubs

NO_SGLANG = ("sglang is not importable here: they run in .venv-sglang, after this suite in `make test` "
             "(alone: `make test-serving`)")


# Without sglang (the main .venv never has it) the files that need it are not collected, and the run's
# summary says so (tests/conftest.py: the hook must be in the root conftest to print under xdist): the export tests (plain drelay) still run here; all of them run in `make test-serving`.
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None
NEEDS_SGLANG = ("test_plugin.py", "test_serve_client.py", "test_sglang_load.py")
collect_ignore = [] if SGLANG_INSTALLED else list(NEEDS_SGLANG)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sglang_runtime():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(NO_SGLANG)
    cpu_stubs.preimport_without_torchvision()
    cpu_stubs.native_rotary_embedding()
    from sglang.srt.distributed.parallel_state import (init_distributed_environment, initialize_model_parallel,
                                                       model_parallel_is_initialized)
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", "dummy", "--device", "cpu"])
    server_args.resolve_once()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, gpu_id=None))
    if not model_parallel_is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel()
    return server_args
