"""A Hugging Face Hub model id, as `vllm serve ORG/NAME` takes it: a branch asked of the Hub and downloaded into the
HF cache (only the files Sluice reads), the cached copy served (as vLLM or transformers left it there) where the Hub
cannot be asked, a commit there with no network; at --revision, in --download-dir; `ORG/NAME-GGUF:QUANT`, the one GGUF
file of that quant type; and each way neither the Hub nor the cache can give one, said in one line. A PEFT adapter's
repository, as `--lora-modules NAME=ORG/NAME` names it (`download_adapter`), by the same rules. The Hub is a fake
one on localhost (`FakeHub`). Most tests run `sluice fetch` in this process, huggingface_hub's settings patched as its
environment variables would set them (`hf_hub_here`); two run it as a command, for its exit code and no traceback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from golden_checks import (assert_completion_gives_case, copy_with_tokenizer, golden_engine, golden_params,
                           home)  # noqa: F401 (home: a fixture)
from hf_folder import write_hf_folder
from sluice.model.config import ModelConfig
from sluice.model.fetch import ModelNotFound, from_hub, resolve_model
from sluice.model.hub import HubError, choose_gguf, download_adapter, is_hub_id
from sluice.model.loader import load_model
from sluice.model.lora import CONFIG_FILE, WEIGHTS_FILE, load_adapter

SLUICE = [sys.executable, "-m", "sluice.app.cli"]
DATA = Path(__file__).parent / "data"
MAIN_COMMIT = "1" * 40
V2_COMMIT = "2" * 40
CONFIG = ModelConfig.tiny(vocab_size=300)
V2_CONFIG = ModelConfig.tiny(vocab_size=300, num_layers=3)
# What a Hub repository of a model holds besides the files Sluice reads.
UNREAD = {"README.md": b"# a model card", "pytorch_model.bin": b"pickled weights", ".gitattributes": b"*.bin lfs"}
# A PEFT adapter's files that model/lora.py reads (their bytes are not read here), and what a PEFT training run pushes
# besides them: the same adapter pickled, its checkpoints' folders.
ADAPTER = {CONFIG_FILE: b'{"peft_type": "LORA"}', WEIGHTS_FILE: b"safetensors"}
ADAPTER_UNREAD = {**UNREAD, "adapter_model.bin": b"pickled adapter", "training_args.bin": b"pickled arguments",
                  f"checkpoint-500/{CONFIG_FILE}": b"{}", f"checkpoint-500/{WEIGHTS_FILE}": b"safetensors 500"}


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = MAIN_COMMIT
    token: str | None = None  # a gated repository's: the one token it lets in


@dataclass
class FakeHub:
    """The Hub's endpoints huggingface_hub calls (a repository's info and file tree at a revision, a file's
    metadata and bytes), answering for `repos`, with the Hub's error codes; each request's method and path kept."""

    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    url: str = ""


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(f"{self.command} {path}")
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        if api and len(parts) == 2:  # a repository's information at its default branch
            parts += ["revision", "main"]
        if len(parts) < 4 or path.startswith("/api/") and not api:  # as huggingface_hub 2.4's /api/agent-harnesses
            return self._error(404, "NotFound", body)
        repo_id, kind, revision, file = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", body)
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(401, "GatedRepo", body)
        if revision not in ("main", repo.commit):
            return self._error(404, "RevisionNotFound", body)
        if api and kind == "revision":
            return self._send(json.dumps({"id": repo_id, "sha": repo.commit,
                                          "siblings": [{"rfilename": name} for name in repo.files]}).encode(), body)
        if api and kind == "tree":
            return self._send(json.dumps([{"type": "file", "path": name, "size": len(data),
                                           "oid": hashlib.sha1(data).hexdigest()}
                                          for name, data in repo.files.items()]).encode(), body)
        if kind == "resolve" and file in repo.files:
            return self._send(repo.files[file], body, {"X-Repo-Commit": repo.commit,
                                                       "ETag": f'"{hashlib.sha256(repo.files[file]).hexdigest()}"'})
        return self._error(404, "EntryNotFound", body)

    def _send(self, data: bytes, body: bool, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        for name, value in {"Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, body: bool) -> None:
        data = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


CLOSED = "http://127.0.0.1:9"  # an endpoint nothing answers at: the Hub unreachable


def point_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """huggingface_hub in this process talking to the Hub at `url` (as HF_ENDPOINT sets it in a new process)."""
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture(autouse=True)
def hf_hub_here(tmp_path, monkeypatch):
    """huggingface_hub in this process as in a clean environment, whatever the developer's: online, at an endpoint
    nothing answers at (`hub` points it at a FakeHub), no token, its cache and token file under tmp_path/hf."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    point_at(monkeypatch, CLOSED)


@pytest.fixture
def hub(monkeypatch):
    """A FakeHub serving on localhost, holding no repository until a test adds it; huggingface_hub in this process
    talks to it."""
    fake = FakeHub()
    handler = type("Handler", (_Handler,), {"hub": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    point_at(monkeypatch, fake.url)
    yield fake
    server.shutdown()
    server.server_close()


def model_files(folder: Path, config: ModelConfig, seed: int = 0) -> dict[str, bytes]:
    """The files of a tiny HF model (`write_hf_folder`), by name."""
    write_hf_folder(folder, config, seed=seed)
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def write_cached_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], commit: str,
                          refs: tuple[str, ...] = ("main",)) -> Path:
    """`files` as huggingface_hub's cache holds a download of `repo_id` at `commit` (its documented layout): each
    file's bytes once in blobs/, linked from snapshots/COMMIT/NAME, and refs/REF holding the commit."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cached(tmp_path):
    """An HF cache holding `org/tiny` at two commits, `main` and the tag `v2` (a model with one more layer), as an
    earlier download left it."""
    cache = tmp_path / "hf" / "hub"
    write_cached_snapshot(cache, "org/tiny", model_files(tmp_path / "main", CONFIG), MAIN_COMMIT)
    write_cached_snapshot(cache, "org/tiny", model_files(tmp_path / "v2", V2_CONFIG, seed=1), V2_COMMIT, ("v2",))
    return cache


def fetch(capsys: pytest.CaptureFixture, *args: str) -> Path:
    """The path `sluice fetch ARGS`, run in this process, prints."""
    from sluice.app.cli import main

    capsys.readouterr()
    code = main(["fetch", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return Path(out.strip())


def fetch_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """The one error line `sluice fetch ARGS`, run in this process, fails with (exit 2)."""
    from sluice.app.cli import main

    capsys.readouterr()  # what came before, as a test's own downloads' progress
    code = main(["fetch", *args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1, err
    return errors[0]


def downloads(requests: list[str]) -> list[str]:
    """The requests of `requests` that download a file (the branch's commit asked again is no download)."""
    return [request for request in requests if request.startswith("GET") and "/resolve/" in request]


def run_sluice(*args: str, hf_home: Path, hub: FakeHub | None = None, **env: str) -> subprocess.CompletedProcess:
    """`sluice ARGS` in a new process, its huggingface_hub as in a clean environment whatever the developer's (no HF_
    variable, token or offline switch of theirs), its HF home `hf_home`, talking to `hub` if given, with `env`."""
    clean = {name: value for name, value in os.environ.items()
             if not name.startswith(("HF_", "HUGGING_FACE_")) and name != "TRANSFORMERS_OFFLINE"}
    endpoint = {"HF_ENDPOINT": hub.url} if hub is not None else {}
    return subprocess.run([*SLUICE, *args], capture_output=True, text=True, timeout=300,
                          env={**clean, "HF_HOME": str(hf_home), **endpoint, **env})


def the_error(result: subprocess.CompletedProcess) -> str:
    """The one error line of a command that failed as input refused fails (exit 2)."""
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def test_a_cached_hub_model_loads_by_its_id_at_a_revision_with_no_network(cached, tmp_path, monkeypatch):
    """Served under the id as given, as vLLM serves it, not the name of its snapshot's folder (a commit)."""
    from sluice.model.loader import load_model

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    loaded = load_model("org/tiny", dtype="float32", revision="v2", download_dir=str(cached))
    assert (loaded.name, loaded.config.num_layers) == ("org/tiny", V2_CONFIG.num_layers)


def test_a_conversion_of_another_commit_of_the_same_repository_replaces_the_earlier_one(cached, tmp_path,
                                                                                         monkeypatch):
    """Each commit is a snapshot folder of its own: the conversion of a branch's earlier commit was kept for ever, as
    large as the model."""
    from sluice.model.loader import load_model

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    load_model("org/tiny", dtype="float32", revision=MAIN_COMMIT, download_dir=str(cached))
    load_model("org/tiny", dtype="float32", revision=V2_COMMIT, download_dir=str(cached))
    kept = list((tmp_path / "home" / "checkpoints").iterdir())
    assert len(kept) == 1 and (kept[0] / "config.json").read_text().count('"num_layers": 3')
    assert kept[0].name.startswith("org--tiny-")  # the repository's name, not the commit's


def test_generate_serves_a_model_in_the_hf_cache_where_the_hub_cannot_be_reached(cached, tmp_path, capsys,
                                                                                   monkeypatch):
    """Online, as a model is served where the network is down: huggingface_hub falls back to its cache (`cached`,
    huggingface_hub's own here)."""
    from sluice.app.cli import main

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    assert main(["generate", "the quick", "--model", "org/tiny", "--max-tokens", "2"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("revision", "commit"), [(None, MAIN_COMMIT), ("v2", V2_COMMIT), (V2_COMMIT, V2_COMMIT)])
def test_fetch_finds_the_revision_asked_for_in_the_download_dir(cached, capsys, revision, commit):
    revision_args = ["--revision", revision] if revision else []
    path = fetch(capsys, "--model", "org/tiny", "--download-dir", str(cached), *revision_args)
    assert path == cached / "models--org--tiny" / "snapshots" / commit


def test_a_cached_commit_is_served_without_asking_the_hub(cached, hub, capsys):
    """A commit's files never change: the cache's copy needs no word from the Hub."""
    path = fetch(capsys, "--model", "org/tiny", "--revision", V2_COMMIT, "--download-dir", str(cached))
    assert path == cached / "models--org--tiny" / "snapshots" / V2_COMMIT
    assert hub.requests == []


NEW_COMMIT = "3" * 40


def test_a_branch_is_asked_of_the_hub_and_its_new_commit_downloaded(cached, hub, capsys):
    """As vLLM's snapshot_download: the cache's refs/main is not taken for the branch while the Hub can be asked."""
    hub.repos["org/tiny"] = FakeRepo(model_files(cached.parent / "new", V2_CONFIG, seed=1), commit=NEW_COMMIT)
    assert fetch(capsys, "--model", "org/tiny", "--download-dir", str(cached)) == (
        cached / "models--org--tiny" / "snapshots" / NEW_COMMIT)


def test_a_partial_snapshot_an_older_huggingface_hub_left_is_completed(hub, tmp_path, capsys):
    """A snapshot with no listing of its commit's files (huggingface_hub before 1.x wrote none) that lacks the
    tokenizer: downloaded again, not served as it is."""
    files = model_files(tmp_path / "model", CONFIG)
    partial = {name: data for name, data in files.items() if name.endswith((".json", ".safetensors"))
               and not name.startswith("tokenizer")}
    snapshot = write_cached_snapshot(tmp_path / "cache", "org/tiny", partial, MAIN_COMMIT)
    hub.repos["org/tiny"] = FakeRepo(files)
    assert fetch(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache")) == snapshot
    assert sorted(path.name for path in snapshot.iterdir()) == sorted(files)


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "unreachable"])
@pytest.mark.parametrize("model", ["org/tiny", "org/Tiny-GGUF:Q8_0"])
def test_a_cached_model_is_served_where_the_hub_cannot_be_asked(tmp_path, capsys, monkeypatch, offline, model):
    """HF_HUB_OFFLINE, or an endpoint that does not answer (huggingface_hub's fallback to its cache)."""
    cache = tmp_path / "cache"
    write_cached_snapshot(cache, "org/tiny", model_files(tmp_path / "model", CONFIG), MAIN_COMMIT)
    gguf = write_cached_snapshot(cache, "org/Tiny-GGUF", {"Tiny-Q8_0.gguf": b"GGUF"}, MAIN_COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    folder = cache / "models--org--tiny" / "snapshots" / MAIN_COMMIT
    expected = gguf / "Tiny-Q8_0.gguf" if model.endswith("Q8_0") else folder
    assert fetch(capsys, "--model", model, "--download-dir", str(cache)) == expected


def test_a_gguf_repository_is_asked_for_its_branch(hub, tmp_path, capsys):
    cache = tmp_path / "cache"
    write_cached_snapshot(cache, "org/Tiny-GGUF", {"Tiny-Q8_0.gguf": b"GGUF old"}, MAIN_COMMIT)
    hub.repos["org/Tiny-GGUF"] = FakeRepo({"Tiny-Q8_0.gguf": b"GGUF new"}, commit=NEW_COMMIT)
    assert fetch(capsys, "--model", "org/Tiny-GGUF:Q8_0", "--download-dir", str(cache)).read_bytes() == b"GGUF new"


def test_a_hub_model_downloads_the_files_sluice_reads_into_the_cache_once(hub, tmp_path, capsys):
    files = model_files(tmp_path / "model", CONFIG)
    hub.repos["org/tiny"] = FakeRepo({**files, **UNREAD})
    snapshot = fetch(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache"))
    assert snapshot == tmp_path / "cache" / "models--org--tiny" / "snapshots" / MAIN_COMMIT
    assert sorted(path.name for path in snapshot.iterdir()) == sorted(files)
    asked = len(hub.requests)
    again = fetch(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache"))
    assert again == snapshot and downloads(hub.requests[asked:]) == []


def test_sub_folders_and_mistral_consolidated_weights_are_not_downloaded(hub, tmp_path, capsys, monkeypatch):
    """Sluice reads the top folder's files its index names (model/weights.py): not Meta's original/ checkpoint nor
    Mistral's consolidated.safetensors, the same weights again."""
    files = model_files(tmp_path / "model", CONFIG)
    hub.repos["org/tiny"] = FakeRepo({**files, "original/model.safetensors": b"weights", "original/config.json": b"{}",
                                      "consolidated.safetensors": b"weights"})
    snapshot = fetch(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache"))
    assert sorted(str(path.relative_to(snapshot)) for path in snapshot.rglob("*")) == sorted(files)
    assert sorted(downloads(hub.requests)) == sorted(f"GET /org/tiny/resolve/{MAIN_COMMIT}/{name}" for name in files)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the cache's listing names them: still complete
    assert fetch(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache")) == snapshot


def test_a_gguf_repository_gives_the_one_file_of_the_quant_type_named(hub, tmp_path, capsys):
    """vLLM's `ORG/NAME-GGUF:QUANT`: only that file is downloaded, not the repository's other quantizations."""
    ggufs = {f"Tiny-{quant}.gguf": f"GGUF {quant}".encode() for quant in ("Q4_K_M", "Q8_0", "F16")}
    hub.repos["org/Tiny-GGUF"] = FakeRepo({**ggufs, "mmproj-F16.gguf": b"GGUF projector", **UNREAD})
    path = fetch(capsys, "--model", "org/Tiny-GGUF:Q8_0", "--download-dir", str(tmp_path / "cache"))
    assert path.name == "Tiny-Q8_0.gguf" and path.read_bytes() == b"GGUF Q8_0"
    assert sorted(p.name for p in path.parent.iterdir()) == ["Tiny-Q8_0.gguf"]
    asked = len(hub.requests)
    again = fetch(capsys, "--model", "org/Tiny-GGUF:Q8_0", "--download-dir", str(tmp_path / "cache"))
    assert again == path and downloads(hub.requests[asked:]) == []


def test_a_cached_gguf_is_served_offline_where_the_cache_lists_files_it_lacks(hub, tmp_path, capsys, monkeypatch):
    """A snapshot_download of the one file (as `hf download` leaves it) keeps the listing of the repository's files:
    the quant type's split parts and other quant types, which the cache lacks, do not hide the file that is there."""
    from huggingface_hub import snapshot_download

    hub.repos["org/Tiny-GGUF"] = FakeRepo({"Tiny-Q4_K_M.gguf": b"GGUF", "Tiny-Q8_0.gguf": b"GGUF Q8_0",
                                           "big/Tiny-Q4_K_M-00001-of-00002.gguf": b"GGUF 1",
                                           "big/Tiny-Q4_K_M-00002-of-00002.gguf": b"GGUF 2"})
    snapshot = Path(snapshot_download("org/Tiny-GGUF", cache_dir=tmp_path / "cache",
                                      allow_patterns=["Tiny-Q4_K_M.gguf"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = fetch(capsys, "--model", "org/Tiny-GGUF:Q4_K_M", "--download-dir", str(tmp_path / "cache"))
    assert path == snapshot / "Tiny-Q4_K_M.gguf"


@pytest.mark.parametrize(("names", "words"), [
    (["Tiny-Q8_0.gguf"], "no GGUF file of quant type Q4_K_M (its GGUF files are Tiny-Q8_0.gguf)"),
    (["README.md"], "no GGUF file of quant type Q4_K_M (it holds no GGUF file)"),
    (["a/Tiny-Q4_K_M.gguf", "b/Tiny-Q4_K_M.gguf"], "2 GGUF files are Q4_K_M (a/Tiny-Q4_K_M.gguf, b/Tiny-Q4_K_M.gguf)"),
    (["Tiny-Q4_K_M-00001-of-00002.gguf", "Tiny-Q4_K_M-00002-of-00002.gguf"], "the Q4_K_M model is split over files"),
])
def test_a_quant_type_that_names_no_single_gguf_file_is_refused(names, words):
    with pytest.raises(HubError, match=words.replace("(", r"\(").replace(")", r"\)")):
        choose_gguf("org/Tiny-GGUF:Q4_K_M", names, "Q4_K_M")


@pytest.mark.parametrize("quant_type", ["Q4_K_M", "q4_k_m"])
def test_a_quant_type_names_its_file_in_either_case(hub, tmp_path, capsys, monkeypatch, quant_type):
    """Qwen's GGUF repositories name their files in lower case, most others in upper case."""
    hub.repos["Qwen/Tiny-GGUF"] = FakeRepo({"tiny-q4_k_m.gguf": b"GGUF q4_k_m", "tiny-q8_0.gguf": b"GGUF q8_0"})
    path = fetch(capsys, "--model", f"Qwen/Tiny-GGUF:{quant_type}", "--download-dir", str(tmp_path / "cache"))
    assert path.name == "tiny-q4_k_m.gguf"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert fetch(capsys, "--model", f"Qwen/Tiny-GGUF:{quant_type}", "--download-dir", str(tmp_path / "cache")) == path
    assert choose_gguf("org/Tiny-GGUF:q4_k_m", ["Tiny-Q4_K_M.gguf", "ud/Tiny-UD-Q4_K_M.gguf"], "ud-q4_k_m") == (
        "ud/Tiny-UD-Q4_K_M.gguf")


def test_a_single_file_is_chosen_over_a_split_one_and_a_projector():
    names = ["Tiny-Q4_K_M.gguf", "big/Tiny-Q4_K_M-00001-of-00002.gguf", "mmproj-Q4_K_M.gguf"]
    assert choose_gguf("org/Tiny-GGUF:Q4_K_M", names, "Q4_K_M") == "Tiny-Q4_K_M.gguf"


def test_a_gated_repository_downloads_with_hf_token(hub, tmp_path, capsys, monkeypatch):
    hub.repos["org/gated"] = FakeRepo(model_files(tmp_path / "model", CONFIG), token="hf_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert fetch(capsys, "--model", "org/gated", "--download-dir", str(tmp_path / "cache")).is_dir()


@pytest.mark.parametrize(("model", "hub_is", "words"), [
    ("org/missing", "up", "no model org/missing on the Hugging Face Hub (a private one needs HF_TOKEN"),
    ("org/gated", "up", "org/gated is gated on the Hugging Face Hub: accept its terms on its page, and set HF_TOKEN"),
    ("org/bin", "up", "org/bin holds no config.json with *.safetensors: Sluice reads safetensors or GGUF"),
    ("org/tiny", "offline", "org/tiny is not in the HF cache ({cache}) and HF_HUB_OFFLINE is set"),
    ("org/tiny", "unreachable",
     f"cannot reach the Hugging Face Hub ({CLOSED}) for org/tiny, which is not in the HF cache ({{cache}})"),
    ("org/Tiny-GGUF:Q4_K_M", "up", "org/Tiny-GGUF:Q4_K_M: no GGUF file of quant type Q4_K_M"),
    ("org/Tiny-GGUF:Q9_Z", "up", "org/Tiny-GGUF:Q9_Z: 'Q9_Z' is not a GGUF quant type"),
    ("org/a--b", "up", "org/a--b is not a Hugging Face Hub model id: Cannot have -- or .. in repo_id: 'org/a--b'."),
])
def test_what_the_hub_cannot_give_is_a_one_line_error_naming_the_id(hub, tmp_path, capsys, monkeypatch, model,
                                                                    hub_is, words):
    files = model_files(tmp_path / "model", CONFIG)
    hub.repos["org/gated"] = FakeRepo(files, token="hf_secret")
    hub.repos["org/bin"] = FakeRepo({"config.json": files["config.json"], **UNREAD})
    hub.repos["org/tiny"] = FakeRepo(files)
    hub.repos["org/Tiny-GGUF"] = FakeRepo({"Tiny-Q8_0.gguf": b"GGUF"})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", hub_is == "offline")
    if hub_is == "unreachable":
        point_at(monkeypatch, CLOSED)
    cache = tmp_path / "cache"
    error = fetch_error(capsys, "--model", model, "--download-dir", str(cache))
    assert error.startswith(f"sluice: error: {words.replace('{cache}', str(cache))}")


def test_a_hub_error_is_one_line_and_exit_status_2_of_the_command(tmp_path):
    """HF_HOME and HF_ENDPOINT as a new process reads them; no traceback."""
    result = run_sluice("fetch", "--model", "org/tiny", hf_home=tmp_path / "hf", HF_ENDPOINT=CLOSED)
    assert the_error(result) == (f"sluice: error: cannot reach the Hugging Face Hub ({CLOSED}) for org/tiny, which "
                                 f"is not in the HF cache ({tmp_path / 'hf' / 'hub'}): check the network")


@pytest.mark.parametrize("error", [
    RuntimeError("Data processing error: CAS service error : Reqwest Error: HTTP status client error (401)\nmore"),
    ValueError("Fast download using 'hf_xet' is enabled but 'hf_xet' is not installed\npip install hf_xet"),
])
def test_any_other_error_of_a_download_is_a_one_line_error(tmp_path, capsys, monkeypatch, error):
    """hf_xet's errors, and huggingface_hub's own for a missing hf_xet, end in no traceback."""
    import huggingface_hub

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    first_line = str(error).splitlines()[0]
    assert fetch_error(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache")) == (
        f"sluice: error: cannot download org/tiny: {type(error).__name__}: {first_line}")


def test_a_relative_path_that_is_not_there_is_refused_as_either_reading(hub, tmp_path, capsys, monkeypatch):
    """`models/foo` reads as a Hub id and as a path, as vLLM's message offers both."""
    monkeypatch.chdir(tmp_path)
    assert fetch_error(capsys, "--model", "models/foo", "--download-dir", str(tmp_path / "cache")).endswith(
        "on the Hugging Face Hub (a private one needs HF_TOKEN set to a token with access to it), nor a file or "
        "folder models/foo here")


def test_a_revision_written_into_the_id_points_to_the_revision_flag(tmp_path, capsys):
    assert fetch_error(capsys, "--model", "org/tiny@v2", "--download-dir", str(tmp_path / "cache")) == (
        "sluice: error: no file or folder 'org/tiny@v2' here, nor a Hub model id: a Hub model's revision is "
        "given apart, as org/tiny --revision v2")


@pytest.mark.parametrize(("offline", "reason"), [
    (True, "HF_HUB_OFFLINE is set: unset it to complete the download"),
    (False, f"the Hugging Face Hub ({CLOSED}) could not complete it (ConnectError): check the network"),
])
def test_an_incomplete_cached_copy_is_said_to_be_incomplete(hub, tmp_path, capsys, monkeypatch, offline, reason):
    """Not "not in the HF cache": the cache's listing of the commit (a download cut short) names files it lacks."""
    from huggingface_hub import snapshot_download

    hub.repos["org/tiny"] = FakeRepo(model_files(tmp_path / "model", CONFIG))
    snapshot = snapshot_download("org/tiny", cache_dir=tmp_path / "cache", allow_patterns=["config.json"])
    point_at(monkeypatch, CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    assert fetch_error(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache")) == (
        f"sluice: error: the HF cache's copy of org/tiny ({snapshot}) is incomplete and {reason}")


def test_a_cached_copy_without_weights_is_said_to_be_incomplete_offline(tmp_path, capsys, monkeypatch):
    """A snapshot with no listing of its commit's files, where only the weights tell it is incomplete."""
    files = model_files(tmp_path / "model", CONFIG)
    snapshot = write_cached_snapshot(tmp_path / "cache", "org/tiny", {"config.json": files["config.json"]}, MAIN_COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert fetch_error(capsys, "--model", "org/tiny", "--download-dir", str(tmp_path / "cache")) == (
        f"sluice: error: the HF cache's copy of org/tiny ({snapshot}) is incomplete and HF_HUB_OFFLINE is set: unset "
        f"it to complete the download (it holds no config.json with *.safetensors)")


def test_a_revision_the_repository_lacks_is_a_one_line_error(hub, tmp_path, capsys):
    hub.repos["org/tiny"] = FakeRepo(model_files(tmp_path / "model", CONFIG))
    error = fetch_error(capsys, "--model", "org/tiny", "--revision", "nope", "--download-dir", str(tmp_path / "c"))
    assert error == "sluice: error: org/tiny has no revision 'nope' on the Hugging Face Hub"


def test_serve_refuses_a_hub_id_the_hub_cannot_give_before_anything_starts(hub, tmp_path):
    result = run_sluice("serve", "org/missing", hf_home=tmp_path / "hf", hub=hub)
    assert the_error(result).startswith("sluice serve: error: no model org/missing on the Hugging Face Hub")


def test_serve_passes_revision_and_download_dir_to_the_engine():
    from sluice.app import serve
    from sluice.app.cli import build_parser

    args = build_parser().parse_args(["serve", "org/tiny", "--revision", "v2", "--download-dir", "/models"])
    config = serve.checked_engine_config(args, serve.ENGINE_TUNING_FLAGS)
    assert (config.model, config.revision, config.download_dir) == ("org/tiny", "v2", "/models")


def test_a_replica_on_a_joined_cluster_gets_the_hub_variables():
    """As vLLM forwards HF_ and HUGGING_FACE_ variables to its Ray workers; TRANSFORMERS_OFFLINE is huggingface_hub's
    offline switch too."""
    pytest.importorskip("ray")
    from sluice.app.ray_cluster import engine_environment

    hub_variables = {"HF_TOKEN": "hf_secret", "HUGGING_FACE_HUB_TOKEN": "hf_old", "TRANSFORMERS_OFFLINE": "1"}
    assert engine_environment({**hub_variables, "HOME": "/root"}) == hub_variables


def test_a_local_folder_named_like_a_hub_id_is_the_folder(tmp_path, monkeypatch):
    """As vLLM's: a path that is there is read, not looked up on the Hub."""
    monkeypatch.chdir(tmp_path)
    write_hf_folder(tmp_path / "org" / "tiny", CONFIG, seed=0)
    assert resolve_model("org/tiny") == Path("org/tiny")


def test_the_engine_imports_without_gguf_or_huggingface_hub():
    """The GPU image has neither: a Hub id's heavy parts are imported only when one is resolved."""
    block = "import sys; sys.modules['gguf'] = sys.modules['huggingface_hub'] = None; "
    check = ("import sluice.batching.engine, sluice.bench.engine_check, sluice.bench.step_audit; "
             "from sluice.model.fetch import from_hub; print(from_hub('org/tiny'))")
    result = subprocess.run([sys.executable, "-c", block + check], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True"], result.stderr


def test_a_path_that_is_not_there_and_no_hub_id_is_not_looked_up(tmp_path):
    with pytest.raises(ModelNotFound, match="not found: pass a .gguf file"):
        resolve_model(str(tmp_path / "no" / "such" / "model"))


def test_an_adapter_repository_downloads_only_the_adapter_files(hub, tmp_path):
    """As vLLM's `--lora-modules sql=org/sql-lora`: not the README, the pickled copy, nor the checkpoints' folders."""
    hub.repos["org/sql-lora"] = FakeRepo({**ADAPTER, **ADAPTER_UNREAD})
    snapshot = download_adapter("org/sql-lora", str(tmp_path / "cache"))
    assert snapshot == tmp_path / "cache" / "models--org--sql-lora" / "snapshots" / MAIN_COMMIT
    assert {str(path.relative_to(snapshot)): path.read_bytes() for path in snapshot.rglob("*")} == ADAPTER
    assert sorted(downloads(hub.requests)) == sorted(f"GET /org/sql-lora/resolve/{MAIN_COMMIT}/{name}"
                                                     for name in ADAPTER)


def test_an_adapter_branch_is_asked_of_the_hub_and_its_new_commit_downloaded(hub, tmp_path):
    cache = tmp_path / "cache"
    write_cached_snapshot(cache, "org/sql-lora", ADAPTER, MAIN_COMMIT)
    hub.repos["org/sql-lora"] = FakeRepo({**ADAPTER, WEIGHTS_FILE: b"safetensors new"}, commit=NEW_COMMIT)
    assert (download_adapter("org/sql-lora", str(cache)) / WEIGHTS_FILE).read_bytes() == b"safetensors new"


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "unreachable"])
def test_a_cached_adapter_is_served_where_the_hub_cannot_be_asked(tmp_path, monkeypatch, offline):
    snapshot = write_cached_snapshot(tmp_path / "cache", "org/sql-lora", ADAPTER, MAIN_COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    assert download_adapter("org/sql-lora", str(tmp_path / "cache")) == snapshot


def test_an_adapter_is_downloaded_into_the_hf_cache_of_the_environment_by_default(hub, tmp_path):
    hub.repos["org/sql-lora"] = FakeRepo(ADAPTER)
    cache = Path(constants.HF_HUB_CACHE)
    assert download_adapter("org/sql-lora") == cache / "models--org--sql-lora" / "snapshots" / MAIN_COMMIT


def adapter_error(repo_id: str, download_dir: Path) -> str:
    """The message of the HubError `download_adapter` raises, which is one line."""
    with pytest.raises(HubError) as raised:
        download_adapter(repo_id, str(download_dir))
    assert "\n" not in str(raised.value)
    return str(raised.value)


@pytest.mark.parametrize(("hub_is", "words"), [
    ("offline", "org/sql-lora is not in the HF cache ({cache}) and HF_HUB_OFFLINE is set: unset it"),
    ("unreachable",
     f"cannot reach the Hugging Face Hub ({CLOSED}) for org/sql-lora, which is not in the HF cache ({{cache}})"),
])
def test_an_adapter_in_no_cache_where_the_hub_cannot_be_asked_is_a_one_line_error(tmp_path, monkeypatch, hub_is,
                                                                                   words):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", hub_is == "offline")
    cache = tmp_path / "cache"
    assert adapter_error("org/sql-lora", cache).startswith(words.replace("{cache}", str(cache)))


def test_a_cached_adapter_without_its_weights_is_said_to_be_incomplete_offline(tmp_path, monkeypatch):
    """A snapshot with no listing of its commit's files, where only the files there tell it is incomplete."""
    snapshot = write_cached_snapshot(tmp_path / "cache", "org/sql-lora", {CONFIG_FILE: ADAPTER[CONFIG_FILE]},
                                     MAIN_COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert adapter_error("org/sql-lora", tmp_path / "cache") == (
        f"the HF cache's copy of org/sql-lora ({snapshot}) is incomplete and HF_HUB_OFFLINE is set: unset it to "
        f"complete the download (it holds no adapter_config.json with adapter_model.safetensors)")


@pytest.mark.parametrize("repo_id", ["org/tiny", "org/bin-lora"])
def test_a_repository_that_is_no_peft_adapter_in_safetensors_is_refused_in_one_line(hub, tmp_path, repo_id):
    """A model named where an adapter is, or an adapter saved only as a pickle: nothing is downloaded."""
    hub.repos["org/tiny"] = FakeRepo({**model_files(tmp_path / "model", CONFIG), **UNREAD})
    hub.repos["org/bin-lora"] = FakeRepo({**ADAPTER_UNREAD})
    assert adapter_error(repo_id, tmp_path / "cache") == (
        f"{repo_id} holds no adapter_config.json with adapter_model.safetensors: it is no PEFT adapter that Sluice "
        f"reads (one saved as adapter_model.bin, a pickle: convert it to safetensors)")
    assert downloads(hub.requests) == []


def test_an_engine_serves_an_adapter_named_by_its_hub_id(hub, home, tmp_path):
    """`--lora-modules sql=org/tiny-lora`: the engine downloads the adapter and serves it as PEFT computes it."""
    adapter = DATA / "tiny_lora" / "all_modules"
    hub.repos["org/tiny-lora"] = FakeRepo({name: (adapter / name).read_bytes() for name in ADAPTER})
    golden = json.loads((DATA / "tiny_lora" / "golden.json").read_text())
    model = copy_with_tokenizer(DATA / "tiny_llama3", tmp_path, vocab_size=320)
    engine = golden_engine(load_model(str(model), dtype="float32"), enable_lora=True,
                           lora_modules=(("sql", "org/tiny-lora"),))
    case = golden["adapters"]["all_modules"]["cases"][1]
    [[output]] = engine.generate([case["prompt_ids"]], golden_params(golden, lora=engine.adapters["sql"]))
    assert_completion_gives_case(output, case)
    assert engine.adapters["sql"].fingerprint == load_adapter("sql", adapter, engine.runner.config).fingerprint


@pytest.mark.parametrize("path", ["org/" + "a" * 300, "a" * 300 + "/b", "~no-such-user-here/model"])
def test_a_path_the_file_system_cannot_name_is_not_local_and_no_error(path):
    """A name too long for the file system, or `~user` of no such user, is told from a Hub id without the
    OSError or RuntimeError that looking for it raises (a Hub id too long for the Hub is the Hub's one-line error)."""
    assert from_hub(path) == is_hub_id(path)
