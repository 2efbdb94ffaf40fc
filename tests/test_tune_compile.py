"""The tuner's memory model under ``torch_compile`` (issue 37, item 4): what a compiled block and the compiled loss
hand from their forward to their backward, counted on CPU, equals ``tune.activations``' compiled formulas to the
byte, and ``memory_breakdown`` reads ``ParallelConfig.torch_compile``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.parallel.compile import apply_compile
from lightning_flagscale.parallel.pipeline_parallel.recompute import RECOMPUTE_MODES, apply_recompute
from lightning_flagscale.tune.activations import head_bytes, layer_activation_bytes, model_edge_bytes
from lightning_flagscale.tune.measure import AllocationPeak, SavedActivations
from lightning_flagscale.tune.memory_model import memory_breakdown
from tests._dynamo import fresh_dynamo

SHAPE = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)
BATCH, SEQ = 2, 64


class _ByPart(SavedActivations):
    """``SavedActivations`` that also books each new storage to the part of the model running (``part``)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.part = "edge"
        self.by_part: Counter = Counter()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        before = self.total_bytes
        out = super()._pack(t)
        self.by_part[self.part] += self.total_bytes - before
        return out


@pytest.fixture(scope="module")
def compiled_run():
    """One bf16 model whose block ``i`` runs compiled under recompute mode ``RECOMPUTE_MODES[i]`` (one compile per
    mode, one of the loss), run part by part as ``CausalLM.run_layers`` runs it: saved bytes per part, and the
    allocator's peak during the compiled loss's backward."""
    fresh_dynamo()
    torch.manual_seed(0)
    config = TransformerConfig(**SHAPE, num_layers=len(RECOMPUTE_MODES))
    model = CausalLM(config, vocab_multiple=64).to(torch.bfloat16)
    for mode, block in zip(RECOMPUTE_MODES, model.layers.values(), strict=True):
        apply_recompute(model, mode, blocks=[block])
    apply_compile(model)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g) for _ in range(2))  # two storages
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    for _ in range(2):  # the first call compiles; the second is counted
        by_part, _, backward_peak = _counted_pass(model, RECOMPUTE_MODES, x, y, positions)
    return config, by_part, backward_peak


def _counted_pass(model, modes, x, y, positions) -> tuple[dict, int, int]:
    """One forward of ``model`` (block ``i`` under ``modes[i]``) run part by part as ``CausalLM.run_layers`` runs
    it, and the loss's backward alone: saved bytes per part, the loss forward's transient (its allocator peak above
    what it leaves allocated) and the loss backward's allocator peak."""
    with _ByPart(model.parameters()) as saved:
        h = model.embed_tokens(x)
        cos, sin = model.rotary_emb(positions, torch.bfloat16)
        for table in (cos, sin):  # every block saves the RoPE tables: counted once, with the edge
            saved._pack(table)
        for mode, block in zip(modes, model.layers.values(), strict=True):
            saved.part = mode
            h = block(h, cos, sin)
        saved.part = "head"
        logits = model.lm_head(model.norm(h))
        with AllocationPeak() as forward:
            loss = model.loss_fn(logits, y)
    with AllocationPeak() as backward:
        (grad,) = torch.autograd.grad(loss, logits)  # the compiled loss's backward alone
    del loss, grad, logits, h
    return dict(saved.by_part), forward.peak_bytes - forward.net_bytes, backward.peak_bytes


def test_compiled_blocks_keep_what_the_model_says(compiled_run):
    """Per recompute mode, a compiled block keeps (to the byte) its input, the norms' statistics and outputs and the
    matmul / attention outputs its backward reads, no fp32 norm copies (``none``); the selective modes drop the
    down projection's output, which backward never reads; ``full`` the input and the RNG state."""
    config, by_part, _ = compiled_run
    tokens = BATCH * SEQ
    for mode in RECOMPUTE_MODES:
        kept, _ = layer_activation_bytes(config, tokens, act_bytes=2, recompute=mode, compiled=True)
        assert by_part[mode] == kept, mode
        eager, _ = layer_activation_bytes(config, tokens, act_bytes=2, recompute=mode)
        assert kept == eager if mode == "full" else kept < eager, mode
    assert by_part["edge"] == model_edge_bytes(config, tokens, act_bytes=2)


def test_compiled_loss_keeps_the_logits_in_the_model_dtype(compiled_run):
    """The final norm, the LM head's input and the compiled loss's saved tensors (the logits, padded columns
    included, in bf16; targets, row max, log-sum-exp, label count) to the byte; its backward allocates the logits'
    bf16 gradient and per-token sums, no fp32 ``[tokens, vocab]`` tensor (the eager loss's two)."""
    config, by_part, backward_peak = compiled_run
    tokens = BATCH * SEQ
    head = head_bytes(config, tokens, padded_vocab=config.padded_vocab_size(64), act_bytes=2, compiled=True)
    assert by_part["head"] == head.saved
    eager = head_bytes(config, tokens, padded_vocab=config.padded_vocab_size(64), act_bytes=2)
    assert head.saved < eager.saved and head.backward_transient < eager.backward_transient
    assert head.backward_transient <= backward_peak <= head.backward_transient + tokens * 8  # + [tokens, 1] fp32 x 2


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_memory_breakdown_reads_torch_compile(compiled_run, mode):
    """``memory_breakdown`` of a compiled layout: its activations are the measured edge, blocks and head, and the
    loss's transient is the bf16 logits' gradient (the eager model's fp32 ones would be 4x and 2x larger)."""
    config, by_part, _ = compiled_run
    layout = ParallelConfig(recompute=mode, micro_batch_size=BATCH, torch_compile=True).resolve(1)
    rank = memory_breakdown(config, layout, SEQ, 1).heaviest
    measured = by_part["edge"] + config.num_layers * by_part[mode] + by_part["head"]
    assert rank.activations == measured
    assert rank.transient == max(
        BATCH * SEQ * 2 * config.padded_vocab_size(64),
        layer_activation_bytes(config, BATCH * SEQ, recompute=mode, compiled=True)[1] - by_part[mode],
    )


def test_compiled_memory_model_under_context_parallelism():
    """Ring CP: the compiled formulas without recompute and under ``full``; under the selective modes the ring's
    graph break runs the checkpoint eagerly, priced as the eager block (both measured on 2 gloo ranks, not here:
    one more multi-process launch). Ulysses is refused."""
    config = TransformerConfig(**SHAPE, num_layers=2)

    def activations(mode: str, compiled: bool, cp_mode: str = "ring") -> float:
        layout = ParallelConfig(recompute=mode, context_parallel_size=2, context_parallel_mode=cp_mode,
                                torch_compile=compiled).resolve(2)  # fmt: skip
        return memory_breakdown(config, layout, SEQ, 1).heaviest.activations

    head = head_bytes(config, SEQ / 2, padded_vocab=config.padded_vocab_size(64), compiled=True).saved
    eager_head = head_bytes(config, SEQ / 2, padded_vocab=config.padded_vocab_size(64)).saved
    for mode in RECOMPUTE_MODES:
        compiled, eager = activations(mode, True) - head, activations(mode, False) - eager_head
        if mode in ("selective", "selective_mm"):
            assert compiled == eager, mode
        else:
            layer = layer_activation_bytes(config, SEQ / 2, recompute=mode, compiled=True)[0]
            assert compiled == model_edge_bytes(config, SEQ / 2) + 2 * layer, mode
    with pytest.raises(ValueError, match="context_parallel_mode='ring'"):
        activations("none", True, "ulysses")


# sequence parallel -> one compiled block per recompute mode: every branch of the compiled formula under TP with
# and without SP (each compile costs ~1.2 s; nosp selective and SP selective_mm, whose terms these cover, were
# counted the same way by hand and matched to the byte). "full" with TP (checkpoint eager around the compiled body) is
# not measured: refused.
TP_CASES = {False: ("none", "selective_mm"), True: ("none", "selective")}


def _tp_compiled_bytes(cases: dict) -> dict:
    """On this rank of TP 2, per sequence-parallel setting ``sp`` of ``cases``: saved bytes per part of one bf16 model
    whose block ``i`` runs compiled under ``cases[sp][i]`` (as ``compiled_run``), and the compiled loss's allocator
    peaks: forward (above what it leaves allocated) and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    fresh_dynamo()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    out = {}
    for sp, modes in cases.items():
        with torch.device("meta"):
            model = CausalLM(TransformerConfig(**SHAPE, num_layers=len(modes)), vocab_multiple=64)
        apply_tp(model, mesh, sequence_parallel=sp)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        model.to(torch.bfloat16)
        for mode, block in zip(modes, model.layers.values(), strict=True):
            apply_recompute(model, mode, blocks=[block])
        apply_compile(model)
        out[sp] = _counted_pass(model, modes, x, y, positions)  # one call: it compiles, then runs what it compiled
    return out


def test_compiled_memory_model_under_tensor_parallelism(launcher):
    """TP 2 with and without SP, measured on 2 gloo ranks: each rank's compiled blocks keep, to the byte, their input
    (SP: the sequence chunk), the norms' statistics, the column-parallel projections' (gathered) input whole, q/k/v,
    SDPA out + lse and the gate/up/SwiGLU outputs 1/tp wide, the o projection's reduced output (SP: on the chunk;
    kept by selective_mm too, as a collective's output); the compiled vocab-parallel loss keeps its fp32 gradient
    factor [tokens, V/t], the label mask and count, its backward the logits' bf16 gradient shard, and its forward
    no [tokens, V/t] beyond what it keeps. ``memory_breakdown`` prices the layouts from them; ``full`` recompute
    and TP with CP (not measured) are refused."""
    tokens = BATCH * SEQ
    config = TransformerConfig(**SHAPE, num_layers=2)
    padded = config.padded_vocab_size(64)
    for rank, measured in enumerate(launcher(2, _tp_compiled_bytes, TP_CASES)):
        for sp, (by_part, forward_transient, backward_peak) in measured.items():
            for mode in TP_CASES[sp]:
                kept, _ = layer_activation_bytes(config, tokens, act_bytes=2, tp=2, sequence_parallel=sp,
                                                 recompute=mode, compiled=True)  # fmt: skip
                assert by_part[mode] == kept, (rank, sp, mode, by_part[mode], kept)
                layout = ParallelConfig(tensor_parallel_size=2, sequence_parallel=sp, recompute=mode,
                                        micro_batch_size=BATCH, torch_compile=True).resolve(2)  # fmt: skip
                activations = memory_breakdown(config, layout, SEQ, 1).heaviest.activations
                assert activations == by_part["edge"] + 2 * by_part[mode] + by_part["head"], (rank, sp, mode)
            assert by_part["edge"] == model_edge_bytes(config, tokens, act_bytes=2)
            head = head_bytes(config, tokens, padded_vocab=padded, act_bytes=2, tp=2, sp=sp, compiled=True)
            assert by_part["head"] == head.saved, (rank, sp, by_part["head"], head.saved)
            assert head.backward_transient <= backward_peak <= head.backward_transient + tokens * 8
            assert forward_transient <= tokens * 16  # per-token statistics: no [tokens, V/t] tensor
    with pytest.raises(ValueError, match="recompute='full'"):
        layer_activation_bytes(config, tokens, tp=2, recompute="full", compiled=True)
    layout = ParallelConfig(tensor_parallel_size=2, context_parallel_size=2, torch_compile=True).resolve(4)
    with pytest.raises(ValueError, match="not both together"):
        memory_breakdown(config, layout, SEQ, 1)


def test_compiled_memory_model_refuses_what_it_does_not_price():
    """LoRA, MTP and MoE / MLA blocks under compile are not modelled: refused, naming the fix."""
    from lightning_flagscale.config.lora import LoRAConfig

    config = TransformerConfig(**SHAPE, num_layers=2)
    layout = ParallelConfig(torch_compile=True).resolve(1)
    with pytest.raises(ValueError, match="full fine-tuning"):
        memory_breakdown(config, layout, SEQ, 1, lora=LoRAConfig(rank=4))
    moe = TransformerConfig(**SHAPE, num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
    with pytest.raises(ValueError, match="dense blocks with standard attention"):
        memory_breakdown(moe, layout, SEQ, 1)
