"""Hugging Face Hub ids for imports and pushes for exports, through ``huggingface_hub``.

``resolve_hf_dir("Qwen/Qwen2.5-0.5B", revision=...)`` returns a local folder: an existing directory as is, a repo id
through ``snapshot_download`` restricted to what conversion reads (config, safetensors and their index, tokenizer and
generation files). The Hub cache and ``HF_HUB_OFFLINE`` work as everywhere in the HF ecosystem: offline, a cached
snapshot is used and a missing one is a clear error instead of a network attempt.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_flagscale.convert.registry import HFConversionError

__all__ = ["HUB_ALLOW_PATTERNS", "is_offline", "push_folder_to_hub", "resolve_hf_dir"]

HUB_ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)
"""What conversion reads from a model repo: never ``*.bin``/``*.pt`` pickles or other frameworks' weights."""


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now; huggingface_hub reads it once, at import."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    offline_mode = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)  # older releases: a flag
    return bool(offline_mode()) or any(f is not None and f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name.replace("/", ""):
        return False
    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def resolve_hf_dir(
    name_or_path: str | os.PathLike, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """A local HF model folder for a path or a Hub repo id (``"org/name"``, optionally at ``revision``)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids; {str(path)!r} is a local folder.")
        return path
    name = str(name_or_path)
    if not _is_repo_id(name):
        raise FileNotFoundError(f"{name!r} is neither a local folder nor a Hugging Face Hub repo id ('org/name').")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    offline = is_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        local = snapshot_download(
            name, revision=revision, cache_dir=cache_dir, allow_patterns=list(HUB_ALLOW_PATTERNS),
            local_files_only=offline,
        )  # fmt: skip
    except LocalEntryNotFoundError as err:
        from huggingface_hub import constants

        where = cache_dir or constants.HF_HUB_CACHE
        reason = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise HFConversionError(
            f"{name!r}{at} is not in the Hugging Face cache ({where}) and {reason}, and no local folder has that"
            f" path: check the path, or download it once with network access (`hf download {name}`)."
        ) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HFConversionError(
            f"{name!r}{at} was not found on the Hugging Face Hub ({first}), and no local folder has that path."
        ) from err
    return Path(local)


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload model exported by lightning-flagscale",
) -> str:
    """Upload an exported HF folder to ``repo_id`` (created if missing); returns the commit URL."""
    from huggingface_hub import HfApi

    if is_offline():
        raise HFConversionError(f"Cannot push to {repo_id!r}: HF_HUB_OFFLINE is set.")
    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
