"""Model ids (`org/name[@revision]`) found in the local Hugging Face hub cache, offline.

The hub's cache keeps each model as

    <cache>/models--org--name/refs/<branch or tag>      a file holding a commit hash
    <cache>/models--org--name/snapshots/<commit>/...     the files, symlinks into blobs/
    <cache>/models--org--name/blobs/<hash>               the contents

where <cache> is HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub. A revision is a ref
(default `main`) or a commit hash (or its unique prefix). Nothing is ever downloaded: a model that
is not in the cache is a one-line error naming the paths tried.
"""

from __future__ import annotations

import os
import re

from llmserve.model_loader.errors import ModelLoadError

DEFAULT_REVISION = "main"
# org/name[@revision] as the hub spells them; a path starting with /, ., ~ is never an id
_MODEL_ID = re.compile(r"(?P<org>[A-Za-z0-9][\w.-]*)/(?P<name>[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_SNAPSHOT_DIR = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+")


def hub_cache_dir() -> str:
    """Where the hub's cache is, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join("~", ".cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def is_model_id(model: str) -> bool:
    return _MODEL_ID.fullmatch(model) is not None


def snapshot_path(model: str) -> str:
    """The snapshot directory of `org/name[@revision]` in the hub cache; ModelLoadError if absent."""
    match = _MODEL_ID.fullmatch(model)
    if match is None:
        raise ModelLoadError(f"{model}: not a model id of the form org/name[@revision]")
    repo = os.path.join(hub_cache_dir(), f"models--{match['org']}--{match['name']}")
    if not os.path.isdir(repo):
        raise ModelLoadError(f"{model}: not in the Hugging Face cache (no {repo}); nothing is downloaded")
    return _revision_snapshot(model, repo, match["revision"] or DEFAULT_REVISION)


def _revision_snapshot(model: str, repo: str, revision: str) -> str:
    """The snapshot a ref names, else the one whose commit hash is `revision` or starts with it."""
    snapshots = os.path.join(repo, "snapshots")
    ref = os.path.join(repo, "refs", revision)
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as handle:
            commit = handle.read().strip()
        path = os.path.join(snapshots, commit)
        if not os.path.isdir(path):
            raise ModelLoadError(f"{model}: {ref} names commit {commit}, but {path} is missing")
        return path
    if _COMMIT.fullmatch(revision) and os.path.isdir(snapshots):
        found = sorted(name for name in os.listdir(snapshots) if name.startswith(revision))
        if len(found) == 1:
            return os.path.join(snapshots, found[0])
        if len(found) > 1:
            shown = ", ".join(found)
            raise ModelLoadError(f"{model}: revision {revision} matches several snapshots ({shown})")
    tried = f"{ref}, {os.path.join(snapshots, revision)}"
    raise ModelLoadError(f"{model}: revision {revision!r} is not in the Hugging Face cache (tried {tried})")


def snapshot_model(snapshot: str) -> str:
    """What a snapshot serves: itself if it holds config.json (an HF directory), else its one GGUF."""
    if os.path.isfile(os.path.join(snapshot, "config.json")):
        return snapshot
    ggufs = sorted(name for name in os.listdir(snapshot) if name.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(snapshot, ggufs[0])
    if ggufs:
        raise ModelLoadError(
            f"{snapshot}: several GGUF files ({', '.join(ggufs)}); pass the path of the one to serve"
        )
    raise ModelLoadError(f"{snapshot}: the cached snapshot has no config.json and no .gguf file")


def model_id(path: str) -> str | None:
    """`org/name` of a path inside a hub cache snapshot, else None."""
    match = _SNAPSHOT_DIR.search(path.replace(os.sep, "/"))
    return None if match is None else f"{match['org']}/{match['name']}"
