"""Model ids resolved in a Hugging Face hub cache built by hand: refs, snapshots of symlinks, blobs."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.entrypoints.openai.api_server import default_served_model_name
from llmserve.model_loader import ModelLoadError, load_weights, resolve_model_path
from llmserve.model_loader.hf_cache import hub_cache_dir
from tests.helpers import make_tiny_llama_dir

MAIN_COMMIT = "a" * 8 + hashlib.sha1(b"main").hexdigest()[8:]
V2_COMMIT = "b" * 8 + hashlib.sha1(b"v2").hexdigest()[8:]


def _add_snapshot(repo: str, source: str, commit: str, refs: tuple[str, ...]) -> str:
    """The hub's layout: each file's contents once under blobs/, the snapshot's names symlinks to it."""
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for name in os.listdir(source):
        with open(os.path.join(source, name), "rb") as handle:
            blob = hashlib.sha256(handle.read()).hexdigest()
        shutil.copyfile(os.path.join(source, name), os.path.join(repo, "blobs", blob))
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    for ref in refs:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as handle:
            handle.write(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache dir, {"main": (snapshot, source dir), "v2": ...}) for the model id `org/tiny`."""
    root = tmp_path_factory.mktemp("hf")
    repo = str(root / "hub" / "models--org--tiny")
    sources = {
        name: make_tiny_llama_dir(str(root / name), seed=seed) for name, seed in (("main", 0), ("v2", 1))
    }
    snapshots = {
        "main": _add_snapshot(repo, sources["main"], MAIN_COMMIT, ("main",)),
        "v2": _add_snapshot(repo, sources["v2"], V2_COMMIT, ("v2",)),
    }
    assert os.path.islink(os.path.join(snapshots["main"], "config.json"))
    return str(root / "hub"), {name: (snapshots[name], sources[name]) for name in snapshots}


@pytest.fixture
def cache(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", hub[0])
    monkeypatch.chdir(tmp_path)  # no local org/tiny directory
    return hub[1]


def _error(model: str) -> str:
    with pytest.raises(ModelLoadError) as raised:
        resolve_model_path(model)
    message = str(raised.value)
    assert "\n" not in message  # the CLI prints it as one line
    return message


def test_cache_dir_follows_the_hub_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == str(tmp_path / "elsewhere")


def test_revision_by_branch_and_by_commit(cache):
    main, v2 = cache["main"][0], cache["v2"][0]
    assert resolve_model_path("org/tiny") == main  # refs/main by default
    assert resolve_model_path("org/tiny@main") == main
    assert resolve_model_path("org/tiny@v2") == v2
    assert resolve_model_path(f"org/tiny@{V2_COMMIT}") == v2
    assert resolve_model_path(f"org/tiny@{MAIN_COMMIT[:10]}") == main  # a unique prefix
    weights, expected = (
        load_weights("org/tiny@v2", torch.float32),
        load_weights(cache["v2"][1], torch.float32),
    )
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_served_under_its_model_id(cache):
    assert default_served_model_name(resolve_model_path("org/tiny@v2")) == "org/tiny"
    assert default_served_model_name(cache["main"][1]) == "main"  # a plain directory keeps its name


def test_a_local_directory_wins_over_the_cache(cache, tmp_path):
    local = make_tiny_llama_dir(str(tmp_path / "org" / "tiny"))
    assert resolve_model_path("org/tiny") == local


def test_missing_model_names_the_paths_tried(cache, hub, tmp_path):
    message = _error("org/absent")
    assert str(tmp_path / "org" / "absent") in message
    assert os.path.join(hub[0], "models--org--absent") in message
    assert "nothing is downloaded" in message


def test_missing_revision_names_the_paths_tried(cache, hub):
    message = _error("org/tiny@v3")
    repo = os.path.join(hub[0], "models--org--tiny")
    assert os.path.join(repo, "refs", "v3") in message
    assert os.path.join(repo, "snapshots", "v3") in message


def test_a_ref_to_a_missing_snapshot_is_named(monkeypatch, tmp_path):
    repo = tmp_path / "models--org--gone"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert str(repo / "snapshots" / MAIN_COMMIT) in _error("org/gone")


def test_a_snapshot_of_one_gguf_file_resolves_to_it(monkeypatch, tmp_path):
    snapshot = tmp_path / "models--org--quant" / "snapshots" / MAIN_COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "models--org--quant" / "refs").mkdir()
    (tmp_path / "models--org--quant" / "refs" / "main").write_text(MAIN_COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/quant") == str(snapshot / "model.Q4_K_M.gguf")
    (snapshot / "model.Q8_0.gguf").write_bytes(b"GGUF")
    assert "several GGUF files" in _error("org/quant")


def test_a_cached_model_generates_as_its_directory(cache):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 200, 31], [1, 77, 3000]]
    tokens = {}
    for model in ("org/tiny", cache["main"][1]):
        llm = LLM(model, dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[model] = [output.outputs[0].token_ids for output in outputs]
        finally:
            llm.shutdown()
    assert tokens["org/tiny"] == tokens[cache["main"][1]]
    assert all(len(ids) == 12 for ids in tokens["org/tiny"])
