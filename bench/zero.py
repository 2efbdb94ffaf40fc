"""Bytes moved and state bytes held per rank for one training step of each data-parallel layout, next to theory.

    python bench/zero.py [--world 4] [--precision bf16-mixed] [--preset llama-tiny] [--json bench/results/zero.json]

Runs ``Trainer.fit`` with ``FlagScaleStrategy`` on ``--world`` CPU processes (gloo) for DDP, ZeRO-1, ZeRO-2 and
ZeRO-3. For the third optimizer step (Adam states exist by then) it records every collective with
``CommTracker`` and, just before the optimizer step, the bytes of parameters, gradients, master weights and
optimizer states held by the rank. Theory:

- bytes moved (ZeRO paper, Ψ parameters, N ranks, per rank): DDP and ZeRO-1/2 2Ψ(N-1)/N, ZeRO-3 3Ψ(N-1)/N, each
  term in the dtype that is actually sent (our gradient reductions are fp32 whatever the parameter dtype);
- state bytes: the paper's bf16 layout (DDP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N) and the layout
  this package uses (fp32 gradient buckets instead of bf16 gradients: ZeRO-1 keeps the full buckets, ZeRO-2 only
  its fp32 shard; see ``parallel/data_parallel/grad_buckets.py`` and ``accounting.state_bytes.expected_state_bytes``);
- gradient bytes at the backward peak: stages 0-1 hold their full fp32 buckets, ZeRO-2 its fp32 shard plus the
  staging buckets alive at once (measured by the reducer, at most two buckets of ``--bucket`` elements).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _procs import collect, context  # bench/ is sys.path[0]

MEASURED_STEP = 2  # 0-based: the third optimizer step


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from lightning_flagscale.accounting.comm import CommTracker, gather_summaries, merge_summaries
    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.data import LMDataModule
    from lightning_flagscale.models import CausalLMModule

    dist.init_process_group("gloo")
    results = []
    for stage in args.stages:
        tracker = CommTracker()
        measured: dict = {}
        peak: dict = {}

        class Measure(L.Callback):
            def __init__(self, tracker: CommTracker, measured: dict, peak: dict) -> None:
                self.tracker, self.measured, self.peak = tracker, measured, peak

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == MEASURED_STEP:
                    self.tracker.__enter__()

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                if trainer.global_step == MEASURED_STEP:
                    s = state_bytes(pl_module, [optimizer])
                    self.measured.update(params=s.params, grads=s.grads, master=s.master_params,
                                    optimizer=s.optimizer_states)  # fmt: skip
                    dopts = list(trainer.strategy._dist_optimizers.values())
                    staging = 4 * max((d.reducer.peak_staging_numel for d in dopts), default=0)
                    bucket = max((b.padded for d in dopts for b in d.buckets), default=0)
                    self.peak.update(grad_peak=s.grads + staging, bucket=bucket)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == MEASURED_STEP + 1:
                    self.tracker.__exit__(None, None, None)

        config = TransformerConfig.from_preset(args.preset)
        module = CausalLMModule(config, learning_rate=1e-3, warmup_steps=0)
        trainer = L.Trainer(
            accelerator="cpu", devices=world,
            strategy=FlagScaleStrategy(zero_stage=stage, grad_bucket_numel=args.bucket),
            plugins=[FlagScalePrecision(args.precision)], max_steps=MEASURED_STEP + 1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[Measure(tracker, measured, peak)],
        )  # fmt: skip
        dm = LMDataModule(seq_len=64, batch_size=2, num_train_samples=64, num_val_samples=8)
        trainer.fit(module, dm)
        psi = sum(p.numel() for p in module.model.parameters()) if stage < 3 else None
        if stage == 3:
            from torch.distributed.tensor import DTensor

            psi = sum(p.numel() if not isinstance(p, DTensor) else p.shape.numel() for p in module.model.parameters())
        merged = merge_summaries(gather_summaries(tracker))
        dp_bytes = (
            sum(op["wire_bytes"] for g in merged.values() if g["size"] == world for op in g["ops"].values()) / world
        )
        results.append({"stage": stage, "psi": psi, "wire_bytes_per_rank": dp_bytes, "state": measured, **peak,
                        "ops": {name: {op: v["wire_bytes"] / world for op, v in g["ops"].items()}
                                for name, g in merged.items() if g["size"] == world}})  # fmt: skip
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--precision", default="bf16-mixed", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--bucket", type=int, default=1 << 16, help="grad_bucket_numel (elements per bucket)")
    parser.add_argument("--json", default="bench/results/zero.json")
    args = parser.parse_args()

    from lightning_flagscale.accounting.state_bytes import comm_theory_bytes, expected_state_bytes, zero_theory_bytes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    (results,) = collect(procs, queue, 1, name="zero")

    n = args.world
    half = args.precision != "32-true"
    param_b = 2 if half else 4
    rows = []
    print(f"world={n} precision={args.precision} preset={args.preset}  (bytes per rank, one optimizer step)")
    print(f"{'layout':8} {'moved':>12} {'theory':>12} {'ratio':>6} | {'state':>12} {'ours-theory':>12} {'ratio':>6}"
          f" {'paper-theory':>13} | {'grad peak':>10} {'theory':>10}")  # fmt: skip
    for r in results:
        stage, psi = r["stage"], r["psi"]
        comm = comm_theory_bytes(param_b * psi, n, stage, grad_bytes=4 * psi).total
        t = expected_state_bytes(psi, n, stage, args.precision)  # at the optimizer step, this package's layout
        ours = {"params": t.params, "grads": t.grads, "master": t.master_params, "optimizer": t.optimizer_states}
        paper = zero_theory_bytes(psi, n, stage, "bf16-master" if half else "fp32").total
        state = sum(r["state"].values())
        name = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"][stage]
        peak_theory = expected_state_bytes(psi, n, stage, args.precision, when="backward_peak",
                                           bucket_numel=r.get("bucket") or args.bucket).grads  # fmt: skip
        peak = r.get("grad_peak", float("nan")) if stage < 3 else float("nan")  # FSDP2's peak is not tracked here
        print(f"{name:8} {r['wire_bytes_per_rank']:12.0f} {comm:12.0f} {r['wire_bytes_per_rank'] / comm:6.3f} |"
              f" {state:12.0f} {sum(ours.values()):12.0f} {state / sum(ours.values()):6.3f} {paper:13.0f} |"
              f" {peak:10.0f} {peak_theory:10.0f}")  # fmt: skip
        rows.append({**r, "name": name, "comm_theory": comm, "state_theory_ours": ours, "state_theory_paper": paper,
                     "grad_peak_theory": peak_theory})  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"world": n, "precision": args.precision, "torch": torch.__version__, "rows": rows},
                              indent=2, default=float))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
