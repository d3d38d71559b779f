"""Fetching only a shard's layers over HTTP, from a real file server on loopback.

The shard file a ranged pull writes is byte for byte the one ``shard split`` writes; it
costs about the range's share of the model; every tensor is checked against a signed
manifest; each way a server can misbehave is a clear error or a resume, never a shard.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from noderuntime.access.identity import Identity
from noderuntime.cli import main
from noderuntime.models import artifacts, fetch, manifest, synth
from noderuntime.models.artifacts import LayerRange
from noderuntime.models.fetch import FetchError
from noderuntime.models.manifest import Manifest, ManifestError
from noderuntime.operations.httpserve import serve_http
from noderuntime.services import ready
from noderuntime.services.cluster import ManagedProcess
from noderuntime.testing.clusters import local_tracker_args
from noderuntime.testing.rangeserver import RangeServer, write_split_parts
from noderuntime.tracker.app import Tracker

# what a pull may read beyond the headers and the range's tensors: the small gaps between
# wanted tensors it reads rather than asking for each (fetch.MERGE_GAP a gap), a few
SLACK = 256 << 10
MULTI_SHAPE = synth.ModelShape(
    n_layer=6, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=2048, context_length=512, tied_output=False
)
MULTI_CUTS = [14, 37]  # part 1: embedding, block 0 and some of 1; part 2: the rest of 1, 2 and 3; part 3: the rest


@attrs.frozen
class Served:
    """A model as a publisher serves it, its signed manifest, and its shard files as ``shard split`` cuts them."""

    root: Path  # the folder the server serves
    name: str  # the (first) file's name
    whole: Path  # the model in one file
    manifest: Manifest
    manifest_path: Path
    splits: dict[str, Path]


@pytest.fixture(scope="module")
def publisher() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def demo(smollm2: Path, publisher: Identity, tmp_path_factory: pytest.TempPathFactory) -> Served:
    folder = tmp_path_factory.mktemp("demo")
    (folder / "served").mkdir()
    (folder / "served" / smollm2.name).symlink_to(smollm2)
    signed = manifest.make(smollm2, publisher)
    (folder / "manifest.json").write_text(signed.dumps())
    ranges = LayerRange.parse_list("0:10,10:20,20:30")
    splits = artifacts.split(smollm2, ranges, folder / "split")
    return Served(
        folder / "served",
        smollm2.name,
        smollm2,
        signed,
        folder / "manifest.json",
        {str(r): p for r, p in zip(ranges, splits, strict=True)},
    )


@pytest.fixture(scope="module")
def multi(publisher: Identity, tmp_path_factory: pytest.TempPathFactory) -> Served:
    folder = tmp_path_factory.mktemp("multi")
    (folder / "whole").mkdir()
    whole = synth.write_model(folder / "whole" / "multi.gguf", MULTI_SHAPE, quant="Q8_0", seed=7)
    parts = write_split_parts(whole, folder / "served", MULTI_CUTS)
    signed = manifest.make(parts[0], publisher)
    (folder / "manifest.json").write_text(signed.dumps())
    ranges = LayerRange.parse_list("0:2,1:3,2:4,4:6")
    splits = artifacts.split(whole, ranges, folder / "split")
    return Served(
        folder / "served",
        parts[0].name,
        whole,
        signed,
        folder / "manifest.json",
        {str(r): p for r, p in zip(ranges, splits, strict=True)},
    )


@pytest.fixture
def serve() -> Iterator[Callable[[Path], RangeServer]]:
    """Start a file server on a folder; all are stopped after the test."""
    started: list[RangeServer] = []

    def start(root: Path) -> RangeServer:
        started.append(RangeServer(root))
        return started[-1]

    yield start
    for server in started:
        server.close()


def _share(signed: Manifest, layers: LayerRange) -> tuple[int, int]:
    """(header bytes, tensor bytes) a pull of ``layers`` must read: the headers of the parts it touches."""
    tied = artifacts.tied_output(signed.index())
    wanted = [t for t in signed.tensors if artifacts.tensor_belongs(t.name, layers, signed.n_layer, tied)]
    parts = {0} | {t.part for t in wanted}
    return sum(signed.parts[p].data_offset for p in parts), sum(t.n_bytes for t in wanted)


def _pull(server: RangeServer, served: Served, layers: str, out: Path, **options: Any) -> fetch.PulledShard:
    """A pull of ``layers``, its manifest's publisher pinned unless told otherwise."""
    options.setdefault("backoff", 0.0)
    if not options.get("trust_source"):
        options.setdefault("publisher", bytes.fromhex(served.manifest.publisher))
    return fetch.pull_layers(
        server.url(served.name), LayerRange.parse(layers), str(served.manifest_path), out, **options
    )


@pytest.mark.parametrize("layers", ["0:10", "10:20", "20:30"], ids=["head", "middle", "tail"])
def test_a_fetched_range_is_the_shard_file_split_writes_and_costs_its_share(
    layers: str, demo: Served, publisher: Identity, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    pulled = _pull(server, demo, layers, tmp_path, publisher=publisher.node_id)
    assert filecmp.cmp(pulled.path, demo.splits[layers], shallow=False)
    info = artifacts.inspect(pulled.path)
    assert info.fingerprint == demo.manifest.artifact == artifacts.inspect(demo.whole).fingerprint
    assert info.layer_range == LayerRange.parse(layers) and not pulled.reused
    header, tensors = _share(demo.manifest, LayerRange.parse(layers))
    assert header + tensors <= server.sent <= header + tensors + SLACK
    assert pulled.fetched_bytes == server.sent
    file_size = demo.whole.stat().st_size
    print(
        f"layers {layers}: {server.sent} of {file_size} bytes ({server.sent / file_size:.1%}), "
        f"{len(server.requests)} requests"
    )
    assert all(r.startswith("bytes=") and "," not in r for _, r in server.requests)  # single ranges only
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))  # the folder's lock stays
    assert left == sorted([pulled.path.name, pulled.path.name + ".verified"])


def test_a_pulled_shard_is_reused_until_it_changes(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    first = _pull(server, demo, "20:30", tmp_path)
    server.reset()
    again = _pull(server, demo, "20:30", tmp_path)
    assert again.reused and again.path == first.path and server.sent == 0
    stat = first.path.stat()
    os.utime(first.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # not the file it verified
    fresh = _pull(server, demo, "20:30", tmp_path)
    assert not fresh.reused and server.sent > 0
    assert filecmp.cmp(fresh.path, demo.splits["20:30"], shallow=False)


@pytest.mark.parametrize("layers", ["0:2", "1:3", "2:4", "4:6"])
def test_a_range_of_a_model_in_parts_reads_only_the_parts_and_spans_it_needs(
    layers: str, multi: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    assert multi.manifest.artifact == artifacts.inspect(multi.whole).fingerprint  # split keys are not identity
    assert len(multi.manifest.parts) == 3
    server = serve(multi.root)
    pulled = _pull(server, multi, layers, tmp_path)
    assert filecmp.cmp(pulled.path, multi.splits[layers], shallow=False)
    header, tensors = _share(multi.manifest, LayerRange.parse(layers))
    assert header + tensors <= server.sent <= header + tensors + SLACK
    tied = artifacts.tied_output(multi.manifest.index())
    wanted = {
        t.part
        for t in multi.manifest.tensors
        if artifacts.tensor_belongs(t.name, LayerRange.parse(layers), multi.manifest.n_layer, tied)
    }
    asked = {name for name, _ in server.requests}
    assert asked == {multi.manifest.parts[p].file for p in {0} | wanted}


def test_a_server_that_ignores_range_is_a_clear_error(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    server.faults.ignore_range = True
    with pytest.raises(FetchError, match="ignores Range requests"):
        _pull(server, demo, "10:20", tmp_path)
    assert not list(tmp_path.glob("*.gguf"))


def test_an_answer_for_other_bytes_than_asked_is_a_clear_error(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    server.faults.shift = 4096
    with pytest.raises(FetchError, match=r"answered with bytes 4096-\d+ \(Content-Range\) to a request for bytes 0-"):
        _pull(server, demo, "10:20", tmp_path)
    assert not list(tmp_path.glob("*.gguf"))


def test_answers_shorter_than_asked_are_followed_by_requests_for_the_rest(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    server.faults.cap = 4 << 20
    pulled = _pull(server, demo, "10:20", tmp_path)
    assert filecmp.cmp(pulled.path, demo.splits["10:20"], shallow=False)
    header, tensors = _share(demo.manifest, LayerRange(10, 20))
    assert header + tensors <= server.sent <= header + tensors + SLACK
    assert len(server.requests) >= tensors // (4 << 20)


def test_a_file_changed_mid_pull_is_a_clear_error_and_the_next_pull_keeps_what_was_verified(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    server.faults.cap = 4 << 20
    server.faults.change_etag_after = 3  # the header, then two answers of the range
    with pytest.raises(FetchError, match="changed on the server during the pull"):
        _pull(server, demo, "10:20", tmp_path)
    first = server.sent
    assert not list(tmp_path.glob("*.gguf"))
    server.reset()
    server.faults.cap, server.faults.change_etag_after = 4 << 20, 0  # the new file, from the first request on
    pulled = _pull(server, demo, "10:20", tmp_path)
    assert filecmp.cmp(pulled.path, demo.splits["10:20"], shallow=False)
    header, tensors = _share(demo.manifest, LayerRange(10, 20))
    # verified tensors are kept; the bytes of the tensor the change cut through are fetched again,
    # and the answer refused for its new ETag was already in the socket when it was refused
    largest = max(t.n_bytes for t in demo.manifest.tensors if t.name.startswith("blk."))
    assert first + server.sent <= 2 * header + tensors + largest + server.faults.cap + SLACK


def test_a_dropped_connection_is_resumed_where_it_broke(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    server.faults.drop_after, server.faults.drops = 5_000_000, 3
    pulled = _pull(server, demo, "10:20", tmp_path)
    assert server.faults.drops == 0
    assert filecmp.cmp(pulled.path, demo.splits["10:20"], shallow=False)
    header, tensors = _share(demo.manifest, LayerRange(10, 20))
    assert header + tensors <= server.sent <= header + tensors + SLACK


def test_a_pull_stopped_by_a_dropped_connection_goes_on_from_there_when_run_again(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    server.faults.drop_after, server.faults.drops = 9_000_000, 1
    with pytest.raises(FetchError, match="run the same command again to go on"):
        _pull(server, demo, "10:20", tmp_path, retries=0)
    assert not list(tmp_path.glob("*.gguf")) and list(tmp_path.glob("*.fetch.json"))
    first = server.sent
    server.reset()
    pulled = _pull(server, demo, "10:20", tmp_path, retries=0)
    assert filecmp.cmp(pulled.path, demo.splits["10:20"], shallow=False)
    header, tensors = _share(demo.manifest, LayerRange(10, 20))
    assert first + server.sent <= 2 * header + tensors + SLACK  # the header twice, each tensor byte once
    assert not list(tmp_path.glob("*.fetch*"))


def _damaged_copy(served: Served, folder: Path, file: str, offset: int) -> Path:
    folder.mkdir()
    for part in served.manifest.parts:
        shutil.copyfile(served.root / part.file, folder / part.file)
    with (folder / file).open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    return folder


def test_a_damaged_byte_in_a_served_tensor_is_caught(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    (tensor,) = (t for t in demo.manifest.tensors if t.name == "blk.15.ffn_up.weight")
    root = _damaged_copy(demo, tmp_path / "served", demo.name, tensor.offset + tensor.n_bytes // 2)
    server = serve(root)
    with pytest.raises(FetchError, match=r"tensor blk\.15\.ffn_up\.weight from .* does not have the sha256"):
        _pull(server, attrs.evolve(demo, root=root), "10:20", tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.gguf"))
    # a pull that samples the tensor's ends only would pass it: the damage is in its middle
    server.reset()
    assert tensor.n_bytes > 2 * 4096


def test_a_damaged_header_is_caught_before_any_tensor_is_read(
    multi: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    data = (multi.root / multi.name).read_bytes()
    root = _damaged_copy(multi, tmp_path / "served", multi.name, data.index(b"synthetic-llama") + 3)
    server = serve(root)
    with pytest.raises(FetchError, match="is not the file the manifest of"):
        _pull(server, attrs.evolve(multi, root=root), "2:4", tmp_path / "out")
    assert server.sent == multi.manifest.parts[0].data_offset


def test_a_manifest_changed_after_signing_or_signed_by_another_key_is_refused(
    demo: Served, publisher: Identity, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    data = json.loads(demo.manifest_path.read_text())
    data["tensors"][5]["sha256"] = "0" * 64
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="does not carry a valid signature"):
        fetch.pull_layers(server.url(demo.name), LayerRange(0, 10), str(tampered), tmp_path / "out", trust_source=True)
    other = tmp_path / "other.json"
    other.write_text(demo.manifest.signed(Identity.generate()).dumps())
    with pytest.raises(ManifestError, match="not by the publisher key given"):
        fetch.pull_layers(
            server.url(demo.name), LayerRange(0, 10), str(other), tmp_path / "out", publisher=publisher.node_id
        )
    assert server.sent == 0  # refused before a byte of the model was read
    with pytest.raises(ManifestError, match="does not carry a valid signature"):
        manifest.load(tampered)


def test_weights_altered_outside_the_sampled_bytes_cannot_pass_as_the_artifact(
    demo: Served, publisher: Identity, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    """A model host serves weights altered in one byte mid-tensor, and an accomplice signs their manifest."""
    (tensor,) = (t for t in demo.manifest.tensors if t.name == "blk.15.ffn_up.weight")
    assert tensor.n_bytes > 4 * 4096  # the byte lies far from the 4 KiB at each end a sampled fingerprint read
    root = _damaged_copy(demo, tmp_path / "served", demo.name, tensor.offset + tensor.n_bytes // 2)
    accomplice = Identity.generate()
    forged = manifest.make(root / demo.name, accomplice)
    assert forged.artifact != demo.manifest.artifact == artifacts.inspect(demo.whole).fingerprint
    # the manifest of the altered weights, under the real artifact's name: its index no longer gives it
    passing = forged.model_copy(update={"artifact": demo.manifest.artifact}).signed(accomplice)
    (tmp_path / "passing.json").write_text(passing.dumps())
    (tmp_path / "forged.json").write_text(forged.dumps())
    server = serve(root)
    url = server.url(demo.name)
    with pytest.raises(ManifestError, match="do not give the manifest's artifact"):
        fetch.pull_layers(url, LayerRange(10, 20), str(tmp_path / "passing.json"), tmp_path / "a", trust_source=True)
    with pytest.raises(ManifestError, match="not by the publisher key given"):
        fetch.pull_layers(
            url, LayerRange(10, 20), str(tmp_path / "forged.json"), tmp_path / "b", publisher=publisher.node_id
        )
    # with the real manifest, the altered tensor is refused as it arrives
    with pytest.raises(FetchError, match=r"tensor blk\.15\.ffn_up\.weight from .* does not have the sha256"):
        _pull(server, attrs.evolve(demo, root=root), "10:20", tmp_path / "c")
    assert not list(tmp_path.glob("[abc]/*.gguf"))


def test_a_manifest_no_pinned_key_signs_is_refused_unless_its_source_is_trusted(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = serve(demo.root)
    url = server.url(demo.name)
    with pytest.raises(fetch.UntrustedManifestError, match=r"--publisher-key KEY .* or --trust-tracker-manifests"):
        fetch.pull_layers(url, LayerRange(10, 20), str(demo.manifest_path), tmp_path)
    with pytest.raises(fetch.UntrustedManifestError):
        fetch.header_copy(url, tmp_path, str(demo.manifest_path))
    assert server.sent == 0 and not server.requests  # refused before any request
    pulled = _pull(server, demo, "10:20", tmp_path, trust_source=True)  # the operator's word: any signature
    assert pulled.publisher == demo.manifest.publisher
    argv = ["models", "pull", url, "--layers", "10:20", "--manifest", str(demo.manifest_path), "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--publisher-key" in line and "--trust-tracker-manifests" in line, line
    assert main([*argv, "--out", str(tmp_path / "cli"), "--trust-tracker-manifests"]) == 0


def test_a_header_copy_names_the_artifact_its_manifest_gives(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    pin = bytes.fromhex(demo.manifest.publisher)
    copy = fetch.header_copy(server.url(demo.name), tmp_path, str(demo.manifest_path), publisher=pin)
    assert copy.artifact == demo.manifest.artifact
    assert copy.path.stat().st_size == demo.whole.stat().st_size
    assert server.sent == demo.manifest.parts[0].data_offset  # the header alone
    assert artifacts.inspect(copy.path, verify=False).n_layer == demo.manifest.n_layer


def _huge_header_model(folder: Path, declared: int) -> Path:
    """A sparse 1 GiB "model" whose first metadata key says it is ``declared`` bytes long."""
    folder.mkdir()
    path = folder / "huge.gguf"
    with path.open("wb") as f:
        f.write(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little"))
        f.write(declared.to_bytes(8, "little"))
        f.truncate(1 << 30)
    return path


@pytest.mark.parametrize("how", ["header copy", "pull"])
def test_a_header_declaring_a_huge_size_is_refused_before_it_is_read(
    how: str, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    path = _huge_header_model(tmp_path / "served", 512 << 20)
    server = serve(path.parent)
    tracker = "http://127.0.0.1:9"  # never asked: the header it would be found by is refused first
    with pytest.raises(fetch.HeaderTooLargeError, match="over the 64 MiB"):
        if how == "pull":
            fetch.pull_layers(server.url(path.name), LayerRange(0, 1), tracker, tmp_path, trust_source=True)
        else:
            fetch.header_copy(server.url(path.name), tmp_path, tracker, trust_source=True)
    assert server.sent <= fetch.HEADER_FIRST_READ  # the first read; nothing grown for the declared size


def test_a_manifest_declaring_a_huge_header_is_refused_before_it_is_read(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(demo.root)
    data = json.loads(demo.manifest_path.read_text())
    data["parts"][0]["data_offset"] = 1 << 40
    data["parts"][0]["size"] = 1 << 41
    for tensor in data["tensors"]:
        tensor["offset"] += 1 << 40
    huge = Manifest.model_validate(data).signed(Identity.generate())
    (tmp_path / "huge.json").write_text(huge.dumps())
    with pytest.raises(fetch.HeaderTooLargeError):
        fetch.pull_layers(
            server.url(demo.name), LayerRange(10, 20), str(tmp_path / "huge.json"), tmp_path, trust_source=True
        )
    assert server.sent == 0


def test_the_commands_make_a_manifest_and_pull_a_range_with_it(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = serve(demo.root)
    key, made = tmp_path / "publisher.key", tmp_path / "m.json"
    assert main(["models", "manifest", str(demo.whole), "--key", str(key), "--out", str(made), "--quiet"]) == 0
    signed = manifest.load(made, manifest.load_key(key).node_id)
    assert signed.artifact == demo.manifest.artifact
    capsys.readouterr()
    url = server.url(demo.name)
    argv = ["models", "pull", url, "--layers", "20:30", "--manifest", str(made), "--out", str(tmp_path / "shards")]
    assert main([*argv, "--publisher-key", signed.publisher, "--quiet"]) == 0
    shown = capsys.readouterr().out.split()
    assert filecmp.cmp(shown[0], demo.splits["20:30"], shallow=False)
    for args, message in (
        (["models", "pull", url, "--layers", "0:10"], "signed manifest"),
        (["models", "pull", url, "--manifest", str(made)], "--layers"),
        (["models", "pull", url, "--layers", "0:40", "--manifest", str(made), "--trust-tracker-manifests"], "outside"),
        (["models", "pull", "smollm2-135m", "--layers", "0:10"], "a URL"),
        (["up", "--model", url, "--listen", "127.0.0.1:0", "--issuer-key", "00" * 32], "--layers"),
        (["up", "--model", url, "--layers", "0:10", "--listen", "127.0.0.1:0", "--issuer-key", "00" * 32], "manifest"),
    ):
        where = (
            ["--data-dir", str(tmp_path / "node")]
            if args[0] == "up"
            else ["--out", str(tmp_path / "refused"), "--quiet"]
        )
        assert main([*args, *where]) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("noderuntime: error:") and message in line, line


async def test_a_tracker_serves_its_manifests_and_a_pull_finds_the_one_of_its_file(
    demo: Served, multi: Served, publisher: Identity, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    server = serve(multi.root)
    tracker = Tracker(Identity.generate(), manifests=[demo.manifest, multi.manifest])
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, tracker.app, "127.0.0.1:0")
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{url}/v1/manifests/{demo.manifest.artifact}")
            assert Manifest.loads(answer.content).check(publisher.node_id) == demo.manifest
            assert (await client.get(f"{url}/v1/manifests/{'0' * 64}")).status_code == 404
        pulled = await trio.to_thread.run_sync(
            lambda: fetch.pull_layers(
                server.url(multi.name), LayerRange(2, 4), url, tmp_path, publisher=publisher.node_id
            )
        )
        nursery.cancel_scope.cancel()
    assert pulled.artifact == multi.manifest.artifact
    assert filecmp.cmp(pulled.path, multi.splits["2:4"], shallow=False)


def _registered_node(demo: Served, tmp_path: Path, node_args: list[str]) -> dict[str, Any]:
    """Start a tracker serving ``demo``'s manifest and ``noderuntime *node_args`` with it: what it registered.

    The node is given the tracker and the manifest's publisher; both stop before this returns.
    """
    tracker = ManagedProcess(
        "tracker",
        local_tracker_args(tmp_path / "t", "--manifest", str(demo.manifest_path)),
    )
    node = ManagedProcess("node", node_args)
    try:
        url = ready.expect(tracker.start(), ready.TrackerReady).url
        node.argv += ["--tracker", url, "--publisher-key", demo.manifest.publisher]
        node_id = ready.expect(node.start(), ready.NodeReady).node_id
        with urllib.request.urlopen(f"{url}/v1/nodes", timeout=10) as answer:
            (registered,) = (n for n in json.load(answer)["nodes"] if n["node_id"] == node_id)
    finally:
        node.stop()
        tracker.stop()
    registration: dict[str, Any] = registered
    return registration


def test_a_node_started_on_a_url_serves_the_range_it_fetched(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    """``up --model URL --layers`` pulls its range (the manifest from its tracker) and registers the artifact."""
    server = serve(demo.root)
    registered = _registered_node(
        demo,
        tmp_path,
        [
            *("up", "--model", server.url(demo.name), "--layers", "20:30", "--listen", "127.0.0.1:0"),
            *("--data-dir", str(tmp_path / "node"), "--threads", "1", "--slots", "1", "--ctx", "256"),
        ],
    )
    assert registered["artifact"] == demo.manifest.artifact and registered["layers"] == [20, 30]
    (shard,) = (tmp_path / "node" / "shards").glob("*.gguf")
    assert filecmp.cmp(shard, demo.splits["20:30"], shallow=False)
    header, tensors = _share(demo.manifest, LayerRange(20, 30))
    assert server.sent <= 2 * header + tensors + SLACK  # the header read while finding the manifest


def test_a_node_on_a_url_without_layers_is_placed_by_its_tracker_and_fetches_that_range_alone(
    demo: Served, serve: Callable[[Path], RangeServer], tmp_path: Path
) -> None:
    """``up --model URL --tracker`` sizes its shard from the header alone, asks where, and pulls only that range."""
    from noderuntime.engine import memplan
    from noderuntime.services import joining, noderun

    sizing = noderun.NodeOptions(
        demo.whole, None, None, tmp_path, (), threads=1, slots=1, ctx_per_session=256, memory_limit=1
    )
    recipe = noderun.node_recipe(sizing)
    limit = memplan.needs(demo.whole, LayerRange(22, 30), recipe).host
    # the last layers (with the output's compute) weigh more than the first: the last 8 bound it
    held = joining.holdable(demo.whole, recipe, memplan.Budget(host=limit))
    assert held == 8
    server = serve(demo.root)
    registered = _registered_node(
        demo,
        tmp_path,
        [
            *("up", "--model", server.url(demo.name), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "node")),
            *("--threads", "1", "--slots", "1", "--ctx", "256", "--memory-limit", str(limit)),
        ],
    )
    # the first node of a swarm starts the chain at layer 0
    assert registered["artifact"] == demo.manifest.artifact and registered["layers"] == [0, held]
    (shard,) = (tmp_path / "node" / "shards").glob("*.gguf")
    assert artifacts.inspect(shard).layer_range == LayerRange(0, held)
    header, tensors = _share(demo.manifest, LayerRange(0, held))
    # the header read three times: sized, matched to its manifest, and read for the pull
    assert server.sent <= 3 * header + tensors + SLACK
    assert server.sent < demo.whole.stat().st_size - 30 * (1 << 20)  # not the other 22 layers
