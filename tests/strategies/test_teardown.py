"""Teardown gives everything back (issue 37 item 1): after ``Trainer.fit`` returns and the caller drops the trainer
and the module, nothing of the run stays alive, under every layout; and fits that follow in the same process train as
they would in a fresh one.

Before the fix the gradient hooks ZeRO-0/1/2 register on every parameter held their reducer, which held the
parameters: a cycle through C++ tensor hooks that ``gc`` cannot see, so module, parameters and optimizer survived
``del trainer, module`` and ``gc.collect()`` (on a GPU, every fit's weights and states stayed allocated).

What the strategy holds itself is given back in ``teardown``: the watchdog thread is stopped and joined, the module is
moved to the CPU (``.cpu()``, as Lightning's ``Strategy.teardown`` does) with the optimizer state, and so is what our
ZeRO holds outside both: the main (fp32 master) slices of DDP / ZeRO-1/2 and flat ZeRO-3's shards move to the CPU and
the gradient buckets are freed (they stayed on the device while the caller held the module); a ``save_checkpoint``
after ``fit`` brings them back for the write and returns them. On a CPU run the moves are no-ops, so spies record
them, as they record ``.cpu()``. The groups of the
run's meshes serve every later run with the same layout (a repeated layout creates none), and its other groups (here
the asynchronous checkpoint writer's and the pipeline's tied-weight group) are destroyed when the next run on another
module starts; both stay while the fitted module can use them (``full_tensor()``, ``trainer.save_checkpoint`` after
``fit``; ``strategies/_plumbing.py`` says why meshes are not destroyed). On a GPU,
``test_gpu_fits_give_memory_back`` measures what the CPU cannot: the device memory after each fit."""

from __future__ import annotations

import gc
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.strategies._lm import (
    GLOBAL_BATCH,
    TokenDataset,
    assert_rel_close,
    make_module,
    reference_run,
    tiny_config,
)

STEPS = 2


def _spy_cpu(module: torch.nn.Module, calls: list[str]) -> None:
    """Record each ``module.cpu()`` (the move itself is a no-op on a CPU run); holds the module weakly."""
    ref, cpu = weakref.ref(module), type(module).cpu

    def spy():
        calls.append("cpu")
        return cpu(ref())

    module.cpu = spy


def _spy_method(obj: Any, name: str, calls: list[str]) -> None:
    """Record each ``obj.<name>(*args)`` call as ``"<name> <args>"``; holds ``obj`` weakly."""
    ref, method = weakref.ref(obj), getattr(type(obj), name)

    def spy(*args):
        calls.append(" ".join([name, *map(str, args)]))
        return method(ref(), *args)

    setattr(obj, name, spy)


def _zero_holders(strategy: Any, module: torch.nn.Module) -> list[tuple[str, Any]]:
    """What our ZeRO holds besides module and optimizer state: each ``DistributedOptimizer`` (DDP, ZeRO-1/2: gradient
    buckets, main slices) and each flat ZeRO-3 part (flat shards, gather buffers)."""
    from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer
    from lightning_flagscale.parallel.data_parallel.zero3_flat import find_flat_zero3

    holders = [("dopt", d) for d in strategy._dist_optimizers.values() if isinstance(d, DistributedOptimizer)]
    return holders + [("flat", part) for part in find_flat_zero3(module)]


def _still_held(holders: list[tuple[str, Any]]) -> list[str]:
    """The buffers teardown frees that the holders still hold (what stays is moved, as the spies record)."""
    held = []
    for kind, holder in holders:
        if kind == "dopt":
            held += [f"bucket {i} gradients" for i, b in enumerate(holder.buckets) if b.buffer is not None]
            held += [f"bucket {i} main .grad" for i, b in enumerate(holder.buckets)
                     if b.main_param is not None and b.main_param.grad is not None]  # fmt: skip
        else:
            for unit in holder.units:
                if unit.full.untyped_storage().nbytes() or unit.leaf is not None or unit.grad_acc is not None:
                    held.append(f"flat unit {unit.index} gathered buffers")
    return held


def _fit_and_drop(
    strategy_kwargs: dict[str, Any],
    config_overrides: dict[str, Any],
    steps: int,
    keep_params: bool,
    save_after_fit: bool = False,
) -> dict[str, Any]:
    """Fit, drop every reference the caller holds, collect; returns what is still alive, the groups this fit created
    (``group_name``s, still registered), its module's ``.cpu()`` calls, the devices of its optimizer state, the
    flagscale threads still running and (``keep_params``) the full parameters after training. ``zero_moves``: per
    holder of ``_zero_holders`` its moves from the end of training on (teardown; with ``save_after_fit``, then a
    ``trainer.save_checkpoint`` on the path an accelerator takes: back to the device, written, back to the CPU);
    ``zero_held``: what teardown should have freed."""
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScaleStrategy
    from lightning_flagscale.strategies._plumbing import live_groups
    from tests.strategies._lora import full_params

    world = dist.get_world_size()
    config = tiny_config(**config_overrides)
    torch.manual_seed(0)
    module = make_module(config)
    calls: list[str] = []
    _spy_cpu(module, calls)
    strategy = FlagScaleStrategy(**strategy_kwargs)
    moves: list[tuple[str, list[str]]] = []
    holders: list[tuple[str, Any]] = []

    class SpyZeroMoves(L.Callback):
        def on_train_end(self, trainer, pl_module):  # before the strategy's teardown
            holders.extend(_zero_holders(trainer.strategy, pl_module))
            for kind, holder in holders:
                moves.append((kind, []))
                for name in ("release_grads", "to") if kind == "dopt" else ("to",):
                    _spy_method(holder, name, moves[-1][1])

    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[SpyZeroMoves()],
    )  # fmt: skip
    dp = strategy.parallel.data_parallel_size or world // strategy.parallel.model_parallel_size
    batch = GLOBAL_BATCH if strategy.parallel.hetero_enabled else GLOBAL_BATCH // dp  # hetero: the first mesh's DP is 1
    before = set(live_groups())
    trainer.fit(module, DataLoader(TokenDataset(config.vocab_size), batch_size=batch))
    result: dict[str, Any] = {
        "groups": [pg.group_name for pg in live_groups() if pg not in before],
        "cpu_calls": list(calls),
        "state_devices": sorted(
            {
                str(v.device)
                for o in trainer.optimizers
                for s in o.state.values()
                for v in s.values()
                if torch.is_tensor(v)
            }
        ),
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("flagscale")],
        "params": full_params(module.model) if keep_params else None,  # the groups still serve the fitted module
        "zero_held": _still_held(holders),
        "zero_moves": moves,
        "pipeline_held": _pipeline_held(trainer.strategy),
    }
    if save_after_fit:  # as after a fit on an accelerator (a CPU run is never offloaded): moved back, saved, offloaded
        strategy._offloaded = True
        folder = tempfile.mkdtemp()
        trainer.save_checkpoint(Path(folder) / "after-fit")  # rank 0's path (the strategy broadcasts it)
        dist.barrier()
        shutil.rmtree(folder)
        result["zero_held_after_save"] = _still_held(holders)
    holders.clear()
    refs = {"module": weakref.ref(module), "strategy": weakref.ref(strategy)}
    refs.update({f"optimizer {i}": weakref.ref(o) for i, o in enumerate(trainer.optimizers)})
    refs.update({f"parameter {n}": weakref.ref(p) for n, p in module.model.named_parameters()})
    del trainer, module, strategy
    gc.collect()
    result["alive"] = sorted(name for name, ref in refs.items() if ref() is not None)
    return result


def _pipeline_held(strategy: Any) -> list[str]:
    """What the pipeline runner still holds after ``fit`` besides the module: cached schedules (their stages' receive
    buffers for every micro-batch, forward caches, output chunks) and, across meshes, the last step's activations and
    hand-overs; ``release_buffers`` drops them in teardown."""
    pipeline = strategy._pipeline
    if pipeline is None:
        return []
    runner = pipeline.runner
    held = [f"schedule {key}" for key in getattr(runner, "_schedules", {})]
    held += [
        f"{name}: {len(getattr(runner, name))}"
        for name in ("_saved", "_weight_work", "_local")
        if getattr(runner, name, None)
    ]
    return held + [name for name in ("_num_items", "stat") if torch.is_tensor(getattr(runner, name, None))]


LAYOUTS_2 = {
    "ddp": dict(zero_stage=0),
    "zero1": dict(zero_stage=1, async_checkpoint=True),  # the writer's own gloo group, destroyed by the next fit
    "zero2": dict(zero_stage=2),
    "zero3-flat": dict(zero_stage=3, zero3_impl="flat"),
    "zero3-fsdp2": dict(zero_stage=3, zero3_impl="fsdp2"),
    "tp2": dict(tensor_parallel_size=2, sequence_parallel=True),
    "pp2": (  # tied: the embedding's two copies get their own group
        dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", micro_batch_size=1),
        dict(tie_word_embeddings=True),
    ),
    "cp2": dict(context_parallel_size=2),
    "hetero-dp": dict(hetero_dp_batch_sizes=[3, 1]),
    "ep2": (dict(expert_parallel_size=2), dict(num_experts=4, num_experts_per_tok=2)),
}
# The layouts whose weights are compared with one process (every name as in the single-process model, same data split).
COMPARED = ("ddp", "zero1", "zero2", "zero3-flat", "zero3-fsdp2", "tp2", "cp2")
# Layouts whose meshes an earlier one in the list built (PP x DP x CP x TP = 1 x 2 x 1 x 1 like "ddp").
REUSE_MESHES = ("zero1", "zero2", "zero3-flat", "zero3-fsdp2", "hetero-dp")
# What our ZeRO holds besides module and optimizer state, per layout (FSDP2 keeps its shards in the module).
ZERO_HOLDERS = {"ddp": ["dopt"], "zero1": ["dopt"], "zero2": ["dopt"], "zero3-flat": ["flat"], "zero3-fsdp2": []}
# Teardown: the gradient buckets freed and the main slices moved to the CPU; the flat ZeRO-3 shards moved there.
TEARDOWN_MOVES = {"dopt": ["release_grads", "to cpu"], "flat": ["to cpu"]}
# A save after fit (on an accelerator): back to the device (here the CPU), written, offloaded again.
SAVE_MOVES = {"dopt": ["to cpu", "release_grads", "to cpu"], "flat": ["to cpu", "to cpu"]}
SAVED_AFTER_FIT = ("zero1", "zero2", "zero3-flat")


def _all_layouts(
    layouts: dict[str, tuple[dict[str, Any], dict[str, Any]]],
    steps: int,
    compared: tuple[str, ...] = (),
    saved: tuple[str, ...] = (),
) -> dict[str, dict[str, Any]]:
    """One after the other in the same processes: each fit starts after the previous one's teardown. Adds to each
    result the groups of earlier fits still registered after it that are no mesh's (``stale``), the mesh groups it
    created (``new_mesh``), and, at the end, the groups created and alive that are neither a mesh's nor the last fit's.
    """
    from lightning_flagscale.strategies._plumbing import live_groups, mesh_groups

    initial = {pg.group_name for pg in live_groups()}  # the world's, and what earlier tasks left in this worker
    results, earlier = {}, set()
    for name, (kwargs, overrides) in layouts.items():
        results[name] = _fit_and_drop(
            kwargs, overrides, steps, keep_params=name in compared, save_after_fit=name in saved
        )
        live = {pg.group_name for pg in live_groups()}
        meshes = {pg.group_name for pg in mesh_groups()}
        results[name]["stale"] = sorted((earlier & live) - meshes)
        results[name]["new_mesh"] = sorted(set(results[name]["groups"]) & meshes)
        results[name]["non_mesh"] = sorted(set(results[name]["groups"]) - meshes)
        earlier |= set(results[name]["groups"])
    last = results[name]["groups"]
    end = {pg.group_name for pg in live_groups()} - initial - {pg.group_name for pg in mesh_groups()} - set(last)
    results["__end__"] = {"extra": sorted(end)}
    return results


def _check_teardown(
    results: list[dict[str, dict[str, Any]]], layouts: dict[str, Any], reuse: tuple[str, ...], retired: tuple[str, ...]
) -> None:
    """``reuse``: layouts that must create no mesh group; ``retired``: layouts that must create a group of their own,
    which the next fit destroys (else the ``stale`` check would prove nothing)."""
    for rank, by_layout in enumerate(results):
        for name in layouts:
            got = by_layout[name]
            where = f"rank {rank} {name}"
            assert got["alive"] == [], f"{where}: still alive after del + gc: {got['alive']}"
            assert got["stale"] == [], f"{where}: earlier fits' groups still registered: {got['stale']}"
            if name in reuse:
                assert got["new_mesh"] == [], f"{where}: a layout seen before built new mesh groups {got['new_mesh']}"
            if name in retired:
                assert got["non_mesh"], f"{where}: created no group of its own"
            assert got["cpu_calls"] == ["cpu"], f"{where}: teardown did not move the module to the CPU once"
            assert got["state_devices"] in ([], ["cpu"]), f"{where}: optimizer state on {got['state_devices']}"
            assert got["threads"] == [], f"{where}: threads still running after fit: {got['threads']}"
            if name in ZERO_HOLDERS:
                kinds = [kind for kind, _ in got["zero_moves"]]
                assert kinds == ZERO_HOLDERS[name], f"{where}: ZeRO holders {kinds}"
            for kind, moves in got["zero_moves"]:
                want = TEARDOWN_MOVES[kind] + (SAVE_MOVES[kind] if "zero_held_after_save" in got else [])
                assert moves == want, f"{where}: {kind} moved {moves}, not {want}"
            assert got["zero_held"] == [], f"{where}: teardown left {got['zero_held']}"
            assert got["pipeline_held"] == [], f"{where}: the pipeline runner still holds {got['pipeline_held']}"
            assert got.get("zero_held_after_save", []) == [], f"{where}: after the save {got['zero_held_after_save']}"
        extra = by_layout["__end__"]["extra"]
        assert not extra, f"rank {rank}: groups alive besides the meshes' and the last fit's: {extra}"


def test_fit_leaves_nothing_alive_under_every_layout(launcher):
    layouts = {name: v if isinstance(v, tuple) else (v, {}) for name, v in LAYOUTS_2.items()}
    results = launcher(2, _all_layouts, layouts, STEPS, COMPARED, SAVED_AFTER_FIT)
    _check_teardown(results, layouts, reuse=REUSE_MESHES, retired=("zero1", "pp2"))
    for rank, by_layout in enumerate(results):
        assert all("zero_held_after_save" in by_layout[name] for name in SAVED_AFTER_FIT), f"rank {rank}: not saved"
    # Every compared fit after the first ran on groups created after the previous fit's were destroyed.
    _, ref_params = reference_run(tiny_config(), STEPS)
    for rank, by_layout in enumerate(results):
        for name in COMPARED:
            params = by_layout[name]["params"]
            assert set(params) == set(ref_params), f"rank {rank} {name}: parameter names"
            for key, value in params.items():
                assert_rel_close(value, ref_params[key], 1e-5, f"rank {rank} {name} {key}")


def test_fit_leaves_nothing_alive_with_hetero_meshes(launcher):
    meshes = [dict(tensor_parallel_size=2, data_parallel_size=1), dict(data_parallel_size=2)]
    layouts = {
        "hetero-meshes": (dict(hetero_meshes=meshes, hetero_layers=[1, 1], micro_batch_size=2), {}),
        "hetero-meshes-again": (dict(hetero_meshes=meshes, hetero_layers=[1, 1], micro_batch_size=2), {}),
    }
    results = launcher(4, _all_layouts, layouts, STEPS)
    _check_teardown(results, layouts, reuse=("hetero-meshes-again",), retired=())


def _reuse_strategy_with_checkpoint_group() -> list[str]:
    """One Trainer (so one strategy), two fits on two modules; each run asks for the checkpoint writer's group as
    ``MemoryCheckpoint`` does (``ensure_checkpoint_group``, during training) and uses it. The second run's set-up
    destroys the first run's group, so the strategy must not hand it out again."""
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScaleStrategy

    used = []

    class UseCheckpointGroup(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.ensure_checkpoint_group()
            dist.barrier(group=trainer.strategy._checkpoint_group)
            used.append(trainer.strategy._checkpoint_group.group_name)

    config = tiny_config()
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=FlagScaleStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[UseCheckpointGroup()],
    )  # fmt: skip
    for fit in range(2):
        torch.manual_seed(0)
        trainer.fit_loop.epoch_loop.max_steps = fit + 1  # the Trainer's step count goes on from the first fit
        trainer.fit(make_module(config), DataLoader(TokenDataset(config.vocab_size), batch_size=GLOBAL_BATCH // 2))
    return used


def test_a_strategy_reused_on_another_module_gets_a_live_checkpoint_group(launcher):
    for rank, used in enumerate(launcher(2, _reuse_strategy_with_checkpoint_group)):
        assert len(used) == 2 and used[0] != used[1], f"rank {rank}: checkpoint groups {used}"


MIB = 1 << 20


@pytest.mark.gpu
def test_gpu_fits_give_memory_back(tmp_path):
    """On a GPU (issue 37 item 1): right after each ``fit``, with module and trainer still held, the module's weights
    and the optimizer's state are on the CPU, and so are the ZeRO main slices and flat shards (the device holds no
    more than before the fit, 64 MiB of slack); ``trainer.save_checkpoint`` after ``fit`` still writes (and gives the
    device back again); after ``del`` the allocated memory of every fit equals the first's within 64 MiB (it grew by
    12.5 GiB per fit before)."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_flagscale import FlagScaleStrategy

    config = tiny_config(
        num_layers=4,
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    )  # fmt: skip  (~74M parameters: 300 MB of fp32 weights, several times the 64 MiB slack; 0.9 GiB in AdamW)
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    after_del = []
    layouts = [dict(zero_stage=1), dict(zero_stage=2)] + [dict(zero_stage=3, zero3_impl=i) for i in ("flat", "fsdp2")]
    for i, layout in enumerate([dict(), *layouts, dict()]):
        torch.manual_seed(0)
        module = make_module(config, "adamw")
        trainer = L.Trainer(
            accelerator="gpu", devices=1, strategy=FlagScaleStrategy(**layout), max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(module, DataLoader(TokenDataset(config.vocab_size, seq=128), batch_size=2))
        local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
        assert {p.device.type for p in local} == {"cpu"}, f"fit {i} {layout}: module left on the device"
        states = {v.device.type for o in trainer.optimizers for s in o.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0}  # fmt: skip
        assert states <= {"cpu"}, f"fit {i} {layout}: optimizer state on {states}"
        held = torch.cuda.memory_allocated() - start
        assert held <= 64 * MIB, f"fit {i} {layout}: {held / MIB:.0f} MiB still on the device with the module held"
        if layout.get("zero_stage") in (1, 2) or layout.get("zero3_impl") == "flat":  # state our ZeRO holds itself
            trainer.save_checkpoint(tmp_path / f"fit{i}")
            assert (tmp_path / f"fit{i}").is_dir()
            held = torch.cuda.memory_allocated() - start
            assert held <= 64 * MIB, f"fit {i} {layout}: {held / MIB:.0f} MiB on the device after the post-fit save"
        del trainer, module
        gc.collect()
        torch.cuda.empty_cache()
        after_del.append(torch.cuda.memory_allocated())
    assert max(after_del) - after_del[0] <= 64 * MIB, [f"{(a - start) / MIB:.0f} MiB" for a in after_del]
