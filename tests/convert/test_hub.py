"""Hub repo ids (issue #17, item 3): offline resolution from the Hugging Face cache, clear errors, push on export.

The cache is laid out as ``huggingface_hub`` lays it out (``models--org--name/{blobs,refs,snapshots}``, snapshot
files symlinked to content-addressed blobs) and checked with ``huggingface_hub.scan_cache_dir``. Every test runs
with ``HF_HUB_OFFLINE=1`` or with the HTTP client replaced: no test touches the network. The push test mocks the
HTTP layer (``huggingface_hub.set_client_factory`` with an ``httpx2.MockTransport``) and checks what the commit
request carries against the exported files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")
httpx2 = pytest.importorskip("httpx2")

from lightning_flagscale.convert import HFConversionError, causal_lm_from_hf, config_from_hf  # noqa: E402
from lightning_flagscale.convert.hub import resolve_hf_dir  # noqa: E402
from tests.convert._hf import hf_logits, make_hf_model, save  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def _add_snapshot(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """Place ``folder``'s files into ``cache`` exactly as huggingface_hub's downloads do."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _refuse_http(monkeypatch)
    return cache


def _refuse_http(monkeypatch) -> None:
    def refuse(request):
        raise AssertionError(f"unexpected network request {request.method} {request.url}")

    _use_transport(monkeypatch, httpx2.MockTransport(refuse))


def _use_transport(monkeypatch, transport) -> None:
    from huggingface_hub.utils import _http

    # Recorded first, so that teardown restores huggingface_hub's own client and factory.
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", _http._GLOBAL_CLIENT_FACTORY)
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None)  # the original client is put back untouched
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=transport))  # next request uses it


def test_repo_id_resolves_from_the_cache_offline(offline_cache, tmp_path):
    main_model, tagged_model = make_hf_model("llama"), make_hf_model("qwen2")
    main = _add_snapshot(offline_cache, "org/tiny", save(main_model, tmp_path / "a"), "a" * 40, ("main",))
    tagged = _add_snapshot(offline_cache, "org/tiny", save(tagged_model, tmp_path / "b"), "b" * 40, ("v1",))
    scanned = huggingface_hub.scan_cache_dir(offline_cache)
    assert [r.repo_id for r in scanned.repos] == ["org/tiny"] and len(next(iter(scanned.repos)).revisions) == 2

    assert resolve_hf_dir("org/tiny") == main
    assert resolve_hf_dir("org/tiny", revision="v1") == tagged
    assert resolve_hf_dir("org/tiny", revision="b" * 40) == tagged
    assert config_from_hf("org/tiny", revision="v1").tie_word_embeddings  # qwen2 test model ties
    ours = causal_lm_from_hf("org/tiny")
    assert ours.hf_dir == str(main)  # the local snapshot, so every rank later reads files, not the Hub
    torch.testing.assert_close(ours.logits(ours(IDS)), hf_logits(main_model, IDS), rtol=0, atol=1e-5)


def test_from_hf_and_convert_accept_a_repo_id(offline_cache, tmp_path, capsys):
    from lightning_flagscale.convert.cli import convert_main
    from lightning_flagscale.models import CausalLMModule

    snapshot = _add_snapshot(offline_cache, "org/tiny", save(make_hf_model("llama"), tmp_path / "a"), "c" * 40,
                             ("main",))  # fmt: skip
    module = CausalLMModule.from_hf("org/tiny", revision="main")
    assert module.hf_dir == str(snapshot) and module.config.hidden_size == 32
    assert convert_main(["hf-to-ckpt", "org/tiny", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "model_config.json").is_file()


def test_offline_and_not_cached_is_a_clear_error(offline_cache, tmp_path, capsys):
    from lightning_flagscale.convert.cli import convert_main

    with pytest.raises(HFConversionError, match=r"'org/missing' is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve_hf_dir("org/missing")
    with pytest.raises(SystemExit):
        convert_main(["hf-to-ckpt", "org/missing", str(tmp_path / "out"), "--revision", "v2"])
    assert "'org/missing' at revision 'v2' is not in the Hugging Face cache" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hugging Face Hub repo id"):
        resolve_hf_dir("./no/such/folder")
    with pytest.raises(ValueError, match="revision='v1' applies to Hub repo ids"):
        resolve_hf_dir(tmp_path, revision="v1")


def test_export_pushes_every_file_to_the_hub(tmp_path, monkeypatch):
    from lightning_flagscale.convert import export_hf

    requests: list[tuple[str, str]] = []
    committed: dict[str, bytes] = {}

    def hub(request):
        requests.append((request.method, request.url.path))
        path = request.url.path
        if path == "/api/repos/create":
            return httpx2.Response(200, json={"url": "https://huggingface.co/org/tiny-ft"})
        if path.startswith("/api/models/org/tiny-ft/preupload/"):
            files = json.loads(request.content)["files"]
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return httpx2.Response(200, json={"files": modes})
        if path == "/api/models/org/tiny-ft/commit/main":
            for line in request.content.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    committed[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return httpx2.Response(200, json={"commitUrl": "https://huggingface.co/org/tiny-ft/commit/" + "d" * 40,
                                              "commitOid": "d" * 40})  # fmt: skip
        return httpx2.Response(404, json={"error": f"not mocked: {path}"})

    monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_real")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _use_transport(monkeypatch, httpx2.MockTransport(hub))
    model = causal_lm_from_hf(save(make_hf_model("llama"), tmp_path / "hf"))
    out = export_hf(model, tmp_path / "export", push_to_hub="org/tiny-ft")
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert ("POST", "/api/repos/create") in requests
    assert committed == written and "model.safetensors" in committed


def test_push_refused_offline(tmp_path, monkeypatch):
    from lightning_flagscale.convert.hub import push_folder_to_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HFConversionError, match="HF_HUB_OFFLINE is set"):
        push_folder_to_hub(tmp_path, "org/x")


def test_vlm_import_accepts_a_repo_id(offline_cache, tmp_path):
    """The vision-language import resolves a Hub repo id (and a revision) from the cache like the text models."""
    from lightning_flagscale.multimodal import VLMModule
    from tests.convert.test_qwen2_5_vl import hf_logits as vl_hf_logits
    from tests.convert.test_qwen2_5_vl import make_batch, make_hf_vl, our_logits

    hf_model = make_hf_vl()
    folder = tmp_path / "vl"
    hf_model.save_pretrained(folder)
    snapshot = _add_snapshot(offline_cache, "org/tiny-vl", folder, "d" * 40, ("main", "v2"))
    module = VLMModule.from_hf("org/tiny-vl", revision="v2")
    assert module.hf_dir == str(snapshot)
    module.configure_model()
    batch = make_batch()
    valid = batch[1].bool()
    got = our_logits(module.model.eval(), *batch)
    torch.testing.assert_close(got[valid], vl_hf_logits(hf_model, *batch)[valid], rtol=0, atol=1e-5)
