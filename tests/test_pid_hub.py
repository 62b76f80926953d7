"""Loading PiD: the released checkpoint layout, the Hub download path (against a local server) and our own format."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch
from huggingface_hub import constants as hub_constants

from diffusers_stepbatch.decoders.pid import (
    OFFICIAL_CONFIGS,
    PiDCheckpointError,
    PiDCheckpointNotFoundError,
    PiDDecoder,
    load_official_decoder,
)
from diffusers_stepbatch.decoders.pid.hub import (
    download_official_checkpoint,
    load_official_state_dict,
    map_official_keys,
    read_checkpoint,
    save_official_checkpoint,
)

from .pid_helpers import TINY_CONFIGS, inputs, tiny_decoder

CHECKPOINT = "PiD_res2k_sr4x_official_flux_distill_4step"
CHECKPOINT_V1PT5 = "PiD_v1pt5_res2kto4k_sr4x_official_flux_distill_4step"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _forward(decoder, seed=0):
    config = decoder._hub_mixin_config
    latent, text = inputs(config, 2, (2, 3), seed=seed)
    scale = config["sr_scale"] * config["latent_spatial_down_factor"]
    x = torch.randn(2, 3, 2 * scale, 3 * scale, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return decoder(x, torch.tensor([999.0, 342.0]), text, lq_latent=latent, degrade_sigma=torch.tensor([0.0, 0.3]))


# --- the released layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v1", "v1pt5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_official_layout_round_trip(tmp_path, name, dtype):
    original = tiny_decoder(name)
    path = tmp_path / "model_ema_bf16.pth"
    save_official_checkpoint(original, path, dtype=dtype)

    raw = torch.load(path, weights_only=True)
    assert all(k.startswith("net.") for k in raw) and len(raw) == len(original.state_dict())
    assert {v.dtype for v in raw.values()} == {dtype}

    loaded = PiDDecoder(**TINY_CONFIGS[name]).eval()
    load_official_state_dict(loaded, read_checkpoint(path))
    reference = tiny_decoder(name)
    if dtype != torch.float32:
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.to(dtype))
    assert torch.equal(_forward(loaded), _forward(reference))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: {f"net.{k}": v for k, v in sd.items()},
        lambda sd: {"model": {f"net.{k}": v for k, v in sd.items()}},
        lambda sd: {
            **{f"net_ema.{k}": v for k, v in sd.items()},
            **{f"net.{k}": torch.zeros_like(v) for k, v in sd.items()},
            "fake_score.w": torch.zeros(1),
        },
        lambda sd: {f"net._orig_mod.{k}": v for k, v in sd.items()},
        lambda sd: dict(sd),
    ],
    ids=["net_prefix", "nested_model", "ema_preferred", "compiled", "bare"],
)
def test_key_mapping_variants(wrap):
    state = tiny_decoder("v1").state_dict()
    assert {k: v.data_ptr() for k, v in map_official_keys(wrap(state)).items()} == {
        k: v.data_ptr() for k, v in state.items()
    }


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape"])
def test_strict_load_lists_the_offending_keys(problem):
    state = {f"net.{k}": v for k, v in tiny_decoder("v1").state_dict().items()}
    if problem == "missing":
        del state["net.lq_proj.gate_modules.1.log_alpha"]
        expected = "1 missing keys [lq_proj.gate_modules.1.log_alpha]"
    elif problem == "unexpected":
        state["net.text_refine_blocks.0.weight"] = torch.zeros(2)
        expected = "1 unexpected keys [text_refine_blocks.0.weight]"
    else:
        state["net.y_pos_embedding"] = torch.zeros(1, 7, 32)
        expected = "y_pos_embedding: checkpoint (1, 7, 32) vs model (1, 12, 32)"
    with pytest.raises(PiDCheckpointError) as info:
        load_official_state_dict(PiDDecoder(**TINY_CONFIGS["v1"]), state)
    assert expected in str(info.value)


def test_unreadable_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model_ema_bf16.pth"
    save_official_checkpoint(tiny_decoder("v1"), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PiDCheckpointError, match="not a readable PyTorch checkpoint"):
        read_checkpoint(path)


@pytest.mark.parametrize("name", sorted(OFFICIAL_CONFIGS))
def test_every_released_config_builds(name):
    entry = OFFICIAL_CONFIGS[name]
    with torch.device("meta"):
        decoder = PiDDecoder(**entry.constructor)
    n_params = sum(p.numel() for p in decoder.parameters())
    # NOTE: the paper's "~1.3B PixelDiT backbone" plus the adapter.
    assert 1.2e9 < n_params < 1.6e9
    keys = decoder.state_dict().keys()
    assert ("lq_proj.pit_head.weight" in keys) == ("v1pt5" in name)
    assert entry.filename == f"checkpoints/{name}/model_ema_bf16.pth"


# --- the Hub download path against a local server -----------------------------------------------------------


class _HubServer:
    """Serves `/{repo}/resolve/{revision}/{path}` (HEAD and GET) like the Hub, and counts requests."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.hits: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _respond(self, with_body: bool):
                server.hits.append((self.command, self.path))
                parts = unquote(self.path.split("?")[0]).lstrip("/").split("/")
                repo, kind, filename = "/".join(parts[:2]), parts[2], "/".join(parts[4:])
                body = server.files.get(f"{repo}/{filename}") if kind == "resolve" else None
                if body is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Error-Message", "Entry not found")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self):
                self._respond(with_body=False)

            def do_GET(self):
                self._respond(with_body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class HubCase:
    server: _HubServer
    original: PiDDecoder
    cache_dir: Path

    def load(self, checkpoint: str = CHECKPOINT, **kwargs):
        return load_official_decoder(
            checkpoint, revision=COMMIT, cache_dir=self.cache_dir, token=False, **TINY_CONFIGS["v1"], **kwargs
        )

    def cached_blob(self) -> Path:
        path = download_official_checkpoint(
            CHECKPOINT, revision=COMMIT, cache_dir=self.cache_dir, local_files_only=True
        )
        return Path(os.path.realpath(path))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hub on 127.0.0.1 holding a tiny decoder under the real checkpoint path; HF_ENDPOINT points at it."""
    original = tiny_decoder("v1")
    path = tmp_path / "upload.pth"
    save_official_checkpoint(original, path)
    with _HubServer() as server:
        server.files[f"nvidia/PiD/checkpoints/{CHECKPOINT}/model_ema_bf16.pth"] = path.read_bytes()
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield HubCase(server, original, tmp_path / "cache")


def _online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)


def _bf16(decoder: PiDDecoder) -> PiDDecoder:
    """The decoder with its weights rounded to bfloat16, as the released file stores them."""
    return copy.deepcopy(decoder).to(torch.bfloat16).float()


def test_download_once_then_cache_then_offline(hub, monkeypatch):
    _online(monkeypatch)
    first = hub.load()
    downloads = len(hub.server.hits)
    assert downloads >= 1 and any(method == "GET" for method, _ in hub.server.hits)
    second = hub.load()
    assert len(hub.server.hits) == downloads  # served from the cache: a pinned revision needs no request

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = hub.load()
    assert len(hub.server.hits) == downloads

    expected = _forward(_bf16(hub.original))
    for decoder in (first, second, offline):
        assert torch.equal(_forward(decoder), expected)


def test_offline_and_not_cached_names_the_file(hub):
    with pytest.raises(PiDCheckpointNotFoundError) as info:
        hub.load()
    message = str(info.value)
    assert f"checkpoints/{CHECKPOINT}/model_ema_bf16.pth" in message and "HF_HUB_OFFLINE" in message
    assert hub.server.hits == []


def test_missing_on_the_hub_names_the_file(hub, monkeypatch):
    _online(monkeypatch)
    with pytest.raises(PiDCheckpointNotFoundError, match=f"checkpoints/{CHECKPOINT_V1PT5}/model_ema_bf16.pth"):
        hub.load(CHECKPOINT_V1PT5)


def test_unknown_checkpoint_lists_the_known_ones():
    with pytest.raises(ValueError, match=CHECKPOINT):
        PiDDecoder.from_pretrained("nvidia/PiD", checkpoint="PiD_res16k_sr64x")


@pytest.mark.parametrize("damage", ["truncate", "flip_byte"])
def test_damaged_cache_file_is_a_clear_error(hub, monkeypatch, damage):
    _online(monkeypatch)
    hub.load()
    blob = hub.cached_blob()
    data = bytearray(blob.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PiDCheckpointError, match="corrupted or truncated.*force_download=True"):
        hub.load()
    if damage == "truncate":
        with pytest.raises(PiDCheckpointError, match="not a readable PyTorch checkpoint"):
            hub.load(verify_checksum=False)


def test_from_pretrained_with_checkpoint_goes_through_the_loader(hub, monkeypatch):
    _online(monkeypatch)
    decoder = PiDDecoder.from_pretrained(
        "nvidia/PiD",
        checkpoint=CHECKPOINT,
        revision=COMMIT,
        cache_dir=hub.cache_dir,
        token=False,
        torch_dtype=torch.bfloat16,
        **TINY_CONFIGS["v1"],
    )
    assert {p.dtype for p in decoder.parameters()} == {torch.bfloat16}
    assert torch.equal(_forward(decoder.float()), _forward(_bf16(hub.original)))


# --- our own format through the mixin ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v1", "v1pt5_packed_latent"])
def test_save_pretrained_round_trip(tmp_path, name):
    original = tiny_decoder(name)
    original.save_pretrained(tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "config.json").read_text())
    assert {k: config[k] for k in TINY_CONFIGS[name]} == TINY_CONFIGS[name]

    loaded = PiDDecoder.from_pretrained(tmp_path / "adapter")
    assert torch.equal(_forward(loaded), _forward(original))


def test_from_pretrained_is_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_decoder("v1").save_pretrained(tmp_path / "adapter")
    weights = load_file(tmp_path / "adapter" / "model.safetensors")
    del weights["final_layer.linear.bias"]
    save_file(weights, tmp_path / "adapter" / "model.safetensors")
    with pytest.raises(RuntimeError, match="final_layer.linear.bias"):
        PiDDecoder.from_pretrained(tmp_path / "adapter")
