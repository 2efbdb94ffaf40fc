"""Split recompute (vision x LLM) and first-batch pre-allocation of the VLM: peak memory and step time on CPU.

    python bench/vlm.py [--rounds 3] [--steps 6] [--out bench/results/vlm.md]
    python bench/vlm.py --smoke --out /tmp/vlm.md     # 3 policies, tiny batches (the smoke test runs this)

One process, fp32, SGD, a VLM of 4.5M parameters (LLM width 256 x 4 blocks, ViT width 128 x 4 blocks) on batches of
8 synthetic image-text samples whose images vary in size (16 to 64 patches each), so batches differ in sequence
length and image-token count. Configurations: vision recompute none/full x LLM recompute none/selective/full
(pre-allocation off), plus pre-allocation on for the no-recompute policy.

Peak memory: torch's own memory profiler (``torch.profiler.profile(profile_memory=True, record_shapes=True,
with_stack=True)`` and its public ``export_memory_timeline(..., device="cpu")``), which attributes every CPU tensor
allocation of the profiled steps to a category (parameters, gradients, optimizer state, activations, temporaries,
uncategorised); "peak" is the largest total over the timeline, weights and gradients included (4.5M fp32
parameters: 17 MiB each; the profiler leaves much of them uncategorised, so no category is split off). Differences
between rows are activation memory: what the recompute policies and pre-allocation change. This counts tensor
bytes (what a caching allocator must provide), not the process RSS. It runs in a separate, untimed pass over the
same batches: step times come from unprofiled passes.

Step time: the median over the steps after the first of each pass (the first step of a pass is reported apart:
under pre-allocation it is the padded one); configurations are interleaved within each round, and the table gives
the median over rounds with the min-max. On CPU, pre-allocation shows only its cost (the padded first step and its
peak); its benefit, fewer allocator misses and less fragmentation, exists only on a caching device allocator (CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_flagscale.models.qwen2_5_vl.data import SyntheticShapesDataset, VLMCollator
from lightning_flagscale.models.qwen2_5_vl.prealloc import image_token_count
from lightning_flagscale.multimodal import VLMConfig, VLMModule
from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute

CONFIG = VLMConfig.from_preset(
    "qwen2.5-vl-tiny", hidden_size=256, intermediate_size=704, num_layers=4, num_attention_heads=4,
    num_key_value_heads=2, mrope_section=[8, 12, 12],
    vision={"hidden_size": 128, "intermediate_size": 384, "num_heads": 4, "depth": 4, "fullatt_block_indexes": [3]},
)  # fmt: skip
SIZES = ((56, 56), (56, 112), (112, 56), (112, 112))
BATCH = 8
POLICIES = [(v, llm, False) for v in ("none", "full") for llm in ("none", "selective", "full")] + [
    ("none", "none", True)
]


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    data = SyntheticShapesDataset(CONFIG, steps * BATCH, seed=3, sizes=SIZES)
    collate = VLMCollator(config=CONFIG, pad_to_multiple_of=8)
    return [collate([data[s * BATCH + i] for i in range(BATCH)]) for s in range(steps)]


def build(vision: str, llm: str, prealloc: bool, data: list[dict]) -> tuple[VLMModule, torch.optim.Optimizer]:
    merge = CONFIG.vision.spatial_merge_size
    limits = {}
    if prealloc:
        limits = dict(
            max_seq_len=max(b["input_ids"].shape[1] for b in data),
            max_image_tokens=max(image_token_count(b, merge) for b in data),
        )
    torch.manual_seed(0)
    module = VLMModule(
        CONFIG, optimizer="sgd", learning_rate=0.05, warmup_steps=0, min_lr_ratio=1.0, vision_recompute=vision,
        preallocate=prealloc, vocab_multiple=64, **limits,
    )  # fmt: skip
    module.configure_model()
    apply_recompute(module.model, llm, blocks=list(module.model.layers.values()))
    return module, torch.optim.SGD(module.parameters(), lr=0.05)


def run_pass(module: VLMModule, opt: torch.optim.Optimizer, data: list[dict]) -> list[float]:
    times = []
    for i, batch in enumerate(data):
        start = time.perf_counter()
        loss = module.training_step(batch, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def peak_memory(policy: tuple[str, str, bool], data: list[dict]) -> float:
    """Peak MiB of all CPU tensors during a fresh model's pass over ``data`` (torch memory timeline)."""
    from torch.profiler import ProfilerActivity, profile

    module, opt = build(*policy, data)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run_pass(module, opt, data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        with warnings.catch_warnings():  # deprecated in favour of CUDA-only snapshots; the CPU timeline is what we need
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes) / 2**20


def label(policy: tuple[str, str, bool]) -> str:
    vision, llm, prealloc = policy
    return f"vision={vision}, llm={llm}, prealloc={'on' if prealloc else 'off'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="bench/results/vlm.md")
    parser.add_argument("--smoke", action="store_true", help="3 policies, batches of 2, 2 steps, 1 round (seconds)")
    args = parser.parse_args()
    global BATCH, POLICIES
    if args.smoke:  # every code path once: vision + LLM recompute, pre-allocation
        args.rounds, args.steps, BATCH = 1, 2, 2
        POLICIES = [("none", "none", False), ("full", "full", False), ("none", "none", True)]
    torch.set_num_threads(1)
    data = batches(args.steps)
    memory = {p: peak_memory(p, data) for p in POLICIES}
    steady: dict = {p: [] for p in POLICIES}
    first: dict = {p: [] for p in POLICIES}
    for _ in range(args.rounds):  # interleaved: every configuration once per round
        for policy in POLICIES:
            module, opt = build(*policy, data)
            times = run_pass(module, opt, data)
            first[policy].append(times[0])
            steady[policy].append(statistics.median(times[1:]))
    lines = [
        f"`python bench/vlm.py --rounds {args.rounds} --steps {args.steps}`: torch {torch.__version__}, one CPU thread,"
        f" {sum(p.numel() for p in build('none', 'none', False, data)[0].parameters()) / 1e6:.2f}M parameters, "
        f"batches of {BATCH} samples ({min(b['input_ids'].shape[1] for b in data)}-"
        f"{max(b['input_ids'].shape[1] for b in data)} tokens per row).",
        "",
        "| policy | peak MiB | step ms (median, min-max) | first step ms (median, min-max) |",
        "|---|---:|---|---|",
    ]
    for p in POLICIES:
        ms = [1e3 * t for t in steady[p]]
        f_ms = [1e3 * t for t in first[p]]
        lines.append(
            f"| {label(p)} | {memory[p]:.1f} | {statistics.median(ms):.0f} "
            f"({min(ms):.0f}-{max(ms):.0f}) | {statistics.median(f_ms):.0f} ({min(f_ms):.0f}-{max(f_ms):.0f}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
