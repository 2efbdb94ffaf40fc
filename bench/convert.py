"""Benchmark HF import/export on a synthetic Llama checkpoint (issue 6): speed vs raw safetensors, peak RSS.

    python bench/convert.py --size-gb 1.0 [--tp 4] [--workdir /tmp/convert-bench]

Each measurement runs in a fresh process (peak RSS = ``ru_maxrss`` of that process, minus its RSS after
imports), in the same run and on the same files:

- ``raw``: ``safetensors.torch.load_file`` of every shard, materialised with ``clone()`` (the reference speed);
- ``import``: ``causal_lm_from_hf`` (meta build, ``to_empty``, streaming ``load_hf_weights``);
- ``export``: ``export_hf`` of that model into new shards;
- ``tp``: ``--tp`` gloo processes each importing its TP shard (bytes read per rank vs the checkpoint).

Targets: import >= 0.5x raw speed; import peak RSS <= 1.3x largest shard + model; TP rank reads ~1/tp.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _procs import collect  # noqa: E402  (bench/ is sys.path[0])


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _config(size_gb: float):
    from lightning_flagscale.config import TransformerConfig

    # Llama-like shape; layers scale the size (about 48 MB of fp32 weights per layer, 2 x 128 MB embeddings).
    base = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
        max_seq_len=2048, rope_theta=500000.0,
    )  # fmt: skip
    per_layer = 4 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 2816 + 2 * 1024)
    embed = 4 * 2 * 32000 * 1024
    layers = max(1, round((size_gb * 1e9 - embed) / per_layer))
    return TransformerConfig(num_layers=layers, **base)


def make_checkpoint(path: Path, size_gb: float, shard: str) -> None:
    import torch

    from lightning_flagscale.convert.registry import family_for
    from lightning_flagscale.convert.safetensors_io import ShardedSafetensorsWriter, atomic_output_dir
    from lightning_flagscale.models import CausalLM

    config = _config(size_gb)
    family = family_for(config)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    with atomic_output_dir(path) as tmp:
        writer = ShardedSafetensorsWriter(tmp, shard)
        for name, spec in family.weight_specs(config).items():
            if name in shapes:
                writer.add(spec.names()[0], torch.randn(shapes[name], generator=gen) * 0.02)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(family.config_to_hf(config)))


# ---- measured tasks (each in a fresh process) ------------------------------------------------------------------


def task_raw(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    base = _rss_mb()
    start = time.perf_counter()
    state = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        # load_file returns tensors over the file mmap (lazy pages): clone() materialises them, as any import must.
        state.update({k: v.clone() for k, v in load_file(file).items()})
    total = sum(t.numel() * t.element_size() for t in state.values())
    return {"seconds": time.perf_counter() - start, "bytes": total, "peak_mb": _peak_mb() - base}


def task_import(hf_dir: str, export_to: str | None) -> dict:
    from lightning_flagscale.convert import causal_lm_from_hf, export_hf
    from lightning_flagscale.models import CausalLM  # noqa: F401  (import time is not conversion time)

    base = _rss_mb()
    start = time.perf_counter()
    model = causal_lm_from_hf(hf_dir)
    seconds = time.perf_counter() - start
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    out = {"seconds": seconds, "peak_mb": _peak_mb() - base, "model_mb": model_mb}
    if export_to:
        start = time.perf_counter()
        export_hf(model, export_to, max_shard_size="500MB")
        out["export_seconds"] = time.perf_counter() - start
        out["export_peak_mb"] = _peak_mb() - base
    return out


def _tp_worker(rank: int, world: int, port: int, hf_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.convert import config_from_hf, load_hf_weights
    from lightning_flagscale.models import CausalLM
    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = CausalLM(config_from_hf(hf_dir), vocab_multiple=world)
    apply_tp(model, mesh, sequence_parallel=False)
    model.to_empty(device="cpu")
    start = time.perf_counter()
    read = load_hf_weights(model, hf_dir)
    queue.put({"rank": rank, "bytes_read": read, "seconds": time.perf_counter() - start, "peak_mb": _peak_mb()})
    dist.barrier()
    dist.destroy_process_group()


def run_in_process(fn, *args) -> dict:
    ctx = mp.get_context("spawn")  # never forked: this parent has run torch (written the checkpoint) by now
    queue = ctx.Queue()
    proc = ctx.Process(target=_call, args=(fn, args, queue))
    proc.start()
    return collect([proc], queue, 1, name=getattr(fn, "__name__", "convert"))[0]


def _call(fn, args, queue) -> None:
    import torch

    torch.set_num_threads(2)
    queue.put(fn(*args))


def run_tp(hf_dir: str, world: int) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")  # never forked: this parent has run torch (written the checkpoint) by now
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_worker, args=(r, world, port, hf_dir, queue)) for r in range(world)]
    for p in procs:
        p.start()
    return sorted(collect(procs, queue, world, name="TP read"), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--shard", default="500MB", help="max shard size of the synthetic checkpoint")
    parser.add_argument("--tp", type=int, default=4, help="TP degree for the per-rank read check (0 skips)")
    parser.add_argument("--workdir", default="/tmp/convert-bench")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf_dir, export_dir = work / "hf", work / "export"
    make_checkpoint(hf_dir, args.size_gb, args.shard)
    files = sorted(hf_dir.glob("*.safetensors"))
    ckpt_mb = sum(f.stat().st_size for f in files) / 2**20
    largest_mb = max(f.stat().st_size for f in files) / 2**20
    print(f"checkpoint: {ckpt_mb:.0f} MiB in {len(files)} shards (largest {largest_mb:.0f} MiB)")

    raw = run_in_process(task_raw, str(hf_dir))
    imp = run_in_process(task_import, str(hf_dir), str(export_dir))
    raw2 = run_in_process(task_raw, str(hf_dir))
    raw_s = min(raw["seconds"], raw2["seconds"])
    print(f"raw load_file : {raw_s:6.2f} s  {ckpt_mb / raw_s:7.0f} MiB/s  peak +{raw['peak_mb']:.0f} MiB")
    print(
        f"import        : {imp['seconds']:6.2f} s  {ckpt_mb / imp['seconds']:7.0f} MiB/s  peak +{imp['peak_mb']:.0f} MiB"
        f"  -> speed {raw_s / imp['seconds']:.2f}x raw (target >= 0.5x);"
        f" peak / (1.3 x largest shard + model) = {imp['peak_mb'] / (1.3 * largest_mb + imp['model_mb']):.2f}"
        " (target <= 1)"
    )
    print(
        f"export        : {imp['export_seconds']:6.2f} s  {ckpt_mb / imp['export_seconds']:7.0f} MiB/s"
        f"  peak +{imp['export_peak_mb']:.0f} MiB (model {imp['model_mb']:.0f} MiB + ~1 shard)"
    )
    if args.tp > 1:
        ranks = run_tp(str(hf_dir), args.tp)
        total = ckpt_mb * 2**20
        for r in ranks:
            print(
                f"TP={args.tp} rank {r['rank']}: read {r['bytes_read'] / 2**20:7.0f} MiB = "
                f"{r['bytes_read'] / total:.3f} of the checkpoint (ideal {1 / args.tp:.3f}) in {r['seconds']:.2f} s"
            )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
