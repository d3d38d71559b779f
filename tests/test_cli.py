"""Bad input to a command (files, directories, flags) ends it with one clear error line, never a traceback."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from noderuntime.access.identity import load_or_create, self_signed
from noderuntime.cli import main
from noderuntime.models import artifacts
from noderuntime.models.artifacts import LayerRange


def _run(*argv: str) -> str:
    """The command's last stderr line, after checking it failed with status 1 and no traceback.

    In this process: a traceback would be an exception out of ``main``. The process around
    ``main`` is checked by the subprocess tests below.
    """
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(list(argv))
    assert status == 1, err.getvalue()
    return err.getvalue().strip().splitlines()[-1]


def _run_process(python: str, cli_env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m noderuntime ARGV`` in a process of its own."""
    return subprocess.run([python, "-m", "noderuntime", *argv], capture_output=True, text=True, env=cli_env, timeout=60)


@pytest.mark.parametrize("command", ["up", "relay"])
@pytest.mark.parametrize("problem", ["missing", "not PEM", "another certificate's key"])
def test_unusable_tls_files_are_a_clear_error(command: str, problem: str, tiny_model: Path, tmp_path: Path) -> None:
    files, other = self_signed(tmp_path / "a"), self_signed(tmp_path / "b")
    cert, key = files.cert, files.key
    if problem == "missing":
        cert = tmp_path / "nowhere.crt"
    elif problem == "not PEM":
        cert.write_text("not a certificate\n")
    else:
        key = other.key
    args = ["--listen", "127.0.0.1:0", "--issuer-key", "00" * 32, "--tls-cert", str(cert), "--tls-key", str(key)]
    if command == "up":
        args += ["--model", str(tiny_model), "--layers", "0:2", "--data-dir", str(tmp_path / "node")]
    line = _run(command, *args)
    assert line.startswith(f"noderuntime: error: cannot use the certificate {cert} with the key {key}")


@pytest.mark.parametrize("command", ["up", "tracker"])
@pytest.mark.parametrize("problem", ["not a directory", "a damaged key"])
def test_an_unusable_data_directory_is_a_clear_error(
    command: str, problem: str, tiny_model: Path, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    if problem == "not a directory":
        data_dir.write_text("a file\n")
    else:
        load_or_create(data_dir)  # a key made as a node makes it, then damaged
        (key_file,) = data_dir.iterdir()
        key_file.write_text("not a key\n")
    args = ["--listen", "127.0.0.1:0", "--data-dir", str(data_dir)]
    if command == "up":
        args += ["--model", str(tiny_model), "--layers", "0:2", "--issuer-key", "00" * 32]
    line = _run(command, *args)
    if problem == "not a directory":
        assert line.startswith(f"noderuntime: error: cannot keep a key in {data_dir}")
    else:
        assert line.startswith(f"noderuntime: error: {data_dir / 'node.key'} is not a readable private key")


@pytest.mark.parametrize("problem", ["missing", "not JSON"])
def test_unreadable_probe_references_stop_the_tracker_at_once(problem: str, tmp_path: Path) -> None:
    references = tmp_path / "refs.json"
    if problem == "not JSON":
        references.write_text("{ not json\n")
    line = _run(
        *("tracker", "--local-swarm", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "tracker")),
        *("--probe-references", str(references)),
    )
    assert line.startswith(f"noderuntime: error: cannot read probe references {references}")


@pytest.mark.parametrize("command", ["usage", "gateway"])
@pytest.mark.parametrize("problem", ["not a database", "under a file"])
def test_an_unusable_ledger_is_a_clear_error(command: str, problem: str, tiny_model: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.sqlite"
    if problem == "not a database":
        ledger.write_bytes(b"this is not an SQLite file, it only has the name of one" * 4)
    else:
        (tmp_path / "file").write_text("in the way\n")
        ledger = tmp_path / "file" / "ledger.sqlite"
    args = ["usage", "--ledger", str(ledger)]
    if command == "gateway":
        args = ["gateway", "--listen", "127.0.0.1:0", "--tracker", "http://127.0.0.1:9", "--model", str(tiny_model)]
        args += ["--ledger", str(ledger)]
    line = _run(*args)
    if command == "usage" and problem == "under a file":
        assert line == f"noderuntime: error: no ledger at {ledger}"
    else:
        assert line.startswith(f"noderuntime: error: cannot use the ledger {ledger}")


@pytest.mark.parametrize(
    "argv",
    [
        ("shard", "split", "{model}", "--ranges", "0:2,2:4", "--out", "{blocked}"),
        ("probe", "reference", "--model", "{model}", "--ranges", "0:2", "--seeds", "1", "--out", "{blocked}/refs.json"),
    ],
    ids=["shard split", "probe reference"],
)
def test_an_output_path_that_cannot_be_written_is_a_clear_error(
    argv: tuple[str, ...], tiny_model: Path, tmp_path: Path
) -> None:
    blocked = tmp_path / "a file"
    blocked.write_text("in the way\n")
    line = _run(*(a.format(model=tiny_model, blocked=blocked) for a in argv))
    assert line.startswith("noderuntime: error: [Errno ") and str(blocked) in line


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
@pytest.mark.parametrize(
    "argv",
    [
        ("up", "--model", "m.gguf", "--layers", "0:1", "--idle-timeout"),
        ("tracker", "--expire-after"),
        ("tracker", "--route-rate"),
        ("gateway", "--model", "m.gguf", "--tracker", "http://t", "--queue-timeout"),
    ],
    ids=["up", "tracker", "tracker-rate", "gateway"],
)
def test_a_seconds_flag_takes_a_positive_finite_number(argv: tuple[str, ...], value: str) -> None:
    """A negative or NaN timeout used to start a node that then died on its first stream."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main([*argv, value])
    assert exited.value.code == 2
    assert f"{argv[-1]}: expected a" in err.getvalue().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--queue-limit", "--queue-per-key"])
@pytest.mark.parametrize("value", ["-1", "1.5", "many"])
def test_the_gateways_line_bounds_are_counts(flag: str, value: str) -> None:
    """The line's bounds: 0 or more requests (0: none wait), nothing else."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(["gateway", "--model", "m.gguf", "--tracker", "http://t", flag, value])
    assert exited.value.code == 2
    assert f"{flag}: expected an integer >= 0" in err.getvalue().splitlines()[-1]


@pytest.mark.parametrize(
    ("value", "message"),
    [("-1", "expected an integer >= 0"), ("9", "at most 8 windows may follow one in flight"), ("1e9", "expected")],
)
def test_windows_ahead_are_a_count_within_the_protocols_bound(value: str, message: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(["up", "--model", "m.gguf", "--windows-ahead", value])
    assert exited.value.code == 2
    assert f"--windows-ahead: {message}" in err.getvalue().splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [("tracker", "--route-burst"), ("gateway", "--model", "m.gguf", "--tracker", "http://t", "--running-per-key")],
    ids=["route-burst", "running-per-key"],
)
@pytest.mark.parametrize("value", ["0", "-1", "1e9", "many"])
def test_a_clients_share_of_grants_and_sessions_is_a_positive_count(argv: tuple[str, ...], value: str) -> None:
    """A cap of 0 would refuse every client; a float or a word is no count."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main([*argv, value])
    assert exited.value.code == 2
    assert f"{argv[-1]}: expected a positive integer" in err.getvalue().splitlines()[-1]


def test_a_refused_flag_ends_the_process_with_status_2_and_one_line(python: str, cli_env: dict[str, str]) -> None:
    """The process around ``main``: argparse's refusal is its exit status, with no traceback."""
    done = _run_process(python, cli_env, "tracker", "--expire-after", "nan")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--expire-after: expected a" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--ctx", str(1 << 29), "--slots", "8"), "n_ctx_per_seq x n_seq_max must be at most"),
        (("--batch", str(1 << 20)), "n_batch <="),
        (("--threads", str(1 << 31)), "n_threads must be between"),
    ],
    ids=["ctx", "batch", "threads"],
)
def test_sizes_that_llama_cpp_would_truncate_are_refused(
    flags: tuple[str, ...], message: str, tiny_model: Path, tmp_path: Path
) -> None:
    """ctypes cuts them to 32 bits: an n_ctx of 2**32 reached llama.cpp as 0."""
    args = ["up", "--model", str(tiny_model), "--layers", "0:2", "--data-dir", str(tmp_path / "node"), *flags]
    line = _run(*args, "--issuer-key", "00" * 32, "--listen", "127.0.0.1:0")
    assert message in line, line


@pytest.mark.parametrize("problem", ["another vocabulary", "not GGUF", "missing", "a shard", "on a GPU", "local"])
def test_a_draft_model_that_cannot_draft_is_a_clear_error(
    problem: str, tiny_model: Path, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """``up --draft``: a model whose token ids mean other text would make every draft wrong."""
    draft, extra = str(tiny_models["qwen3"]), ["--layers", "0:2"]
    message = f"--draft {draft}: its vocabulary is not that of {tiny_model}"
    if problem == "not GGUF":
        (tmp_path / "draft.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
        draft = str(tmp_path / "draft.gguf")
        message = f"{draft} is not a valid GGUF file"
    elif problem == "missing":
        draft = str(tmp_path / "nowhere.gguf")
        message = f"model {draft!r} is neither a file nor a known model"
    elif problem == "a shard":  # the model's own vocabulary, but not all of it: drafts need logits
        draft = str(artifacts.split(tiny_model, [LayerRange(0, 1)], tmp_path)[0])
        message = "a draft model runs whole"
    elif problem == "on a GPU":
        extra += ["--device", "vulkan:0"]
        message = "--draft drafts for windows, which a node takes on the CPU with llama.cpp only"
    elif problem == "local":
        extra = ["--local"]
        message = "--draft is a shard node's (with --model)"
    args = ["up", "--model", str(tiny_model), "--data-dir", str(tmp_path / "node"), "--draft", draft, *extra]
    line = _run(*args, "--issuer-key", "00" * 32, "--listen", "127.0.0.1:0")
    assert line.startswith("noderuntime: error: ") and message in line, line


@contextlib.contextmanager
def _answering(body: bytes) -> Iterator[str]:
    """A real HTTP server on loopback that answers every GET with ``body`` as JSON; its URL."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 5000, "did not answer /v1/nodes with a node list"),
        (b'{"nodes": {"a": 1}}', "did not answer /v1/nodes with a node list"),
        (b'{"nodes": [{"node_id": 5}]}', "the tracker's node list is not what this version reads"),
    ],
    ids=["deep", "not a list", "not a node"],
)
def test_status_reports_a_tracker_answer_it_cannot_read_in_one_line(
    body: bytes, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tracker is a peer: whatever it answers, `status` says so in one line."""

    with _answering(body) as tracker:
        status = main(["status", "--tracker", tracker])
    captured = capsys.readouterr()
    output = (captured.out + captured.err).strip().splitlines()
    assert status == 1
    assert len(output) == 1 and output[0].startswith("noderuntime: error:") and message in output[0], output


def test_parity_on_a_shard_file_is_a_clear_error(
    tiny_model: Path, tmp_path: Path, python: str, cli_env: dict[str, str]
) -> None:
    """Its shard processes cannot load the layers the file lacks: one line, not a traceback."""
    (shard,) = artifacts.split(tiny_model, [LayerRange(0, 2)], tmp_path)
    done = _run_process(python, cli_env, "check", "parity", "--model", str(shard), "--cuts", "0,2,4")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("noderuntime: error: shard 2:4 failed to load") and "holds layers 0:2" in line, line


def test_status_reads_the_first_tracker_that_answers(capsys: pytest.CaptureFixture[str]) -> None:
    """`status --tracker A --tracker B`: A down, B's view is shown, and A's line says why it was passed over."""
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with _answering(b'{"nodes": [], "mixes": []}') as up:
        status = main(["status", "--tracker", down, "--tracker", up, "--json"])
        both_down = main(["status", "--tracker", down, "--tracker", down])
    captured = capsys.readouterr()
    assert status == 0 and both_down == 1
    assert json.loads(captured.out) == {"nodes": [], "routes": [], "unmixed": []}
    assert captured.err.count(f"cannot read {down}/v1/nodes") == 3, captured.err
