"""Latent and text-embedding cache: contents, reuse, invalidation, sharding over 2 gloo ranks (one
cache folder, or one per rank).

The 2-rank tests run this file as a script in two real processes (see `_run_two_ranks`).
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_trainer_data import write_truncated_jpeg

from conftest import free_port, subprocess_env
from trainer.cache import build_cache, module_fingerprint, sample_latents
from trainer.data import DataConfig, DataError, SampleKey, build_dataloader, build_dataset, flip_decision
from trainer.vae_encode import encode_in_calls, images_per_call

RESOLUTION = 16  # the tiny VAE halves it: latents are 4 x 8 x 8
MAX_TOKENS = 12


def write_tokenizer_files(folder: Path) -> tuple[Path, Path]:
    """A tiny CLIP BPE vocabulary: single characters (plain and word-final) and two merges."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in string.ascii_lowercase + string.digits + ",.":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    vocab["re"] = len(vocab)
    vocab["red</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\nr e\nre d</w>\n")
    return folder / "vocab.json", folder / "merges.txt"


def tiny_models(token_folder: Path):
    """(tokenizer, vae, text_encoder) with fixed random weights: identical in every process."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab, merges = write_tokenizer_files(token_folder)
    tokenizer = CLIPTokenizer(str(vocab), str(merges), model_max_length=MAX_TOKENS)
    torch.manual_seed(0)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=RESOLUTION,
    ).eval()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer.get_vocab()),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    ).eval()
    return tokenizer, vae, text_encoder


class EncoderCalls:
    """Counts forward calls of the VAE encoder and the text encoder (real modules, hooks only)."""

    def __init__(self, vae: torch.nn.Module, text_encoder: torch.nn.Module) -> None:
        self.vae = 0
        self.text = 0
        vae.encoder.register_forward_hook(lambda *_: self._bump("vae"))
        text_encoder.register_forward_hook(lambda *_: self._bump("text"))

    def _bump(self, which: str) -> None:
        setattr(self, which, getattr(self, which) + 1)

    def total(self) -> int:
        return self.vae + self.text


def write_folder(root: Path, count: int) -> Path:
    """Images with same-named captions; captions repeat so the cache must deduplicate them."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = np.random.default_rng(i).integers(0, 256, (20, 24, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"img{i:02d}.png")
        (root / f"img{i:02d}.txt").write_text(["red", "a blue one", "red", "green 3"][i % 4])
    return root


def encode_directly(vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        dist = vae.encode(pixels[None]).latent_dist
    return dist.mean[0], dist.std[0]


def test_module_fingerprint_samples_large_tensors_to_their_last_element() -> None:
    module = torch.nn.Linear(1, 1)
    module.big = torch.nn.Parameter(
        torch.zeros(2**24 + 3), requires_grad=False
    )  # float32 linspace overshoots
    before = module_fingerprint(module)
    assert module_fingerprint(module) == before
    with torch.no_grad():
        module.big[-1] = 1.0
    assert module_fingerprint(module) != before


def test_unwritable_cache_folder_is_a_data_error(tmp_path: Path) -> None:
    tokenizer, vae, text_encoder = tiny_models(tmp_path / "tok")
    (tmp_path / "blocked").write_text("a file where the cache folder should be")
    cfg = DataConfig(resolution=RESOLUTION, max_samples=4, cache_dir=str(tmp_path / "blocked" / "cache"))
    with pytest.raises(DataError, match="cannot write the latent cache .*data.cache_dir"):
        build_cache(build_dataset(cfg), vae, text_encoder, tokenizer, cfg, "cpu")


def test_cache_contents_reuse_and_invalidation(tmp_path: Path) -> None:
    tokenizer, vae, text_encoder = tiny_models(tmp_path / "tok")
    calls = EncoderCalls(vae, text_encoder)
    data = write_folder(tmp_path / "data", 5)
    cfg = DataConfig(
        source=str(data), resolution=RESOLUTION, random_flip=True, cache_dir=str(tmp_path / "cache")
    )
    ds = build_dataset(cfg, seed=2)

    cached = build_cache(ds, vae, text_encoder, tokenizer, cfg, "cpu", batch_size=2)
    assert not cached.stats.hit
    assert (cached.stats.encoded_images, cached.stats.encoded_captions) == (5, 3)
    assert calls.vae == 3 and calls.text == 2  # batches of 2: 5 images, 3 distinct captions
    assert len(cached) == 5

    # Every item matches a direct encoding of the (possibly flipped) image, for several epochs.
    for epoch in range(3):
        for index in range(5):
            item = cached[SampleKey(index, epoch)]
            assert item["latent_mean"].shape == (4, 8, 8) and item["latent_std"].shape == (4, 8, 8)
            assert item["encoder_hidden_states"].shape == (MAX_TOKENS, 16)
            assert item["caption"] == ds.caption(index)
            pixels = ds[SampleKey(index, epoch)]["pixel_values"]
            mean, std = encode_directly(vae, pixels)
            assert torch.allclose(item["latent_mean"], mean, atol=1e-5)
            assert torch.allclose(item["latent_std"], std, atol=1e-5)
            unflipped = encode_directly(vae, ds.pixels(index, epoch, flip=False)[0])[0]
            assert torch.allclose(item["latent_mean"], unflipped, atol=1e-5) != flip_decision(2, epoch, index)
    tokens = tokenizer(
        ["red"], padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        hidden = text_encoder(tokens.input_ids)[0][0]
    assert torch.allclose(cached[0]["encoder_hidden_states"], hidden, atol=1e-5)
    assert any(flip_decision(2, e, i) for e in range(3) for i in range(5))
    assert not all(flip_decision(2, e, i) for e in range(3) for i in range(5))

    batch = next(iter(build_dataloader(cached, None, batch_size=4)))
    assert batch["latent_mean"].shape == (4, 4, 8, 8) and batch["encoder_hidden_states"].shape == (
        4,
        MAX_TOKENS,
        16,
    )
    latents = sample_latents(batch["latent_mean"], batch["latent_std"], torch.Generator().manual_seed(0))
    assert latents.shape == batch["latent_mean"].shape and not torch.equal(latents, batch["latent_mean"])

    # Same data and models: a hit, no encoder call, same values.
    before = calls.total()
    again = build_cache(build_dataset(cfg, seed=2), vae, text_encoder, tokenizer, cfg, "cpu")
    assert again.stats.hit and again.stats.key == cached.stats.key and calls.total() == before
    assert torch.equal(again[SampleKey(3, 1)]["latent_mean"], cached[SampleKey(3, 1)]["latent_mean"])
    vae.register_to_config(scaling_factor=0.5)  # applied after the cache: same entry
    assert build_cache(ds, vae, text_encoder, tokenizer, cfg, "cpu").stats.key == cached.stats.key

    # A changed image: new key, encoded again.
    Image.fromarray(np.zeros((20, 24, 3), dtype=np.uint8)).save(data / "img01.png")
    os.utime(data / "img01.png", ns=(1, 1))  # a distinct mtime even on coarse-clock filesystems
    changed = build_cache(build_dataset(cfg, seed=2), vae, text_encoder, tokenizer, cfg, "cpu")
    assert not changed.stats.hit and changed.stats.key != cached.stats.key and calls.vae > 3
    assert not torch.allclose(changed[1]["latent_mean"], cached[1]["latent_mean"])

    # Changed VAE weights: new key.
    with torch.no_grad():
        vae.encoder.conv_in.weight.add_(0.01)
    retrained = build_cache(build_dataset(cfg, seed=2), vae, text_encoder, tokenizer, cfg, "cpu")
    assert not retrained.stats.hit and retrained.stats.key != changed.stats.key
    # A truncated JPEG passes the indexing check but fails to decode: the next item stands in
    # (its latents and caption), and the file is reported.
    write_truncated_jpeg(data / "img05.jpg")
    (data / "img05.txt").write_text("never seen")
    ds = build_dataset(cfg, seed=2)
    assert len(ds) == 6 and ds.skipped == []
    substituted = build_cache(ds, vae, text_encoder, tokenizer, cfg, "cpu")
    assert substituted.stats.load_errors == [str(data / "img05.jpg")]
    assert str(data / "img05.jpg") in [s.path for s in substituted.skipped]
    for epoch in range(2):
        item = substituted[SampleKey(5, epoch)]
        assert item["caption"] == ds.caption(0) == "red"
        stand_in = ds[SampleKey(5, epoch)]  # the uncached dataset substitutes the same way
        assert stand_in["load_error"] == str(data / "img05.jpg") and stand_in["caption"] == "red"
        expected = encode_directly(vae, stand_in["pixel_values"])[0]
        assert torch.allclose(item["latent_mean"], expected, atol=1e-5)
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name != "verified")
    assert len(entries) == 4 and not any(p.name.startswith(".") for p in (tmp_path / "cache").rglob("*"))


class OutOfMemoryAbove:
    """Wraps vae.encode: records each call's image count and raises CUDA's out-of-memory error
    for calls of more than `limit` images, as a card too small for them would."""

    def __init__(self, vae: torch.nn.Module, limit: int) -> None:
        self.sizes: list[int] = []
        self.limit = limit
        self._encode = vae.encode
        vae.encode = self  # type: ignore[method-assign]

    def __call__(self, pixels: torch.Tensor, *args, **kwargs):
        self.sizes.append(pixels.shape[0])
        if pixels.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return self._encode(pixels, *args, **kwargs)


def test_images_per_call_follows_the_pixel_budget() -> None:
    assert images_per_call(512, 512) == 16
    assert images_per_call(768, 768) == 7
    assert images_per_call(1024, 1024) == 4
    assert images_per_call(4096, 4096) == 1  # never zero, however large the image
    assert images_per_call(512, 768, budget=512 * 768 * 3) == 3


def test_a_step_encodes_a_large_micro_batch_in_calls_equal_to_one_call(tmp_path: Path) -> None:
    _, vae, _ = tiny_models(tmp_path / "tok")
    pixels = torch.rand(7, 3, RESOLUTION, RESOLUTION) * 2 - 1
    calls = OutOfMemoryAbove(vae, limit=7)
    with torch.no_grad():
        whole_mean, whole_std = encode_in_calls(vae, pixels)
        mean, std = encode_in_calls(vae, pixels, per_call=3)
    assert calls.sizes == [7, 3, 3, 1]
    assert torch.allclose(mean, whole_mean, atol=1e-5) and torch.allclose(std, whole_std, atol=1e-5)


def test_cache_encodes_within_the_pixel_budget_and_halves_on_out_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, vae, text_encoder = tiny_models(tmp_path / "tok")
    data = write_folder(tmp_path / "data", 7)

    def build(cache: str):
        cfg = DataConfig(source=str(data), resolution=RESOLUTION, random_flip=True, cache_dir=cache)
        return build_cache(build_dataset(cfg, seed=1), vae, text_encoder, tokenizer, cfg, "cpu", batch_size=4)

    reference = build(str(tmp_path / "whole"))  # 16 px images: the default budget takes any batch
    monkeypatch.setattr("trainer.vae_encode.ENCODE_PIXELS", 5 * RESOLUTION * RESOLUTION)
    calls = OutOfMemoryAbove(vae, limit=2)
    cached = build(str(tmp_path / "split"))
    # Batches of 4 and 3 images, each with its flips: 8 then 6 to encode, 5 per call by the
    # budget; the first call runs out of memory, so 2 per call from then on, also for batch two.
    assert calls.sizes == [5, 2, 2, 2, 2, 2, 2, 2]
    assert cached.stats.key == reference.stats.key
    for epoch in range(2):
        for index in range(7):
            got, want = cached[SampleKey(index, epoch)], reference[SampleKey(index, epoch)]
            assert torch.allclose(got["latent_mean"], want["latent_mean"], atol=1e-5)
            assert torch.allclose(got["latent_std"], want["latent_std"], atol=1e-5)


def test_cache_reraises_when_one_image_does_not_fit_and_leaves_no_entry(tmp_path: Path) -> None:
    tokenizer, vae, text_encoder = tiny_models(tmp_path / "tok")
    cfg = DataConfig(
        source=str(write_folder(tmp_path / "data", 3)), resolution=RESOLUTION, cache_dir=str(tmp_path / "c")
    )
    calls = OutOfMemoryAbove(vae, limit=0)
    with pytest.raises(torch.OutOfMemoryError):
        build_cache(build_dataset(cfg), vae, text_encoder, tokenizer, cfg, "cpu", batch_size=4)
    assert calls.sizes == [3, 1]
    assert not list((tmp_path / "c").rglob("manifest.json"))
    assert not [p for p in (tmp_path / "c").rglob("*.npy")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cache_on_cuda_in_bfloat16_agrees_with_cpu(tmp_path: Path) -> None:
    import copy

    tokenizer, vae, text_encoder = tiny_models(tmp_path / "tok")
    data = write_folder(tmp_path / "data", 6)
    cfg = DataConfig(
        source=str(data),
        resolution=RESOLUTION,
        random_flip=True,
        cache_dir=str(tmp_path / "cache"),
        num_workers=2,
    )
    ds = build_dataset(cfg)
    on_cpu = build_cache(ds, vae, text_encoder, tokenizer, cfg, "cpu")
    device = torch.device("cuda")
    vae_gpu, text_gpu = copy.deepcopy(vae).to(device), copy.deepcopy(text_encoder).to(device)
    on_gpu = build_cache(ds, vae_gpu, text_gpu, tokenizer, cfg, device, dtype=torch.bfloat16)
    assert not on_gpu.stats.hit and on_gpu.stats.key != on_cpu.stats.key  # dtype is in the key
    cpu_parts = json.loads((Path(on_cpu.stats.path) / "manifest.json").read_text())["parts"]
    gpu_parts = json.loads((Path(on_gpu.stats.path) / "manifest.json").read_text())["parts"]
    assert {k: v for k, v in gpu_parts.items() if k != "dtype"} == {
        k: v for k, v in cpu_parts.items() if k != "dtype"
    }
    for index in range(6):
        a, b = on_gpu[SampleKey(index, 1)], on_cpu[SampleKey(index, 1)]
        assert a["latent_mean"].dtype == torch.bfloat16
        assert torch.allclose(a["latent_mean"].float(), b["latent_mean"], atol=0.05, rtol=0.05)
        assert torch.allclose(
            a["encoder_hidden_states"].float(), b["encoder_hidden_states"], atol=0.05, rtol=0.05
        )
    again = build_cache(ds, vae_gpu, text_gpu, tokenizer, cfg, device, dtype=torch.bfloat16)
    assert again.stats.hit
    loader = build_dataloader(again, None, batch_size=3, num_workers=2, pin_memory=True)
    batch = next(iter(loader))
    assert batch["latent_mean"].is_pinned() and batch["latent_mean"].shape == (3, 4, 8, 8)


# Runs in a child process: the allocator cap it sets holds for the rest of a process.
REAL_OOM_CHILD = """
import torch
from trainer.models import ARCHITECTURES, build_vae
from trainer.vae_encode import FallbackEncoder
vae = build_vae(ARCHITECTURES["sd2-base"]["vae"]).to("cuda").eval()
pixels = torch.rand(16, 3, 512, 512, device="cuda") * 2 - 1
torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
with torch.no_grad():
    singles = [vae.encode(pixels[i : i + 1]).latent_dist.mean for i in range(16)]
per_image = torch.cuda.max_memory_allocated() - base
expected = torch.cat(singles)
torch.cuda.empty_cache()
cap = torch.cuda.memory_allocated() + 6 * per_image  # 4 images per call fit, 8 do not
torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
encode = FallbackEncoder(vae)
with torch.no_grad():
    mean, std = encode(pixels)
error = ((mean - expected).abs().max() / expected.abs().max()).item()  # relative: TF32 convs
print(f"per_call={encode.per_call} error={error:.2e} shape={tuple(mean.shape)}")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cache_encoder_recovers_from_a_real_cuda_out_of_memory() -> None:
    """SD2's VAE at 512 px under an allocator cap that fits 4 images a call: 16 then 8 run out of
    memory for real, 4 encodes, and the latents match encoding each image alone."""
    done = subprocess.run(
        [sys.executable, "-c", REAL_OOM_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran out of GPU memory; encoding 8 at a time" in done.stderr
    assert "ran out of GPU memory; encoding 4 at a time" in done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("per_call=4 ") and "shape=(16, 4, 64, 64)" in line, line
    assert float(line.split("error=")[1].split()[0]) < 1e-2, line


def _rank_main(rank: int, world_size: int, port: int, root: Path) -> None:
    """One rank of the sharded-cache test: build (miss), build again (hit), change data, build (miss)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tokenizer, vae, text_encoder = tiny_models(root / f"tok{rank}")
    calls = EncoderCalls(vae, text_encoder)
    cfg = DataConfig(
        source=str(root / "data"), resolution=RESOLUTION, random_flip=True, cache_dir=str(root / "cache")
    )
    result: dict = {}

    first = build_cache(
        build_dataset(cfg, verbose=rank == 0), vae, text_encoder, tokenizer, cfg, "cpu", rank, 2
    )
    result["first"] = {**vars(first.stats), "vae_calls": calls.vae, "text_calls": calls.text}
    ds = build_dataset(cfg)
    # Items encoded by either rank equal a direct encoding here.
    result["matches"] = all(
        torch.allclose(
            first[SampleKey(i, 0)]["latent_mean"],
            encode_directly(vae, ds[SampleKey(i, 0)]["pixel_values"])[0],
            atol=1e-5,
        )
        for i in range(len(ds))
    )
    result["checksum"] = float(sum(first[i]["latent_mean"].double().sum() for i in range(len(first))))
    calls.vae = calls.text = 0

    second = build_cache(build_dataset(cfg), vae, text_encoder, tokenizer, cfg, "cpu", rank, 2)
    result["second"] = {**vars(second.stats), "calls": calls.total()}

    dist.barrier()
    if rank == 0:
        (root / "data" / "img00.txt").write_text("a changed caption")
    dist.barrier()
    third = build_cache(build_dataset(cfg), vae, text_encoder, tokenizer, cfg, "cpu", rank, 2)
    result["third"] = {**vars(third.stats), "calls": calls.total()}
    result["third_caption"] = third[0]["caption"]
    (root / f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _unshared_rank_main(rank: int, world_size: int, port: int, root: Path) -> None:
    """One rank of the unshared-folder test: each rank caches into a folder of its own."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tokenizer, vae, text_encoder = tiny_models(root / f"tok{rank}")
    calls = EncoderCalls(vae, text_encoder)
    cfg = DataConfig(source=str(root / "data"), resolution=RESOLUTION, cache_dir=str(root / f"cache{rank}"))
    first = build_cache(build_dataset(cfg, verbose=False), vae, text_encoder, tokenizer, cfg, "cpu", rank, 2)
    result: dict = {"first": {**vars(first.stats), "vae_calls": calls.vae, "text_calls": calls.text}}
    ds = build_dataset(cfg, verbose=False)
    result["matches"] = all(
        torch.allclose(first[i]["latent_mean"], encode_directly(vae, ds[i]["pixel_values"])[0], atol=1e-5)
        for i in range(len(ds))
    )
    calls.vae = calls.text = 0
    second = build_cache(build_dataset(cfg, verbose=False), vae, text_encoder, tokenizer, cfg, "cpu", rank, 2)
    result["second"] = {**vars(second.stats), "calls": calls.total()}
    (root / f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run_two_ranks(root: Path, mode: str) -> list[dict]:
    """This file as a script in two real processes (gloo); each rank's result.json."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(rank), "2", str(port), str(root)],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    return [json.loads((root / f"result{r}.json").read_text()) for r in range(2)]


def test_cache_sharded_across_two_gloo_ranks_then_reused(tmp_path: Path) -> None:
    write_folder(tmp_path / "data", 6)
    results = _run_two_ranks(tmp_path, "shared")
    for rank, result in enumerate(results):
        first = result["first"]
        # 6 images and 3 distinct captions, split round-robin over 2 ranks
        assert not first["hit"] and first["encoded_images"] == 3 and first["encoded_captions"] == [2, 1][rank]
        assert first["vae_calls"] == 1 and first["text_calls"] == 1  # its own share only
        assert result["matches"], f"rank {rank} loaded wrong latents from the other rank's shard"
        assert result["second"]["hit"] and result["second"]["calls"] == 0
        third = result["third"]
        assert not third["hit"] and third["key"] != first["key"] and third["calls"] > 0
        assert result["third_caption"] == "a changed caption"
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-9)
    assert results[0]["first"]["key"] == results[1]["first"]["key"]
    entry = Path(results[0]["first"]["path"])
    shards = sorted(p.name for p in entry.iterdir() if p.is_dir())
    assert shards == [
        "captions-00000-of-00002",
        "captions-00001-of-00002",
        "images-00000-of-00002",
        "images-00001-of-00002",
    ]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["num_items"] == 6 and sorted(manifest["captions"]) == ["a blue one", "green 3", "red"]


@pytest.mark.slow  # 25 s on 2 loaded cores: two processes import torch, diffusers, transformers
def test_cache_folder_not_shared_each_rank_encodes_the_shards_it_cannot_see(tmp_path: Path) -> None:
    write_folder(tmp_path / "data", 6)
    results = _run_two_ranks(tmp_path, "unshared")
    for rank, result in enumerate(results):
        first = result["first"]
        # its own shard, then the other rank's (written into the other rank's folder): everything
        assert not first["hit"] and first["encoded_images"] == 6 and first["encoded_captions"] == 3
        assert first["vae_calls"] == 2 and first["text_calls"] == 2  # one batch per shard
        assert Path(first["path"]).parent == tmp_path / f"cache{rank}"
        assert result["matches"], f"rank {rank} encoded the shard it could not see wrongly"
        assert result["second"]["hit"] and result["second"]["calls"] == 0
        entry = Path(first["path"])
        assert sorted(p.name for p in entry.iterdir() if p.is_dir()) == [
            "captions-00000-of-00002",
            "captions-00001-of-00002",
            "images-00000-of-00002",
            "images-00001-of-00002",
        ]
    assert results[0]["first"]["key"] == results[1]["first"]["key"]


if __name__ == "__main__":
    main = {"shared": _rank_main, "unshared": _unshared_rank_main}[sys.argv[1]]
    main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
