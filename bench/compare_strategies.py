"""``lightning-flagscale bench``: FlagScaleStrategy side by side with Lightning's built-in strategies.

    python bench/compare_strategies.py [--quick] [--out bench/results] [--only NAME ...]
    lightning-flagscale bench [--quick] [--out DIR]      # the same, from a repository checkout

Every configuration trains the same decoder (same init, same data, same global batch, same number of steps) with
``Trainer.fit`` on ``--world`` CPU processes (gloo), each configuration in a fresh set of spawned processes so
they do not disturb each other:

- Lightning: ``DDPStrategy``, ``FSDPStrategy`` (FSDP1, one unit per decoder block), ``ModelParallelStrategy``
  (TP=2 x FSDP2, ``configure_model`` applies ``apply_tp`` + ``fully_shard`` on ``self.device_mesh``; and TP=1,
  i.e. plain FSDP2, to tell FSDP2-vs-FSDP1 differences from FlagScale's own);
- FlagScale: DDP, ZeRO-1, ZeRO-3 (FSDP2), TP=2 x ZeRO-1, TP=2 x ZeRO-3, PP=2 x DP=2 (1F1B).

Per configuration it measures, after ``--warmup`` steps, the time of each of ``--steps`` steps on rank 0 (the steps
synchronise the ranks; tokens/s = global batch tokens / median step time, the wall time of the window is kept too),
then one more step inside a ``CommTracker`` window (bytes moved per rank,
split into data-parallel, tensor-parallel and pipeline traffic) with the state bytes per rank taken just before its
optimizer step, and finally each rank's peak RSS. Theory, for Ψ the parameters one rank's model-parallel part holds
(TP shard / pipeline stage) and N the data-parallel size, all fp32 (``32-true``):

- data-parallel bytes per rank and step (ZeRO paper Sec. 7, ring model): all-reduce 2·4Ψ(N-1)/N (DDP), reduce-scatter
  + all-gather 2·4Ψ(N-1)/N (ZeRO-1), all-gather twice + reduce-scatter 3·4Ψ(N-1)/N (FSDP / ZeRO-3);
- state bytes per rank (ZeRO paper Fig. 1, fp32 Adam: 4Ψ params + 4Ψ grads + 8Ψ moments): DDP 16Ψ, FSDP/ZeRO-3
  16Ψ/N; this package's ZeRO-1 frees the full gradient once it is reduce-scattered into its fp32 main shard, so at
  the optimizer step it holds 4Ψ + 16Ψ/N (the paper's ZeRO-1 formula 8Ψ + 8Ψ/N is listed too).

The formulas are ``lightning_flagscale.accounting.state_bytes``'s (``comm_theory_bytes``, ``expected_state_bytes``,
``zero_theory_bytes``), shared with ``tune`` and the tests. Tensor-parallel and pipeline traffic is reported as
measured (no ZeRO formula covers it). Timing is noisy on a shared machine: compare ratios within one run, never
across runs. Writes ``compare_strategies.json``, ``compare_strategies.md`` and ``compare_strategies.png`` under
``--out`` (``compare_report.py`` renders them).

A repository tool, not part of the installed package: run it from a checkout (``lightning-flagscale bench`` runs
this file when it finds it next to the package or in the current directory).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lightning_flagscale

from _procs import collect, context
from compare_options import SPECS, TARGETS, RunSpec, build_parser  # the options, importable without torch
from compare_report import chart, machine_info, markdown, mib, summarise  # bench/ is sys.path[0]
from profile_comm import comm_overlap

__all__ = ["SPECS", "TARGETS", "RunSpec", "main", "run_config"]


# ---------------------------------------------------------------------------------------------------------------------
# Model settings
# ---------------------------------------------------------------------------------------------------------------------


def model_settings(quick: bool) -> dict[str, Any]:
    """Decoder and data sizes: tens of millions of parameters by default, a few million with ``quick``."""
    if quick:
        model = dict(hidden_size=256, num_layers=4, intermediate_size=704, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)  # fmt: skip
        return {"model": model, "seq_len": 128, "global_batch": 8, "warmup": 2, "steps": 5}
    model = dict(hidden_size=512, num_layers=8, intermediate_size=1408, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=256)  # fmt: skip
    return {"model": model, "seq_len": 128, "global_batch": 8, "warmup": 3, "steps": 8}


# ---------------------------------------------------------------------------------------------------------------------
# Worker side (runs in each spawned process)
# ---------------------------------------------------------------------------------------------------------------------


def _modules():
    """LightningModule classes for the peers (built lazily: importing Lightning is slow and only workers need it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_flagscale.models import CausalLMModule
    from lightning_flagscale.models.decoder import CausalLM, DecoderBlock
    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    class EagerModule(CausalLMModule):
        """Builds and initialises the model on CPU (DDPStrategy / FSDPStrategy wrap a materialised module), with the
        same ``init_weights`` values as every other configuration."""

        def configure_model(self) -> None:
            if self.model is not None:
                return
            with torch.device("cpu"):
                self.model = CausalLM(self.config, vocab_multiple=64)
            self.init_weights()

    class FSDP1Module(CausalLMModule):
        """FSDPStrategy's manual-wrapping path: ``configure_model`` wraps each decoder block and the root in FSDP1
        (FULL_SHARD), and the strategy uses the wrapped model as is. Lightning's own auto-wrapping passes
        ``device_id=None`` on CPU, which FSDP1 rejects without an accelerator; here ``device_id`` is the CPU."""

        def configure_model(self) -> None:
            if self.model is not None:
                return
            with torch.device("cpu"):
                model = CausalLM(self.config, vocab_multiple=64)
            self.model = model
            self.init_weights()  # before sharding: FSDP1 flattens the initialised values
            self.psi_before_sharding = sum(p.numel() for p in model.parameters())  # FSDP1 leaves only shard views
            self.model = FullyShardedDataParallel(
                model, auto_wrap_policy=ModuleWrapPolicy({DecoderBlock}), device_id=torch.device("cpu"),
                sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
            )  # fmt: skip

    class TPFSDPModule(CausalLMModule):
        """ModelParallelStrategy's contract: ``configure_model`` parallelises on ``self.device_mesh`` itself
        (TP with the decoder's own plan, then FSDP2 per block and at the root, as torchtitan does)."""

        def configure_model(self) -> None:
            if self.model is not None:
                return
            mesh = self.device_mesh
            model = CausalLM(self.config, vocab_multiple=64)  # meta under ModelParallelStrategy's init context
            if mesh["tensor_parallel"].size() > 1:
                apply_tp(model, mesh["tensor_parallel"], sequence_parallel=False)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(model, mesh=mesh["data_parallel"])
            if any(p.is_meta for p in model.parameters()):
                model.to_empty(device="cpu")
            self.model = model
            self.init_weights()

    return EagerModule, FSDP1Module, TPFSDPModule


def _strategy(spec: RunSpec, dp: int, micro_batch_size: int, bucket_numel: int | None = None):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_flagscale import FlagScaleStrategy

    if spec.kind == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if spec.kind == "fsdp":

        class CPUFSDPStrategy(FSDPStrategy):
            """Lightning's FSDPStrategy unchanged: the Trainer refuses ``type(strategy) is FSDPStrategy`` without a
            GPU (the module wraps itself, see ``FSDP1Module``)."""

        return CPUFSDPStrategy(process_group_backend="gloo")
    if spec.kind == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=spec.tp, process_group_backend="gloo")
    return FlagScaleStrategy(
        tensor_parallel_size=spec.tp,
        pipeline_parallel_size=spec.pp,
        zero_stage=spec.zero_stage,  # type: ignore[arg-type]
        micro_batch_size=micro_batch_size,
        process_group_backend="gloo",
        overlap_grad_reduce=spec.overlap,
        overlap_param_gather=spec.param_gather,
        zero3_impl=spec.zero3_impl,  # type: ignore[arg-type]
        **({"grad_bucket_numel": bucket_numel} if bucket_numel else {}),
    )


def run_config(rank: int, world: int, port: int, spec: RunSpec, settings: dict[str, Any], queue: Any) -> None:
    """Train ``spec`` on this rank and put a small result dict on ``queue`` (spawn target)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)  # world processes share the machine's cores; one thread each, same for every config
    try:
        queue.put(_run(rank, world, spec, settings))
    except Exception as exc:  # report instead of hanging the parent
        import traceback

        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise


def _run(rank: int, world: int, spec: RunSpec, settings: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale.accounting.comm import CommTracker, traffic_class
    from lightning_flagscale.accounting.state_bytes import model_parallel_numel, peak_rss_bytes, state_bytes
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.data import LMDataModule
    from lightning_flagscale.models import CausalLMModule

    warmup, steps = settings["warmup"], settings["steps"]
    measured_step = warmup + steps
    dp = world // (spec.tp * spec.pp)
    per_rank_batch = settings["global_batch"] // dp
    tracker = CommTracker()
    out: dict[str, Any] = {"rank": rank}

    # Rank 0's last warm-up step is always profiled (exposed communication); the op table is written on request.
    profile_step = warmup - 1 if rank == 0 else -1
    profiler: list[Any] = []

    class Bench(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if step == profile_step:  # the last warm-up step: profiling never touches the timed window
                profiler.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
                profiler[0].__enter__()
            if step == warmup:
                dist.barrier()
                out["t0"] = time.perf_counter()
            elif step == measured_step:
                dist.barrier()
                out["t1"] = time.perf_counter()
            if warmup <= step <= measured_step:
                out.setdefault("marks", []).append(time.perf_counter())
            if step == measured_step:
                tracker.__enter__()
            previous = getattr(self, "phase", {}).get("end")
            self.phase = {"start": time.perf_counter()}
            if previous is not None and warmup < step < measured_step:
                self.phase["previous_end"] = previous

        def on_before_backward(self, trainer, pl_module, loss):
            self.phase.setdefault("backward", time.perf_counter())

        def on_after_backward(self, trainer, pl_module):
            self.phase["after_backward"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.phase["optimizer"] = time.perf_counter()
            if trainer.global_step == measured_step and "state" not in out:
                out["state"] = asdict(state_bytes(pl_module, [optimizer]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.phase["end"] = time.perf_counter()
            if warmup <= trainer.global_step - 1 < measured_step:  # a timed step (global_step counts it already)
                _record_phases(out, self.phase, self.phase["end"])
            if profiler and trainer.global_step == profile_step + 1:
                profiler[0].__exit__(None, None, None)
                prof = profiler.pop()
                out["overlap"] = comm_overlap(prof.events())
                if settings.get("profile_dir"):
                    path = Path(settings["profile_dir"]) / f"profile_{spec.name}.txt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
            if trainer.global_step == measured_step + 1:
                tracker.__exit__(None, None, None)

    config = TransformerConfig.from_preset("llama-tiny", **settings["model"])
    EagerModule, FSDP1Module, TPFSDPModule = _modules()
    cls = {"ddp": EagerModule, "fsdp": FSDP1Module, "model_parallel": TPFSDPModule}.get(spec.kind, CausalLMModule)
    module = cls(config, learning_rate=1e-3, warmup_steps=0)
    # PP: 1F1B over per_rank_batch micro-batches of one sample each (fills the 2-stage pipeline best).
    strategy = _strategy(spec, dp, 1 if spec.pp > 1 else per_rank_batch, settings.get("bucket"))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=measured_step + 1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Bench()],
    )  # fmt: skip
    dm = LMDataModule(seq_len=settings["seq_len"], batch_size=per_rank_batch,
                      num_train_samples=settings["global_batch"] * (measured_step + 2), num_val_samples=8)  # fmt: skip
    trainer.fit(module, dm)

    from torch.distributed.tensor import DTensor

    from lightning_flagscale.parallel.data_parallel.zero3_flat import summon_full_params

    model = module.model
    with summon_full_params(model):  # flat ZeRO-3 holds row ranges: count the parameters, not this rank's rows
        full = list({id(p): p for p in model.parameters()}.values())
        psi_local = model_parallel_numel(model)
    summary = tracker.summary()
    traffic: dict[str, float] = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    ops: dict[str, dict[str, float]] = {}
    for g in summary.values():
        for op, s in g["ops"].items():
            cls_ = traffic_class(g["desc"], op)
            traffic[cls_] += s["wire_bytes"]
            ops.setdefault(cls_, {}).setdefault(op, 0.0)
            ops[cls_][op] += s["wire_bytes"]
    out.update(
        dp=dp,
        psi_local=getattr(module, "psi_before_sharding", None) or psi_local,
        psi_stage_full=sum(p.shape.numel() if isinstance(p, DTensor) else p.numel() for p in full),
        traffic=traffic,
        ops=ops,
        groups={k: {"desc": v["desc"], "size": v["size"]} for k, v in summary.items()},
        peak_rss=peak_rss_bytes(),
        final_loss=float(trainer.callback_metrics.get("train_loss", float("nan"))),
    )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------


def _record_phases(out: dict[str, Any], t: dict[str, float], end: float) -> None:
    """Rank 0's phases of one step (``compare_report.PHASE_NAMES``) from the callback's timestamps."""
    backward = t.get("backward", t["start"])
    after = t.get("after_backward", backward)
    optimizer = t.get("optimizer", after)
    spans = {"forward": backward - t["start"], "backward": after - backward, "sync": optimizer - after,
             "optimizer": end - optimizer}  # fmt: skip
    if "previous_end" in t:
        spans["between"] = t["start"] - t["previous_end"]
    for name, value in spans.items():
        out.setdefault("phases", {}).setdefault(name, []).append(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: RunSpec, world: int, settings: dict[str, Any], timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Run ``spec`` on ``world`` fresh spawned processes; per-rank results sorted by rank."""

    ctx = context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=run_config, args=(r, world, port, spec, settings, queue)) for r in range(world)]
    for p in procs:
        p.start()
    # a rank that dies (killed, or before it can report) ends the run instead of leaving this one waiting
    results = collect(procs, queue, world, timeout=timeout, name=spec.name, failed=lambda res: "error" in res)
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{spec.name} failed on rank {errors[0]['rank']}:\n{errors[0]['traceback']}")
    return sorted(results, key=lambda r: r["rank"])


def write_report(args: Any, command: str, num_params: int, settings: dict, rows: list, failed: dict, rounds_done: int):
    """Ratios to peers, then the JSON, Markdown and PNG; called after every round, so a stopped run keeps its rounds
    (a subset, ``--only``, never overwrites the full comparison's files)."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if r["peer"] in by_name:
            r["ratio_to_peer"] = r["tokens_per_s"] / by_name[r["peer"]]["tokens_per_s"]
            print(f"{r['name']:14} {r['ratio_to_peer']:.2f}x {r['peer']}")
    report = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "world": args.world,
        "num_params": num_params,
        "settings": settings,
        "machine": machine_info(),
        "targets": TARGETS,
        "repeats": rounds_done,
        "notes": args.note,
        "rows": rows,
        "failed": failed,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "compare_strategies" + ("_quick" if args.quick else "") + ("_subset" if args.only else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=float))
    (out / f"{stem}.md").write_text(markdown(report))
    chart(report, out / f"{stem}.png")
    print(f"wrote {out / stem}.json, .md, .png")


def main(argv: list[str]) -> None:
    """Entry point of ``lightning-flagscale bench`` and ``bench/compare_strategies.py``."""
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    if args.render:
        path = Path(args.render)
        report = json.loads(path.read_text())
        report["notes"] = args.note or report.get("notes", [])
        path.write_text(json.dumps(report, indent=2, default=float))
        path.with_suffix(".md").write_text(markdown(report))
        chart(report, path.with_suffix(".png"))
        print(f"rewrote {path.with_suffix('.md')} and {path.with_suffix('.png')}")
        return
    if args.world % 4:
        parser.error(f"--world={args.world} must be a multiple of 4 (TP=2 x DP and PP=2 x DP configurations).")

    settings = model_settings(args.quick)
    if args.steps is not None:
        settings["steps"] = args.steps
    if args.warmup is not None:
        settings["warmup"] = args.warmup
    if settings["warmup"] < 1:
        parser.error("--warmup must be >= 1")
    if args.profile:
        settings["profile_dir"] = args.profile
    if args.bucket:
        settings["bucket"] = args.bucket
    specs = [s for s in SPECS if args.only is None or s.name in args.only]
    if args.only and len(specs) != len(args.only):
        parser.error(f"--only takes names from {[s.name for s in SPECS]}")

    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models.decoder import CausalLM

    with torch.device("meta"):
        num_params = sum(p.numel() for p in CausalLM(TransformerConfig.from_preset("llama-tiny", **settings["model"]),
                                                    vocab_multiple=64).parameters())  # fmt: skip
    flags = [("--quick", args.quick), (f"--repeats {args.repeats}", args.repeats > 1),
             (f"--steps {args.steps}", args.steps is not None), (f"--warmup {args.warmup}", args.warmup is not None),
             (f"--only {' '.join(args.only or [])}", args.only is not None)]  # fmt: skip
    command = " ".join(["lightning-flagscale bench", *(flag for flag, on in flags if on)])
    print(f"{command}: {num_params / 1e6:.1f}M params, world {args.world}, {settings}", flush=True)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    samples: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        # Rounds run every configuration once, in order, so a peer and its FlagScale counterpart see the same load.
        for spec in specs:
            if spec.name in failed:
                continue
            start = time.perf_counter()
            try:
                ranks = launch(spec, args.world, settings)
            except Exception as exc:  # one failing configuration must not lose the others' numbers
                print(f"{spec.name:14} FAILED: {exc}", flush=True)
                failed[spec.name] = str(exc).splitlines()[-1]
                continue
            row = summarise(spec, ranks, settings, args.world)
            samples.setdefault(spec.name, []).append(row["tokens_per_s"])
            if repeat == 0:
                rows.append(row)
            else:
                row = next(r for r in rows if r["name"] == spec.name)
            row["tokens_per_s_samples"] = samples[spec.name]
            row["tokens_per_s"] = statistics.median(samples[spec.name])
            merged = row.setdefault("phase_steps_s", {})  # rank 0's timed steps of every round
            for name, values in ranks[0].get("phases", {}).items():
                merged.setdefault(name, []).extend(values)
            print(f"{spec.name:14} {samples[spec.name][-1]:8.0f} tok/s  DP {mib(row['dp_bytes_per_rank'])} MiB/rank "
                  f"(x{row['dp_bytes_ratio']:.3f} theory)  TP {mib(row['tp_bytes_per_rank'])}  PP "
                  f"{mib(row['pp_bytes_per_rank'])}  state {mib(row['state_bytes_per_rank'])} MiB/rank "
                  f"(x{row['state_ratio']:.3f})  RSS {mib(row['peak_rss_max'])} MiB  loss {row['final_loss']:.3f}  "
                  f"[{time.perf_counter() - start:.0f}s]", flush=True)  # fmt: skip
        write_report(args, command, num_params, settings, rows, failed, repeat + 1)  # after every round


if __name__ == "__main__":
    main(sys.argv[1:])
