"""Exit codes that mean one thing (issue 36 item 4): a busy port is checked before the model loads and has a
code of its own, which the operator's re-fit leaves alone; docs/serving.md's table is EXIT_CODES."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

from pagoda.engine import exit_codes
from pagoda.engine.cli import serve
from pagoda.operator import refit
from pagoda.operator.render import PLAN_ANNOTATION

PAGODA = str(Path(sys.executable).parent / "pagoda")
DOC = Path(__file__).parents[2] / "docs" / "serving.md"


def _busy_port() -> tuple[socket.socket, int]:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder, holder.getsockname()[1]


def test_a_busy_port_exits_with_its_own_code_before_the_model_loads(tmp_path) -> None:
    holder, port = _busy_port()
    missing = tmp_path / "no-such-model"  # loading it would fail (exit 1): the port must be refused first
    try:
        r = subprocess.run(
            [PAGODA, "serve", str(missing), "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        holder.close()
    assert r.returncode == exit_codes.EXIT_PORT_IN_USE == 5, r.stderr
    assert r.returncode != exit_codes.EXIT_OUT_OF_MEMORY
    assert f"127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "not found" not in r.stderr.lower() and "loading" not in r.stderr.lower()


def test_a_free_port_is_bound_and_handed_on() -> None:
    sock = serve.bind_socket("127.0.0.1", 0)
    assert isinstance(sock, socket.socket)
    try:
        again = serve.bind_socket("127.0.0.1", sock.getsockname()[1])
        # bound, not listening yet: a second bind with SO_REUSEADDR may or may not succeed on this OS,
        # but once the first listens the port is taken for good
        if isinstance(again, socket.socket):
            again.close()
        sock.listen(1)
        assert isinstance(serve.bind_socket("127.0.0.1", sock.getsockname()[1]), str)
    finally:
        sock.close()


def test_refit_leaves_the_plan_alone_for_a_busy_port() -> None:
    pod = {
        "metadata": {"name": "x-0", "uid": "u", "annotations": {PLAN_ANNOTATION: "abc"}},
        "status": {
            "containerStatuses": [
                {
                    "name": refit.ENGINE_CONTAINER,
                    "restartCount": 1,
                    "lastState": {
                        "terminated": {
                            "exitCode": exit_codes.EXIT_PORT_IN_USE,
                            "reason": "Error",
                            "message": "cannot listen on 0.0.0.0:8000",
                        }
                    },
                }
            ]
        },
    }
    assert refit.failure_of(pod, PLAN_ANNOTATION) is None
    pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = (
        exit_codes.EXIT_OUT_OF_MEMORY
    )
    assert refit.failure_of(pod, PLAN_ANNOTATION) is not None  # the same pod with the OOM code is re-fitted


def test_every_code_means_one_thing_and_the_doc_table_is_generated_from_it() -> None:
    codes = [code for code, _, _ in exit_codes.EXIT_CODES]
    names = [name for _, name, _ in exit_codes.EXIT_CODES]
    assert len(set(codes)) == len(codes) and len(set(names)) == len(names)
    assert all(getattr(exit_codes, name) == code for code, name, _ in exit_codes.EXIT_CODES)
    defined = {
        v for k, v in vars(exit_codes).items() if re.fullmatch(r"EXIT_[A-Z_]+", k) and isinstance(v, int)
    }
    assert defined == set(codes)
    assert exit_codes.exit_codes_table() in DOC.read_text()


def test_uvicorns_own_start_failure_is_not_read_as_out_of_memory() -> None:
    class Failing:
        def run(self, sockets):
            raise SystemExit(3)  # uvicorn's STARTUP_FAILURE (a lifespan that failed)

    class Fine:
        def run(self, sockets):
            return None

    assert serve.run_server(Failing(), None) == exit_codes.EXIT_START_FAILED != exit_codes.EXIT_OUT_OF_MEMORY
    assert serve.run_server(Fine(), None) == exit_codes.EXIT_OK
